"""The scheduler's mutable records: leases, tickets (waiting acquires), held slices, switches (evictions in
progress), timeline records, groups and subscriber queues. Plain data; `Scheduler` changes them under its
lock, `reporting` turns them into what users see, `store` persists the rows they give.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field

from openrl_lab.orchestrator.errors import OrchestratorError
from openrl_lab.orchestrator.store import LEASE_COLUMNS, SLICE_COLUMNS
from openrl_lab.orchestrator.types import PRIORITIZED, Grant

RECENT_PHASES = 8  # phases per lease (and 4x that per group) the expected waits are estimated from


@dataclass(eq=False)
class Lease:
    id: str
    owner: str
    group_id: str
    name: str
    weight: float
    quota_s: float
    ttl_s: float
    created_at: float
    expires_at: float
    used_s: float = 0.0
    slices: int = 0
    last_served_at: float = 0.0  # when its last slice was granted
    finish_tag: float = 0.0  # weighted fair queuing: virtual time when its service so far ends
    state_loc: str = "none"  # none | device | evicting | host
    evictions: int = 0
    restores: int = 0
    last_seen: float = 0.0  # last heartbeat or call
    last_release_at: float | None = None
    gap_ewma: float | None = None  # how soon it usually comes back after a release
    ticket: Ticket | None = None
    slice: Held | None = None
    evict_switch: int = 0  # the switch whose eviction it was asked for and has not reported
    evict_sent_at: float = 0.0
    agent: str = ""  # the service identity driving it on the owner's behalf ("": the owner drives it)
    res_instance: str = ""  # the process (instance, incarnation) that reported its resident state
    res_incarnation: str = ""
    agent_instance: str = ""  # the process of the agent that created or last re-created it: its job lives there
    agent_incarnation: str = ""
    priority: str = "batch"  # interactive | batch (PRIORITIES): whether its phases may go before batch ones
    # lengths (s) of its last few phases, grant to release: what `reporting.expected_waits` estimates from
    phases: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_PHASES))

    @property
    def actor(self) -> str:
        """The user whose calls act on the lease (acquire, release, heartbeat, evict reports, close)."""
        return self.agent or self.owner

    def row(self) -> tuple:
        return tuple(getattr(self, column) for column in LEASE_COLUMNS)


@dataclass(eq=False)
class Ticket:
    """One acquire waiting for its group."""

    seq: int
    lease: Lease
    group: Group
    kind: str
    requested_at: float
    start_tag: float
    event: threading.Event = field(default_factory=threading.Event)
    grant: Grant | None = None
    cancelled: bool = False
    error: OrchestratorError | None = None
    instance: str = ""  # the process that asked (see the scheduler's docstring)
    incarnation: str = ""
    gang: Gang | None = None  # the gang phase it is one rank's slice of (None: a single-device acquire)

    def done(self) -> bool:
        return self.grant is not None or self.cancelled

    def ready(self) -> bool:
        """Whether it counts in its group's queue: a single acquire always, a gang member once its gang is complete."""
        return self.gang is None or self.gang.seq > 0


@dataclass(eq=False)
class Gang:
    """One gang phase: the tickets of one owner that share a gang key, one per group, granted all at once."""

    key: str
    owner: str
    size: int
    created_at: float  # when its first rank asked (`gang_assemble_s` counts from here)
    members: dict[str, Ticket] = field(default_factory=dict)  # group id -> that rank's ticket
    seq: int = 0  # global order of completion (all `size` ranks asked); 0 while it assembles

    @property
    def complete(self) -> bool:
        return self.seq > 0


@dataclass(eq=False)
class Held:
    """A slice being held: the group is the lease's until it is released or revoked."""

    id: str
    lease: Lease
    group: Group
    ticket: Ticket
    granted_at: float
    last_claimed: float  # last heartbeat that named it
    rec: Rec


@dataclass(eq=False)
class Switch:
    """The group waiting for a job to move its state off the devices."""

    id: int
    evicting: Lease
    target: Ticket | None
    started_at: float
    reason: str  # release (the holder was told in its release) | idle (it was asked by an event)
    same_process: bool = False  # the waiter runs in the process that holds the evicting job's state


