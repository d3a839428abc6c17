"""A lane's calls reach the kernel's compute thread in the order their caller numbered them.

The gateway sends a model's next forward_backward / optim_step while the previous one still runs (its
`Sequencer` pipelines them), each carrying (lane, number) in the call's metadata (client.ORDER_METADATA). Two
calls sent a moment apart may still be picked up by the kernel's gRPC threads in either order, so a call waits
here until the call numbered before it has been handed to the compute thread (a FIFO), then goes itself. It
waits for its predecessor's *arrival*, never for its result: the wait is short unless the predecessor was lost
on its way (its caller's connection broke), and after GAP_S it goes anyway.

A lane starts at 1; a number at or below one already let through goes at once (a call sent again).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

log = logging.getLogger(__name__)

GAP_S = 5.0
MAX_LANES = 4096  # lanes remembered (least recently used forgotten): one per model a gateway has driven


class CallOrder:
    def __init__(self, gap_s: float = GAP_S, max_lanes: int = MAX_LANES):
        self.gap_s, self.max_lanes = gap_s, max_lanes
        self._next: OrderedDict[str, int] = OrderedDict()  # lane -> the number it lets through next
        self._turn = threading.Condition()
        self.gaps = 0  # calls that went without their predecessor (it never came)

    @contextlib.contextmanager
    def turn(self, lane: str, number: int) -> Iterator[None]:
        """Held while the call is handed on (to the compute thread's queue): the next number waits for it."""
        with self._turn:
            deadline = time.monotonic() + self.gap_s
            while (expected := self._next.get(lane, 1)) < number:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.gaps += 1
                    log.warning(
                        "lane %s: call %d went without %d..%d (never arrived)", lane, number, expected, number - 1
                    )
                    break
                self._turn.wait(left)
            try:
                yield
            finally:
                self._next[lane] = max(expected, number + 1)
                self._next.move_to_end(lane)
                while len(self._next) > self.max_lanes:
                    self._next.popitem(last=False)
                self._turn.notify_all()


def parse_order(value: str | None) -> tuple[str, int] | None:
    """ORDER_METADATA's "<lane> <number>" (None: the call is not ordered); ValueError naming what is wrong."""
    if value is None:
        return None
    lane, _, number = value.partition(" ")
    if not lane or len(lane) > 128 or not number.isdigit() or len(number) > 18 or int(number) < 1:
        raise ValueError(
            f"order {value[:160]!r}: expected '<lane> <number>' (a name of 1-128 characters, a number >= 1)"
        )
    return lane, int(number)
