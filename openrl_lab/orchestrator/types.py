"""What the orchestrator reports: plain frozen dataclasses, the same in-process and over gRPC.

Field names match the messages in `orchestrator.proto`, so `to_proto` / `from_proto` convert both ways.
Every type has `to_dict()`; lists of them become DataFrames with `pandas.DataFrame([r.to_dict() ...])`.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# A lease's class: `interactive` phases go before `batch` ones while the group's interactive share lasts.
PRIORITIES = ("interactive", "batch")
# How a phase was queued (timeline records, queue entries): went first as interactive (PRIORITIZED), queued as
# batch although its lease is interactive (CAPPED: the group's interactive share was used up), or "batch".
PRIORITIZED, CAPPED = "interactive", "interactive-capped"
# A phase a group reserved for a gang ran out of order while the gang waited for its other groups (timeline
# records only: see "Gangs" in the scheduler's docstring).
BACKFILL = "backfill"


class _Record:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[arg-type]


@dataclass(frozen=True)
class GroupInfo(_Record):
    group_id: str
    aliases: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    policy: str = "weighted"
    max_phase_s: float = 0.0  # a phase held longer while another job waits is revoked; 0: no limit


def group_names(groups: Iterable[GroupInfo]) -> dict[str, str]:
    """Every name a group answers to (its id and its aliases) -> its id. The one place aliases resolve."""
    return {n: g.group_id for g in groups for n in (g.group_id, *g.aliases)}


def describe_groups(groups: Iterable[GroupInfo]) -> str:
    """`a (aliases x, y), b`: for messages that list the groups there are."""
    return ", ".join(g.group_id + (f" (aliases {', '.join(g.aliases)})" if g.aliases else "") for g in groups)


@dataclass(frozen=True)
class LeaseInfo(_Record):
    lease_id: str
    name: str
    group_id: str
    owner: str
    weight: float
    quota_s: float
    used_s: float
    slices: int
    ttl_s: float
    expires_at: float
    created_at: float
    state: str  # idle | waiting | holding
    resident: str  # none | device | evicting | host
    evictions: int = 0
    restores: int = 0
    heartbeat_interval_s: float = 0.0
    holder_timeout_s: float = 0.0
    reattached: bool = False
    queue_position: int = 0
    driven_by: str = ""  # the service that drives it on the owner's behalf ("" when the owner does)
    reason: str = ""  # while waiting: why, in one sentence (the orchestrator's, shown as is by every view)
    expected_wait_s: float | None = None  # while waiting: rough seconds until granted; None: unknown / not waiting
    priority: str = "batch"  # interactive | batch: whether its phases may go before batch ones (see the scheduler)


@dataclass(frozen=True)
class Grant(_Record):
    """The server's answer to an acquire: the group is held for one phase (a slice)."""

    slice_id: str
    lease_id: str
    group_id: str
    job: str
    kind: str
    waited_s: float
    must_restore: bool
    granted_at: float
    heartbeat_interval_s: float = 0.0
    switch_wait_s: float = 0.0


@dataclass(frozen=True)
class ReleaseResult(_Record):
    evict_requested: bool
    switch_id: int = 0
    run_s: float = 0.0
    evict_s: float = 0.0  # time the client's evict callback took (0 when none ran)
    waiter_same_process: bool = False  # evict_requested: the waiting job runs in the caller's process


@dataclass(frozen=True)
class LeaseEvent(_Record):
    type: str  # evict | revoked | unknown_lease
    lease_id: str
    group_id: str = ""
    switch_id: int = 0
    slice_id: str = ""
    message: str = ""
    # evict: the job waiting for the group runs in the same process (incarnation) as the evicting one, so
    # state the process's jobs share (a base model) may stay on the device
    waiter_same_process: bool = False


@dataclass(frozen=True)
class QueueEntry(_Record):
    job: str  # the lease name; "" for another user's job
    mine: bool
    lease_ref: str
    kind: str = ""  # "" for another user's phase unless it is one of the server's own kinds (reporting.py)
    since: float = 0.0
    weight: float = 1.0
    position: int = 0
    reason: str = ""  # waiting entries: why, in one sentence
    expected_wait_s: float | None = None  # waiting entries: rough seconds until granted; None: unknown
    # waiting entries: how it is queued now (interactive: before batch; interactive-capped: as batch, the
    # group's interactive share is used up; batch); the holder: how it was granted; else the lease's class
    priority: str = "batch"


@dataclass(frozen=True)
class DutyCycle(_Record):
    group_id: str
    since: float
    until: float
    wall_s: float
    busy_s: float
    switch_s: float
    duty_cycle: float
    switch_share: float
    slices: int


@dataclass(frozen=True)
class GroupStatus(_Record):
    group: GroupInfo
    holder: QueueEntry | None
    queue: tuple[QueueEntry, ...]
    resident: QueueEntry | None
    switching: bool
    duty: DutyCycle
    slices: int
    evictions: int
    restores: int
    revocations: int
    # the group's interactive share: seconds used by phases that went first as interactive, and allowed, over
    # the last `interactive_window_s`
    interactive_used_s: float = 0.0
    interactive_cap_s: float = 0.0
    interactive_window_s: float = 0.0

    def __str__(self) -> str:
        g = self.group
        h = self.holder
        holder = (h.job or "another job") + (f" ({h.kind})" if h.kind else "") if h else "free"
        limit = f" max_phase_s={g.max_phase_s:g}" if g.max_phase_s else ""
        return (
            f"{g.group_id} [{', '.join(g.devices)}] policy={g.policy}{limit}: holder {holder}, "
            f"{len(self.queue)} waiting, duty cycle {self.duty.duty_cycle:.0%} over {self.duty.wall_s:.0f} s, "
            f"{self.slices} slices, {self.evictions} evictions, {self.revocations} revoked, interactive "
            f"{self.interactive_used_s:.0f} of {self.interactive_cap_s:.0f} s in the last "
            f"{self.interactive_window_s:g} s"
        )