class Rec:
    """A timeline record, updated in place from running to its outcome (each change gets a new seq)."""

    __slots__ = (
        "error",
        "evict_s",
        "gang",
        "gang_size",
        "granted_at",
        "group_id",
        "job",
        "kind",
        "lease_id",
        "must_restore",
        "outcome",
        "owner",
        "priority",
        "released_at",
        "requested_at",
        "restore_s",
        "run_s",
        "seq",
        "slice_id",
        "switch_s",
        "switch_wait_s",
        "wait_s",
    )

    def __init__(self, **kw):
        self.switch_wait_s = 0.0
        self.priority = "batch"
        self.gang = ""
        self.gang_size = 0
        for k, v in kw.items():
            setattr(self, k, v)

    @classmethod
    def from_row(cls, row: dict) -> Rec:
        """A record read back from SQLite (which keeps switch_s = switch wait + restore)."""
        rec = cls(**row)
        rec.must_restore = bool(row["must_restore"])
        rec.switch_wait_s = max(0.0, row["switch_s"] - row["restore_s"])
        return rec

    def row(self) -> tuple:
        return tuple(getattr(self, column) for column in SLICE_COLUMNS)  # SQLite keeps must_restore as 0/1


@dataclass(eq=False)
class Group:
    id: str
    devices: tuple[str, ...]
    aliases: tuple[str, ...]
    policy: str
    max_phase_s: float  # 0: no limit
    records: collections.deque
    holder: Held | None = None
    queue: list[Ticket] = field(default_factory=list)
    resident: Lease | None = None
    switch: Switch | None = None
    hold: tuple[Lease, float] | None = None  # (lease, until): held for the job that just released
    last_switch: tuple[float, float] | None = None  # (started_at, evict_s) of an eviction that just finished
    vclock: float = 0.0
    slices: int = 0
    evictions: int = 0
    restores: int = 0
    revocations: int = 0
    # the last phases of any job (s) and the last switch costs (eviction wait + restore, s) of hand-offs that had one
    phases: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4 * RECENT_PHASES))
    switches: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4 * RECENT_PHASES))
    # (granted_at, released_at) of the ended slices that went first as interactive, oldest first, and the
    # sum of their lengths: what `priority_used` counts over the sliding window
    priority_spans: collections.deque = field(default_factory=collections.deque)
    priority_total: float = 0.0

    def note_phase(self, lease: Lease | None, rec: Rec) -> None:
        """Remembers an ended slice's phase length (and switch cost) for the wait estimates."""
        if rec.outcome not in ("ok", "failed", "revoked") or not rec.released_at:
            return
        length = max(0.0, rec.released_at - rec.granted_at)
        self.phases.append(length)
        if lease is not None:
            lease.phases.append(length)
        if rec.switch_s > 0:
            self.switches.append(rec.switch_s)
        if rec.priority == PRIORITIZED:
            self.priority_spans.append((rec.granted_at, rec.released_at))
            self.priority_total += rec.released_at - rec.granted_at

    def priority_used(self, now: float, window_s: float) -> float:
        """Seconds of the last `window_s` the group spent on phases that went first as interactive (a running one
        counts up to `now`). Spans never overlap and come in order, so only the oldest kept can straddle the
        window's start."""
        start = now - window_s
        spans = self.priority_spans
        while spans and spans[0][1] <= start:
            a, b = spans.popleft()
            self.priority_total -= b - a
        used = self.priority_total - (max(0.0, start - spans[0][0]) if spans else 0.0)
        h = self.holder
        if h is not None and h.rec.priority == PRIORITIZED:
            used += max(0.0, now - max(h.granted_at, start))
        return max(0.0, used)


class Subscription:
    """A subscriber's queue: lease events of one owner (a client session), or one group's timeline."""

    def __init__(self, owner: str, group_id: str | None = None):
        self.owner = owner
        self.group_id = group_id
        self.leases: set[str] = set()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False

    def put(self, item) -> None:
        if not self.closed:
            self.queue.put(item)

    def get(self, timeout: float | None = None):
        """The next item, or None after `timeout` or once closed."""
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.closed = True
        self.queue.put(None)
