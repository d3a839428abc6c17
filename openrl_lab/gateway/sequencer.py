"""Per-model ordering: training requests run in seq_id order, whatever order their HTTP requests arrive in.

The SDK sends the chunks of one forward_backward concurrently (the first chunk last), so a request may
arrive before the one it must follow. A sequencer holds it until its predecessor has arrived. A seq_id that
never arrives (its request was rejected before its seq_id could be read) is skipped after a grace period.

Pipelined work (`submit(..., pipelined=True)`: one kernel operation, e.g. forward_backward or optim_step) lets
the next request go once it has been *sent* to the kernel, not once it finished: the kernel holds the model's
queued call and starts it the moment the previous one ends, so it never idles between a model's calls. The
kernel keeps their order by the numbers `ticket()` hands out (the sequencer's `lane`, then 1, 2, ...: see
kernel/ordering.py). At most `depth` of a model's calls are out at once ($OPENRL_LAB_PIPELINE_DEPTH; 1 turns
pipelining off); other work waits until every call before it has finished (it may depend on their results).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

Work = Callable[[], Awaitable[None]]
# Pipelined work: called with `sent`, which it calls once its kernel call is on its way (or never: then its
# end lets the next go).
PipelinedWork = Callable[[Callable[[], None]], Awaitable[None]]
GAP_GRACE_S = 5.0


class Sequencer:
    def __init__(self, first_seq: int = 1, depth: int = 2):
        """`depth`: pipelined calls out at once. Two (one running on the kernel, one queued behind it) keep the
        kernel busy; more would only hold more of the gateway's threads."""
        self.next_seq, self.depth = first_seq, depth
        self._waiting: dict[int, tuple[Work | PipelinedWork, bool] | None] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._out: set[asyncio.Task] = set()  # pipelined work sent and not yet finished
        # This sequencer's calls on the kernel: a new sequencer (a new gateway, a model made again) is a new lane.
        self.lane = uuid.uuid4().hex
        self._tickets = 0

    def submit(self, seq_id: int | None, work: Work | PipelinedWork, pipelined: bool = False) -> None:
        if seq_id is None or seq_id < self.next_seq:
            # No place in the order (or an old number reused): run after what is queued now.
            seq_id = max([self.next_seq - 1, *self._waiting]) + 0.5  # type: ignore[assignment]
        self._waiting[seq_id] = (work, pipelined)
        self._kick()

    def ticket(self) -> tuple[str, int]:
        """(lane, number) for the kernel call being sent now: numbers follow the order calls are sent in."""
        self._tickets += 1
        return self.lane, self._tickets

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
                entry = self._waiting.pop(seq)
                if seq == self.next_seq:
                    self.next_seq += 1
                if entry is not None:
                    await self._start(*entry)
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=GAP_GRACE_S)
            except TimeoutError:
                self.next_seq = int(min(self._waiting))  # the missing one is not coming

    async def _start(self, work: Work | PipelinedWork, pipelined: bool) -> None:
        if not pipelined:
            if self._out:
                await asyncio.wait(set(self._out))
            await work()  # type: ignore[call-arg]
            return
        while len(self._out) >= self.depth:
            await asyncio.wait(set(self._out), return_when=asyncio.FIRST_COMPLETED)
        sent = asyncio.get_running_loop().create_future()

        def mark_sent(*_: object) -> None:
            if not sent.done():
                sent.set_result(None)

        task = asyncio.get_running_loop().create_task(work(mark_sent))  # type: ignore[call-arg]
        self._out.add(task)
        task.add_done_callback(self._out.discard)
        task.add_done_callback(mark_sent)
        await sent
