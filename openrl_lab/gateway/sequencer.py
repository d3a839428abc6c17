"""Per-model ordering: training requests run in seq_id order, whatever order their HTTP requests arrive in.

The SDK sends the chunks of one forward_backward concurrently (the first chunk last), so a request may
arrive before the one it must follow. A sequencer holds it until its predecessor has arrived. A seq_id that
never arrives (its request was rejected before its seq_id could be read) is skipped after a grace period.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Work = Callable[[], Awaitable[None]]
GAP_GRACE_S = 5.0


class Sequencer:
    def __init__(self, first_seq: int = 1):
        self.next_seq = first_seq
        self._waiting: dict[int, Work | None] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def submit(self, seq_id: int | None, work: Work) -> None:
        if seq_id is None or seq_id < self.next_seq:
            # No place in the order (or an old number reused): run after what is queued now.
            seq_id = max([self.next_seq - 1, *self._waiting]) + 0.5  # type: ignore[assignment]
        self._waiting[seq_id] = work
        self._kick()

    def clear(self) -> None:
        """Forgets what waits (its run was freed); a call already running finishes or is cancelled on its own."""
        self._waiting.clear()

    def skip(self, seq_id: int) -> None:
        """A seq_id whose request was refused: let the ones after it go."""
        if seq_id >= self.next_seq:
            self._waiting[seq_id] = None
            self._kick()

    def _kick(self) -> None:
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self._waiting:
            ready = [s for s in self._waiting if s <= self.next_seq]
            if ready:
                seq = min(ready)
                work = self._waiting.pop(seq)
                if seq == self.next_seq:
                    self.next_seq += 1
                if work is not None:
                    await work()
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=GAP_GRACE_S)
            except TimeoutError:
                self.next_seq = int(min(self._waiting))  # the missing one is not coming