@dataclass(frozen=True)
class SliceRecord(_Record):
    """One slice on the timeline: group, job, phase kind, wait, run, switch cost."""

    seq: int
    slice_id: str
    group_id: str
    job: str  # "" for another user's slice (so are its error and, unless a server kind, its kind)
    mine: bool
    lease_ref: str
    kind: str
    requested_at: float
    granted_at: float
    released_at: float  # 0 while running
    wait_s: float
    run_s: float
    switch_s: float
    restore_s: float
    evict_s: float
    must_restore: bool
    outcome: str  # running | ok | failed | revoked | interrupted
    error: str = ""
    # interactive (went first) | interactive-capped (queued as batch) | batch | backfill (ran out of order on a
    # group reserved for a gang while the gang waited for its other groups)
    priority: str = "batch"
    gang: str = ""  # the gang phase key it was one rank's slice of ("": a single-device slice; "" for another user's)
    gang_size: int = 0  # that gang's number of ranks (0: a single-device slice)


@dataclass(frozen=True)
class Timeline(_Record):
    records: tuple[SliceRecord, ...]
    duty: DutyCycle
    last_seq: int

    def to_dataframe(self):
        import pandas as pd

        return pd.DataFrame([r.to_dict() for r in self.records])


@dataclass
class Slice:
    """A slice as the client holds it: the grant, plus whether the client restored the job's state."""

    grant: Grant
    restored: bool = False
    restore_s: float = 0.0
    released: bool = False
    release: ReleaseResult | None = field(default=None, repr=False)

    slice_id = property(lambda self: self.grant.slice_id)
    lease_id = property(lambda self: self.grant.lease_id)
    group_id = property(lambda self: self.grant.group_id)
    job = property(lambda self: self.grant.job)
    kind = property(lambda self: self.grant.kind)
    waited_s = property(lambda self: self.grant.waited_s)
    must_restore = property(lambda self: self.grant.must_restore)


# --- conversion to and from the protobuf messages -----------------------------------------------------

# Optional numbers that are -1 on the wire when None (unknown): proto3 scalars have no "unset".
UNKNOWN_IS_NEGATIVE = frozenset({"expected_wait_s"})


def to_proto(msg_cls, obj):
    """A dataclass above -> its protobuf message (field by field, nested where the field is a message)."""
    kwargs = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            if f.name not in UNKNOWN_IS_NEGATIVE:
                continue
            value = -1.0
        desc = msg_cls.DESCRIPTOR.fields_by_name.get(f.name)
        if desc is None:
            continue
        if desc.message_type is not None:
            sub = msg_cls.DESCRIPTOR.fields_by_name[f.name].message_type._concrete_class
            value = [to_proto(sub, v) for v in value] if isinstance(value, (list, tuple)) else to_proto(sub, value)
        elif isinstance(value, tuple):
            value = list(value)
        kwargs[f.name] = value
    return msg_cls(**kwargs)


def from_proto(cls, msg):
    """A protobuf message -> the dataclass `cls` (unset message fields become None)."""
    kwargs = {}
    for name, kind, sub in _plan(cls, msg.DESCRIPTOR):
        value = getattr(msg, name)
        if kind == "message":
            value = from_proto(sub, value) if msg.HasField(name) else None
        elif kind == "messages":
            value = tuple(from_proto(sub, v) for v in value)
        elif kind == "repeated":
            value = tuple(value)
        elif kind == "unknown_is_negative":
            value = None if value < 0 else value
        kwargs[name] = value
    return cls(**kwargs)


@functools.cache
def _plan(cls, descriptor) -> tuple[tuple[str, str, type | None], ...]:
    """How `from_proto` fills `cls` from a message of `descriptor`: (field, kind, dataclass of a message field),
    worked out once per pair (resolving the type hints took ~50 us, on every grant a client received)."""
    hints = typing.get_type_hints(cls)
    plan = []
    for f in dataclasses.fields(cls):
        desc = descriptor.fields_by_name.get(f.name)
        if desc is None:
            continue
        hint = hints[f.name]
        if desc.message_type is not None:
            if _is_repeated(desc):
                plan.append((f.name, "messages", typing.get_args(hint)[0]))
            else:
                plan.append(
                    (f.name, "message", next(a for a in (typing.get_args(hint) or (hint,)) if a is not type(None)))
                )
        else:
            plan.append(
                (
                    f.name,
                    "repeated"
                    if _is_repeated(desc)
                    else "unknown_is_negative"
                    if f.name in UNKNOWN_IS_NEGATIVE
                    else "scalar",
                    None,
                )
            )
    return tuple(plan)


def _is_repeated(desc) -> bool:
    rep = getattr(desc, "is_repeated", None)
    return rep if rep is not None else desc.label == desc.LABEL_REPEATED
