"""Queue policies: which waiting ticket a free group serves next. A small registry, no state of its own.

A policy is a sort key over tickets (the smallest is served next). Every key ends in the ticket's arrival
number, so ties go to the earlier request and nobody waits forever behind a job that keeps coming back.

* `weighted` (the default): start-time fair queuing on device time / weight. A ticket's start tag is the
  later of the group's virtual clock and the end of its lease's service so far (`finish_tag`).
* `lrs`: least recently served first.
* `fifo`: arrival order.

`returning_key` (weighted only) is the key the lease that just released would have if it asked again at
once; the scheduler holds the group briefly for it when that key beats every waiter's (it is next anyway,
so switching away and back would cost two evictions for nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Policy:
    name: str
    key: Callable[[Any], tuple]  # ticket -> sort key
    returning_key: Callable[[Any, Any], tuple] | None = None  # (group, lease) -> sort key; None: never hold


def _weighted(t) -> tuple:
    return (t.start_tag, t.lease.last_served_at, t.seq)


def _weighted_returning(g, lease) -> tuple:
    return (max(g.vclock, lease.finish_tag), lease.last_served_at, math.inf)  # after any real ticket's tie


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("weighted", _weighted, _weighted_returning),
        Policy("lrs", lambda t: (t.lease.last_served_at, t.seq)),
        Policy("fifo", lambda t: (t.seq,)),
    )
}
