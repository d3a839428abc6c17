"""The orchestrator's core: groups, leases, queues, policies, lazy yield and the timeline (pure Python).

No gRPC and no torch here: the gRPC service (`service.py`) is a thin layer over one `Scheduler`, and
tests and the simulation benchmark drive it directly, with a fake clock if they like. All methods are
thread-safe (one lock); only `wait`/`acquire` block.

Words (docs/architecture.md): a *lease* is a job's long-lived right to a share of one group; a *slice* is one
exclusive hold of the group for one phase; a lease's *resident state* is what its job keeps on the
group's devices between phases.

How a group passes from job to job:

* `request` queues the lease; the policy picks the next waiter whenever the group is free:
  `weighted` (start-time fair queuing on device time / weight; the default), `lrs` (least recently
  served) or `fifo`. Nobody waits forever: under every policy a waiter is served before a job that
  keeps coming back.
* Lazy yield: when a holder releases and nobody waits, nothing moves — its state stays on the device
  (`resident`) and its next slice starts with `must_restore=False`. When someone waits, `release`
  answers `evict_requested=True`; the group passes on once the job reports the eviction
  (`report_evicted`). When a waiter arrives while the group is idle with another job's state on it, that
  job is asked to evict (an `evict` event on its session) and the group passes on when it reports.
  A job that kept no state (`keep_resident=False`) is never asked.
* Weighted only: when the job that just released is ahead of every waiter by the policy and usually
  re-acquires within `reacquire_grace_s`, the group is held for it that long instead of switching twice.
* Interactive priority: a lease is `interactive` or `batch` (the default). At a phase boundary a waiting
  interactive phase goes before waiting batch phases (among themselves, each class in the policy's order),
  so a person waiting on a notebook cell does not queue behind other jobs' long phases. Nothing is
  preempted: a running phase always finishes. So that batch work is never starved, the phases that went
  first this way may use at most `interactive_share` of the group's time over the last
  `interactive_window_s` (`Group.priority_used`); past it, interactive phases queue as batch until the
  window slides on. A phase that went first moves the fair-share clock only as far as the policy alone would
  have (the smallest waiting start tag), so its device time still counts against its lease's share. Every
  slice record says how it was queued (`priority`).
* A slice nobody heartbeats for `holder_timeout_s` is revoked (the holder died or hung); an eviction
  whose job stops heartbeating is given up after the same timeout.
* A phase that has held its group for longer than the group's `max_phase_s` while another job waits is
  revoked too, heartbeats or not, and the waiter is granted at once: one long phase cannot keep a group
  from everyone else. Cooperative slicing cannot stop the phase itself: it runs on while the waiter runs
  (the group is shared for that time), its job's state is no longer counted as resident (nobody is asked
  to wait for its eviction), and it learns why from its `revoked` event, the timeline record (outcome
  `revoked`, the reason in `error`) and its release (FAILED_PRECONDITION naming the reason).
* Every slice is recorded: group, job, kind, wait, run, switch cost (eviction wait + restore);
  `duty_cycle` is busy time / wall time per group. What each user sees of it (and of the queues, with the
  sentence saying why a job waits) is built in `reporting.py`, redacted per viewer.

Gangs: a job sharded over N devices runs each phase on N groups at once (one rank per group). Each rank's
acquire names the gang phase (`gang`, a key, and `gang_size` N): the acquires of one owner that share a key
form one gang phase, each on a different group, and the scheduler grants its N slices all at once, never some
of them, and only once all N ranks have asked. The rule, deadlock- and starvation-free:

* A gang member counts in its group's queue only once its gang is *complete* (all N asked); until then it
  waits aside. A gang that is not complete `gang_assemble_s` after its first rank asked fails: the ranks that
  asked get FailedPrecondition saying how many of the N asked (a rank's kernel died, say).
* Complete gangs are numbered in the order they completed (a global sequence). In each group's order the
  places the policy gives gang members go to the gangs by that number, earliest first, whatever the policy
  says between them; single-device tickets keep their policy places relative to gangs (interactive ones
  included). So of any two gangs, the earlier is ahead of the later in every group both need: no two gangs
  can each wait for a group the other is first in (no deadlock).
* A free group whose first waiter is a complete gang's member is *reserved* for that gang: it grants nobody
  else, and whatever state another lease keeps resident there is asked to evict at once (the lazy-yield
  switch, as for any waiter). The gang is granted when every one of its groups is reserved for it, free and
  switched. Reservations are recomputed at every dispatch (nothing is sticky): a reserved group whose order
  changes (an interactive phase arrives, the gang is cancelled) serves its new first waiter.
* No starvation: the earliest complete gang is first among gangs in all its groups, so it waits only for
  single-device phases ahead of it by the policy, which drain (the fair-share clock passes its start tag;
  lrs and fifo age it), for running phases to end (`max_phase_s` revokes one that overruns while a gang
  waits, like any waiter), and for evictions (`evict_timeout_s`).
* Backfill (`gang_backfill`, on by default; conservative, as in EASY backfilling): a free group reserved for a
  gang that waits for a running phase on another of its groups grants a waiting single-device phase out of
  order (the first in its order that fits), instead of idling, when that phase should end before the gang
  could start anyway: its lease's own mean recent phase (`reporting.own_phase`; no history: no backfill),
  plus the group's typical switch cost if the lease keeps state (the gang would wait for it to be evicted),
  is at most the least expected remaining run of the phases holding the gang's other groups (their own mean
  phase less how long they have run; any of them with no history, or all past their mean: no backfill).
  Nothing is evicted for a backfill: it is granted only when nobody's state is resident on the group or the
  candidate's own is (never when the gang's own rank's is). It is recorded with priority `backfill`, charged
  as usual, moves the fair-share clock only as far as the policy alone would have, and is never held for
  (`reacquire_grace_s`) on release: to run again out of order it must fit again. Why the gang cannot starve:
  every backfill is expected to end no later than some phase already running on the gang's groups, so the
  horizon only shrinks: once every phase the gang waits for by the policy has run past its expected end,
  nothing new is backfilled, and what was backfilled delays the gang by at most its own overrun (one phase
  per group, which `max_phase_s` revokes like any phase that overruns while someone waits). The same lease
  may be backfilled again and again for one reservation, each time only if it fits: repeats never move the
  horizon, so they cannot starve the gang. Without backfill the reserved groups idle until the gang starts.
* The `reacquire_grace_s` hold still applies: a group is held briefly for the job that just released when the
  policy has it next; if that job's next acquire is a gang member, the hold lasts until its gang completes
  (or the grace ends), then the gang competes as above.
* A member that stops waiting (cancelled, timed out, its caller gone, its lease closed) fails the whole gang
  phase: every other member's acquire fails with FailedPrecondition naming the gang and why. A key names one
  phase: a rank that asks with the key of a gang that already failed (within `2 * gang_assemble_s`) fails at
  once with the same error.
* Once granted, the N slices are ordinary slices: each is released, heartbeaten or revoked on its own.

Parts: `records.py` (the mutable records), `policies.py` (the queue orders), `reporting.py` (the views);
this module is the state machine that moves the records, under one lock.

Who may do what: a lease has an *owner* (whose limits it counts against and who sees it as theirs) and
an *actor* (who acquires, releases, heartbeats and closes it): the owner itself, or the service identity
(`service_users`, e.g. the kernels' user) that created it `on_behalf_of` the owner. The owner still sees
its lease (get/list, its name on the timeline); nobody else does (see `reporting`).

Which process holds the state: calls may name the process (`instance`, stable across its restarts, and
`incarnation`, fresh per process). The orchestrator records them with each lease's residency, tells an
evicting job whether the waiter runs in the same process (`waiter_same_process`: state that process's jobs
share may stay), and `drop_stale_residency` forgets what earlier incarnations of an instance left behind.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from openrl_lab.orchestrator import reporting
from openrl_lab.orchestrator.config import NAME, OrchestratorConfig, group_spec, load_config
from openrl_lab.orchestrator.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from openrl_lab.orchestrator.policies import POLICIES
from openrl_lab.orchestrator.records import Gang, Group, Held, Lease, Rec, Subscription, Switch, Ticket
from openrl_lab.orchestrator.store import LEASE_COLUMNS, OrchestratorStore
from openrl_lab.orchestrator.types import (
    BACKFILL,
    CAPPED,
    PRIORITIES,
    PRIORITIZED,
    DutyCycle,
    Grant,
    GroupInfo,
    GroupStatus,
    LeaseEvent,
    LeaseInfo,
    ReleaseResult,
    Timeline,
    describe_groups,
    group_names,
)

MIN_CHARGE_S = 1e-3  # a slice costs its lease at least this much device time (no free zero-length phases)
EVICT_RESEND_S = 1.0  # an evict request not yet reported is sent again on the job's next heartbeat after this
ALIVE_CHECK_S = 0.25  # how often a waiting acquire asks whether its caller is still there (`wait(alive=...)`)
KIND_MAX = 64
GANG_KEY_MAX = 256
GANG_SIZE_MAX = 4096
FAILED_GANGS_KEPT = 10000
GANG_RETRY_S = 0.25  # `tick` tries the waiting gangs again this often (their groups' orders may change with time)


class Scheduler:
    def __init__(
        self,
        config: OrchestratorConfig | dict | str | Path | None = None,
        store: OrchestratorStore | str | Path | None = None,
        clock: Callable[[], float] = time.time,
        on_grant: Callable[[Grant], None] | None = None,
        on_evict_request: Callable[[LeaseEvent], None] | None = None,
        service_users: Iterable[str] = (),
    ):
        self.config = load_config(config)
        # Users trusted to create leases on behalf of other users (the kernels' identity).
        self.service_users = frozenset(service_users)
        self.clock = clock
        self.on_grant = on_grant
        self.on_evict_request = on_evict_request
        self.store = OrchestratorStore(store) if isinstance(store, (str, Path)) else store
        self._lock = threading.RLock()
        self._wake = threading.Event()  # set when a deadline earlier than the reaper's next tick appears
        self._groups: dict[str, Group] = {}
        for spec in self.config.groups:
            g = Group(
                id=spec.id,
                devices=spec.devices,
                aliases=spec.aliases,
                policy=spec.policy,
                max_phase_s=float(self.config.max_phase_for(spec)),
                records=collections.deque(maxlen=int(self.config.timeline_kept)),
            )
            self._groups[g.id] = g
        self._names = group_names(self.list_groups())  # group id or alias -> group id
        self._leases: dict[str, Lease] = {}
        self._by_name: dict[tuple[str, str, str], Lease] = {}
        self._slices: dict[str, Held] = {}
        self._ended: collections.OrderedDict[str, tuple[str, str, str]] = collections.OrderedDict()
        self._ticket_seq = 0
        self._gangs: dict[tuple[str, str], Gang] = {}  # (owner, key) -> a gang phase waiting to be granted
        self._gang_seq = 0
        self._gangs_tried = 0.0
        # (owner, key) -> (why it failed, when): a late rank of a failed gang fails at once
        self._failed_gangs: collections.OrderedDict[tuple[str, str], tuple[str, float]] = collections.OrderedDict()
        self._switch_seq = 0
        self._seq = 0  # timeline change sequence
        self._event_subs: dict[str, list[Subscription]] = collections.defaultdict(list)
        self._timeline_subs: list[Subscription] = []
        self._last_expiry_check = 0.0
        self._closed = False
        self._reaper: threading.Thread | None = None
        if self.store is not None:
            self._load()

    # --- persistence --------------------------------------------------------------------------------
    def _load(self) -> None:
        now = self.clock()
        assert self.store is not None  # loaded only with a store
        state = self.store.load(int(self.config.timeline_kept))
        self._seq = state["seq"]
        for row in state["leases"]:
            if row["group_id"] not in self._groups:
                continue  # its group is no longer configured; the row stays for when it comes back
            L = Lease(
                **{k: row[k] for k in LEASE_COLUMNS if k != "expires_at"},
                expires_at=max(row["expires_at"], now + row["ttl_s"]),
                last_seen=now,
            )
            if L.state_loc == "evicting":
                L.state_loc = "device"  # its eviction was interrupted: it is asked again when someone needs the group
            self._leases[L.id] = L
            self._by_name[(L.owner, L.group_id, L.name)] = L
        for gid, row in state["groups"].items():
            g = self._groups.get(gid)
            if g is None:
                continue
            g.vclock = row["vclock"]
            R = self._leases.get(row["resident"] or "")
            if R is not None and R.state_loc == "device":
                g.resident = R
        for gid, rows in state["slices"].items():
            g = self._groups.get(gid)
            if g is None:
                continue
            for r in rows:
                rec = Rec.from_row(r)
                g.records.append(rec)
                g.note_phase(self._leases.get(rec.lease_id), rec)

    def ensure_group(self, group: str, device: str) -> str:
        """The id of group `group` (an id or alias); a group of that id on `device` is made when none exists (a
        kernel joining from another host brings its own group)."""
        with self._lock:
            gid = self._names.get(group)
            if gid is not None:
                return gid
            spec = group_spec(id=group, devices=(device,))  # InvalidArgument: the name's form
            g = Group(
                id=spec.id,
                devices=spec.devices,
                aliases=(),
                policy=spec.policy,
                max_phase_s=float(self.config.max_phase_for(spec)),
                records=collections.deque(maxlen=int(self.config.timeline_kept)),
            )
            self._groups[g.id] = g
            self._names = group_names(self.list_groups())
            return g.id

    def _save(self, L: Lease) -> None:
        if self.store is not None:
            self.store.lease_later(L.row())

    def _save_group(self, g: Group) -> None:
        if self.store is not None:
            self.store.group_later(g.id, g.resident.id if g.resident else None, g.vclock)

    # --- lookups -----------------------------------------------------------------------------------
    def _group(self, group_id: str) -> Group:
        gid = self._names.get(group_id)
        if gid is None:
            raise NotFound(f"group {group_id!r} not found; groups here: {describe_groups(self.list_groups())}")
        return self._groups[gid]

    def _lease(self, caller: str, lease_id: str, read: bool = False) -> Lease:
        """The lease if `caller` acts on it (or, `read`, also if it owns it)."""
        L = self._leases.get(lease_id)
        if L is None or not (caller == L.actor or (read and caller == L.owner)):
            # another user's lease is as absent as a missing one
            raise NotFound(
                f"lease {lease_id!r} not found (it expired, was closed, or belongs to another user); "
                "create or reattach one by name"
            )
        return L

    def _touch(self, L: Lease, now: float) -> None:
        L.last_seen = now
        L.expires_at = now + L.ttl_s

    # --- leases ------------------------------------------------------------------------------------
    def create_lease(
        self,
        owner: str,
        group_id: str,
        name: str,
        weight: float | None = None,
        quota_s: float | None = None,
        ttl_s: float | None = None,
        on_behalf_of: str | None = None,
        process: tuple[str, str] = ("", ""),
        priority: str | None = None,
    ) -> LeaseInfo:
        """A lease on `group_id` for `owner`'s job `name`; the existing one if the owner has a lease of that name
        on that group (reattach: weight, quota, TTL and priority are updated where given). `priority`:
        interactive | batch (default batch): see "Interactive priority" above.

        `on_behalf_of`: the caller (`owner` here) must be a service identity; the lease is then owned by that
        user and driven by the caller. `process`: the caller's (instance, incarnation), if it names them; a
        lease made on a user's behalf belongs to that process's life (`drop_stale_residency` closes it)."""
        cfg = self.config
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidArgument(
                f"lease name {name!r} is not allowed: 1-128 letters, digits and ._:@/+- starting with a letter or digit"
            )
        weight = _number("weight", weight, low=0.0, high=cfg.max_weight, low_open=True)
        quota_s = _number("quota_s", quota_s, low=0.0, high=cfg.max_quota_s, unit=" accelerator-seconds")
        ttl_s = _number("ttl_s", ttl_s, low=1.0, high=cfg.max_ttl_s, unit=" s")
        if priority is not None and priority not in PRIORITIES:
            raise InvalidArgument(f"priority {priority!r} is not a priority class: one of {', '.join(PRIORITIES)}")
        agent = ""
        if on_behalf_of and on_behalf_of != owner:
            if owner not in self.service_users:
                raise PermissionDenied(
                    f"user {owner!r} may not create leases on behalf of another user "
                    f"({on_behalf_of!r}): only the server's service identities may"
                )
            if not isinstance(on_behalf_of, str) or len(on_behalf_of) > 256 or not on_behalf_of.isprintable():
                raise InvalidArgument(f"on_behalf_of {on_behalf_of!r} is not a user name")
            owner, agent = on_behalf_of, owner
        with self._lock:
            g = self._group(group_id)
            now = self.clock()
            L = self._by_name.get((owner, g.id, name))
            if L is not None and L.agent != agent:
                who = f"the service {L.agent!r} on the user's behalf" if L.agent else "the user's own client"
                raise FailedPrecondition(
                    f"lease {name!r} of user {owner!r} on group {g.id!r} is driven by {who}; "
                    "one lease has one driver: use another lease name"
                )
            if L is not None:
                if agent:
                    L.agent_instance, L.agent_incarnation = process
                if weight is not None:
                    L.weight = weight
                if quota_s is not None:
                    L.quota_s = quota_s
                if ttl_s is not None:
                    L.ttl_s = ttl_s
                if priority is not None:
                    L.priority = priority
                self._touch(L, now)
                if self.store is not None:
                    self.store.put_lease(L.row())
                return self._lease_info(L, owner, reattached=True)
            mine = sum(1 for x in self._leases.values() if x.owner == owner)  # open leases: closed ones are gone
            if mine >= cfg.max_leases_per_user:
                raise ResourceExhausted(
                    f"user {owner!r} already has {mine} leases (the limit is "
                    f"{cfg.max_leases_per_user}); close some first"
                )
            ttl = ttl_s if ttl_s is not None else cfg.default_ttl_s
            L = Lease(
                id="lease-" + uuid.uuid4().hex[:16],
                owner=owner,
                group_id=g.id,
                name=name,
                weight=1.0 if weight is None else weight,
                quota_s=quota_s or 0.0,
                ttl_s=ttl,
                created_at=now,
                expires_at=now + ttl,
                last_seen=now,
                agent=agent,
                priority=priority or "batch",
            )
            if agent:
                L.agent_instance, L.agent_incarnation = process
            if self.store is not None:
                self.store.put_lease(L.row())
            self._leases[L.id] = L
            self._by_name[(owner, g.id, name)] = L
            return self._lease_info(L, owner)

    def get_lease(self, owner: str, lease_id: str) -> LeaseInfo:
        with self._lock:
            L = self._lease(owner, lease_id, read=True)
            if owner == L.actor:
                self._touch(L, self.clock())
            return self._lease_info(L, owner)

    def list_leases(self, owner: str, group_id: str | None = None) -> list[LeaseInfo]:
        """The leases `owner` owns or drives."""
        with self._lock:
            gid = self._group(group_id).id if group_id else None
            return [
                self._lease_info(L, owner)
                for L in self._leases.values()
                if owner in (L.owner, L.agent) and (gid is None or L.group_id == gid)
            ]

    def close_lease(self, owner: str, lease_id: str) -> None:
        with self._lock:
            L = self._lease(owner, lease_id)
            if L.slice is not None:
                raise FailedPrecondition(
                    f"lease {L.name!r} holds slice {L.slice.id} of group {L.group_id!r}; "
                    "release it before closing the lease"
                )
            self._drop_lease(L, "the lease was closed")

    def _drop_lease(self, L: Lease, why: str) -> None:
        g = self._groups[L.group_id]
        if L.ticket is not None:
            t = L.ticket
            t.error = Cancelled(f"lease {L.name!r} stopped waiting for group {g.id!r}: {why}")
            self._cancel_locked(t)
        if g.switch is not None and g.switch.evicting is L:
            self._finish_switch(g, evict_s=self.clock() - g.switch.started_at, state="none")
        elif g.resident is L:
            g.resident = None
            self._save_group(g)
        if g.hold is not None and g.hold[0] is L:
            g.hold = None
        del self._leases[L.id]
        self._by_name.pop((L.owner, L.group_id, L.name), None)
        if self.store is not None:
            self.store.delete_lease(L.id)
        self._dispatch(g, self.clock())

    def _lease_info(self, L: Lease, viewer: str, reattached: bool = False) -> LeaseInfo:
        g = self._groups[L.group_id]
        wait = None
        pos = 0
        note = ""
        if L.ticket is not None:
            now = self.clock()
            order = self._order(g, now)
            pos = order.index(L.ticket) + 1
            wait = reporting.expected_waits(g, order, now)[pos - 1]
            note = self._priority_notes(g, order, now)[pos - 1]
            if L.ticket.gang is not None:
                gang_reason = self._gang_reason(L.ticket.gang, viewer, now)
                return reporting.lease_info(
                    L, g, pos, viewer, self.config, reattached, expected_wait_s=None, note=note, reason=gang_reason
                )
        return reporting.lease_info(L, g, pos, viewer, self.config, reattached, expected_wait_s=wait, note=note)

    # --- slices ------------------------------------------------------------------------------------
    def request(
        self,
        owner: str,
        lease_id: str,
        kind: str = "phase",
        instance: str = "",
        incarnation: str = "",
        gang: str = "",
        gang_size: int = 0,
    ) -> Ticket:
        """Queues the lease for its group; granted at once if the policy allows. Wait with `wait`. `instance` and
        `incarnation` name the asking process (recorded with the residency the grant gives the lease).
        `gang`, `gang_size`: this acquire is one rank's slice of a gang phase of `gang_size` ranks (see "Gangs"
        above); "" and 0 for a single-device acquire."""
        if not isinstance(kind, str) or not kind or len(kind) > KIND_MAX or not kind.isprintable():
            raise InvalidArgument(f"phase kind {kind!r} is not allowed: 1-{KIND_MAX} printable characters")
        if gang or gang_size:
            if not isinstance(gang, str) or not gang or len(gang) > GANG_KEY_MAX or not gang.isprintable():
                raise InvalidArgument(
                    f"gang key {gang!r} is not allowed: 1-{GANG_KEY_MAX} printable characters (with gang_size >= 2)"
                )
            if isinstance(gang_size, bool) or not isinstance(gang_size, int) or not 2 <= gang_size <= GANG_SIZE_MAX:
                raise InvalidArgument(
                    f"gang {gang!r}: gang_size must be a whole number of ranks from 2 to {GANG_SIZE_MAX}, "
                    f"got {gang_size!r} (a single-device acquire names no gang)"
                )
        with self._lock:
            L = self._lease(owner, lease_id)
            g = self._groups[L.group_id]
            if L.slice is not None:
                raise FailedPrecondition(
                    f"lease {L.name!r} already holds slice {L.slice.id} of group {g.id!r} "
                    f"(a {L.slice.ticket.kind} phase); release it before acquiring again"
                )
            if L.ticket is not None:
                raise FailedPrecondition(
                    f"lease {L.name!r} is already waiting for group {g.id!r} (a "
                    f"{L.ticket.kind} phase); one acquire at a time per lease"
                )
            if L.quota_s and L.used_s >= L.quota_s:
                raise ResourceExhausted(
                    f"lease {L.name!r} has used its quota of {L.quota_s:g} accelerator-seconds "
                    f"({L.used_s:.1f} s); reattach it with a larger quota_s"
                )
            now = self.clock()
            X = self._join_gang(L, g, gang, gang_size, now) if gang else None
            self._touch(L, now)
            if L.last_release_at is not None:
                gap = max(0.0, now - L.last_release_at)
                L.gap_ewma = gap if L.gap_ewma is None else 0.7 * L.gap_ewma + 0.3 * gap
                L.last_release_at = None
            self._ticket_seq += 1
            t = Ticket(
                seq=self._ticket_seq,
                lease=L,
                group=g,
                kind=kind,
                requested_at=now,
                start_tag=max(g.vclock, L.finish_tag),
                instance=str(instance or ""),
                incarnation=str(incarnation or ""),
                gang=X,
            )
            L.ticket = t
            g.queue.append(t)
            if X is not None:
                if not X.members:
                    self._gangs[(X.owner, X.key)] = X
                    self._wake.set()  # its assembly deadline may be the reaper's next
                X.members[g.id] = t
                if len(X.members) == X.size:
                    self._gang_seq += 1
                    X.seq = self._gang_seq
            self._dispatch(g, now)
            return t

    def _join_gang(self, L: Lease, g: Group, key: str, size: int, now: float) -> Gang:
        """The gang phase `key` of `L`'s owner that `L`'s acquire on `g` joins (a new one if none waits); raises
        when it cannot join it (checked before anything changes)."""
        self._expire_failed_gangs(now)
        failed = self._failed_gangs.get((L.owner, key))
        if failed is not None:
            raise FailedPrecondition(failed[0])
        X = self._gangs.get((L.owner, key))
        if X is None:
            return Gang(key=key, owner=L.owner, size=size, created_at=now)
        if X.size != size:
            raise InvalidArgument(
                f"gang {key!r}: lease {L.name!r} on group {g.id!r} says it has {size} ranks, but the ranks "
                f"that asked before said {X.size}"
            )
        other = X.members.get(g.id)
        if other is not None:
            raise InvalidArgument(
                f"gang {key!r} already has a rank on group {g.id!r} (lease {other.lease.name!r}); each rank of a "
                f"gang is on a different group (lease {L.name!r} asked for the same group)"
            )
        return X

    def _expire_failed_gangs(self, now: float) -> None:
        keep = 2 * self.config.gang_assemble_s
        f = self._failed_gangs
        while f and (len(f) > FAILED_GANGS_KEPT or now - next(iter(f.values()))[1] > keep):
            f.popitem(last=False)

    def _fail_gang(self, X: Gang, why: str) -> None:
        """The gang phase cannot be granted: every member still waiting fails with FailedPrecondition."""
        if self._gangs.get((X.owner, X.key)) is not X:
            return  # already failed (or granted)
        del self._gangs[(X.owner, X.key)]
        msg = f"gang {X.key!r} of {X.size} ranks failed: {why}"
        self._failed_gangs[(X.owner, X.key)] = (msg, self.clock())
        self._expire_failed_gangs(self.clock())
        for t in list(X.members.values()):
            if not t.done():
                t.error = FailedPrecondition(msg)
                self._cancel_locked(t)

    def wait(self, ticket: Ticket, timeout: float | None = None, alive: Callable[[], bool] | None = None) -> Grant:
        """Blocks until the ticket is granted (returns the grant) or `timeout` passes (DeadlineExceeded; the
        ticket is withdrawn). Raises Cancelled if it was cancelled meanwhile. `alive`, if given, is asked
        every ALIVE_CHECK_S while it waits whether the caller is still there (no: the ticket is withdrawn)."""
        if timeout is not None and (not math.isfinite(timeout) or timeout < 0):
            raise InvalidArgument(f"timeout_s must be a finite number >= 0, got {timeout!r}")
        if not self._await(ticket, timeout, alive):
            with self._lock:
                if not ticket.done():
                    g = ticket.group
                    ahead = "held by " + ("a job" if g.holder else "nobody") + f", {len(g.queue) - 1} others waiting"
                    X = ticket.gang
                    why = f"the group is {ahead}"
                    if X is not None:
                        why = f"a rank of gang {X.key!r}: {self._gang_reason(X, ticket.lease.owner, self.clock())}"
                    err = DeadlineExceeded(
                        f"no slice of group {g.id!r} for lease {ticket.lease.name!r} within {timeout:g} s ({why})"
                    )
                    ticket.error = err
                    self._cancel_locked(ticket)
                    raise err
        if ticket.grant is not None:
            return ticket.grant
        raise ticket.error or Cancelled(
            f"acquire of group {ticket.group.id!r} by lease {ticket.lease.name!r} was cancelled"
        )

    def _await(self, ticket: Ticket, timeout: float | None, alive: Callable[[], bool] | None) -> bool:
        """Whether the ticket was decided (granted or cancelled) within `timeout`. The grant wakes it (an
        event); `alive` is only polled, and only while nothing happens."""
        if alive is None:
            return ticket.event.wait(timeout)
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            step = ALIVE_CHECK_S if end is None else min(ALIVE_CHECK_S, end - time.monotonic())
            if step <= 0:
                return ticket.event.is_set()
            if ticket.event.wait(step):
                return True
            if not alive():
                with self._lock:
                    if not ticket.done():
                        ticket.error = Cancelled(
                            f"acquire of group {ticket.group.id!r} by lease {ticket.lease.name!r}: the caller went away"
                        )
                        self._cancel_locked(ticket)
                return True

    def acquire(
        self,
        owner: str,
        lease_id: str,
        kind: str = "phase",
        timeout: float | None = None,
        instance: str = "",
        incarnation: str = "",
    ) -> Grant:
        return self.wait(self.request(owner, lease_id, kind, instance, incarnation), timeout)

    def cancel(self, ticket: Ticket) -> bool:
        """Withdraws a waiting ticket; False (and nothing happens) if it was already granted or withdrawn."""
        with self._lock:
            return self._cancel_locked(ticket)

    def _cancel_locked(self, t: Ticket) -> bool:
        if t.done():
            return False
        t.cancelled = True
        g = t.group
        g.queue.remove(t)
        if t.lease.ticket is t:
            t.lease.ticket = None
        if g.switch is not None and g.switch.target is t:
            g.switch.target = None
        t.event.set()
        X = t.gang
        if X is not None and self._gangs.get((X.owner, X.key)) is X:
            why = str(t.error) if t.error is not None else "it was cancelled"
            self._fail_gang(
                X, f"its rank on group {g.id!r} (lease {t.lease.name!r}) stopped waiting for its slice: {why}"
            )
        self._dispatch(g, self.clock())
        return True

    def release(
        self,
        owner: str,
        slice_id: str,
        keep_resident: bool = False,
        restore_s: float = 0.0,
        outcome: str = "ok",
        error: str = "",
        instance: str = "",
        incarnation: str = "",
    ) -> ReleaseResult:
        """Ends a slice. With `keep_resident` (the job keeps its state on the device between phases) the answer
        says whether another job waits, in which case the job must evict and `report_evicted`."""
        if not isinstance(restore_s, (int, float)) or not math.isfinite(restore_s) or restore_s < 0:
            raise InvalidArgument(f"restore_s must be a finite number >= 0, got {restore_s!r}")
        if outcome not in ("ok", "failed"):
            raise InvalidArgument(f"outcome must be 'ok' or 'failed', got {outcome!r}")
        with self._lock:
            s = self._slices.get(slice_id)
            if s is None or s.lease.actor != owner:
                ended = self._ended.get(slice_id)
                if ended is not None and ended[0] == owner:
                    raise FailedPrecondition(f"slice {slice_id} is not held any more: {ended[2]}")
                raise NotFound(f"slice {slice_id!r} not found: it is not held by any of your leases")
            now = self.clock()
            L, g = s.lease, s.group
            run = max(0.0, now - s.granted_at)
            restore_s = min(float(restore_s), run)
            self._end_slice(s, now, outcome, error=str(error)[:2000], restore_s=restore_s)
            L.last_release_at = now
            self._touch(L, now)
            result = ReleaseResult(evict_requested=False, run_s=run)
            best = self._pick(g, now) if g.queue else None
            # a backfilled phase went out of order: it is not held for (it must fit again to run again)
            if best is not None and s.rec.priority != BACKFILL and self._prefer_releaser(g, L, best):
                g.hold = (L, now + self.config.reacquire_grace_s)  # it is next and about to come back
                self._wake.set()
                best = None
            if keep_resident:
                g.resident = L
                L.state_loc = "device"
                if instance or incarnation:
                    L.res_instance, L.res_incarnation = str(instance), str(incarnation)
                if best is not None:  # someone waits: lazy yield ends here
                    sw = self._start_switch(g, L, best, now, "release")
                    result = ReleaseResult(
                        evict_requested=True, switch_id=sw.id, run_s=run, waiter_same_process=sw.same_process
                    )
            else:
                L.state_loc = "none"
                g.resident = None
            self._save(L)
            self._save_group(g)
            self._dispatch(g, now)
            return result

    def report_evicted(
        self, owner: str, lease_id: str, switch_id: int = 0, evict_s: float = 0.0, failed: bool = False, error: str = ""
    ) -> None:
        """The job moved its state off the group's devices (or, `failed`, could not: its state is then treated
        as lost). `switch_id` 0 means the lease's pending eviction, whichever it is."""
        if not isinstance(evict_s, (int, float)) or not math.isfinite(evict_s) or evict_s < 0:
            raise InvalidArgument(f"evict_s must be a finite number >= 0, got {evict_s!r}")
        with self._lock:
            L = self._lease(owner, lease_id)
            g = self._groups[L.group_id]
            sw = g.switch
            if sw is None or sw.evicting is not L or (switch_id and sw.id != switch_id):
                raise FailedPrecondition(
                    f"no eviction of lease {L.name!r} is pending (switch {switch_id}): it was "
                    "already reported, or given up after the holder timeout"
                )
            self._touch(L, self.clock())
            self._finish_switch(g, evict_s=float(evict_s), state="none" if failed else "host")

    def drop_residency(self, owner: str, lease_id: str, kept_on_host: bool = False) -> bool:
        """The job's state left the devices without being asked (moved to host memory by the job itself, or
        gone with its process): the group no longer waits on it. Returns whether it was resident."""
        with self._lock:
            L = self._lease(owner, lease_id)
            if L.slice is not None:
                raise FailedPrecondition(f"lease {L.name!r} holds slice {L.slice.id}; release it first")
            self._touch(L, self.clock())
            return self._drop_residency(L, "host" if kept_on_host else "none")

    def _drop_residency(self, L: Lease, state: str) -> bool:
        g = self._groups[L.group_id]
        if g.switch is not None and g.switch.evicting is L:
            self._finish_switch(g, evict_s=self.clock() - g.switch.started_at, state=state)
            return True
        if L.state_loc not in ("device", "evicting"):
            if state == "none" and L.state_loc == "host":
                L.state_loc = "none"
                self._save(L)
            return False
        L.state_loc = state
        if g.resident is L:
            g.resident = None
        if g.hold is not None and g.hold[0] is L:
            g.hold = None
        self._save(L)
        self._save_group(g)
        self._dispatch(g, self.clock())
        return True

    def drop_stale_residency(self, caller: str, instance: str, incarnation: str) -> tuple[int, int]:
        """`caller` runs a new incarnation of the process `instance`: whatever earlier incarnations of it left
        on the devices (or in their own host memory) for leases the caller drives is gone, and slices they
        still held are revoked. Nobody waits for a dead process to evict. Returns (leases dropped, slices
        revoked). Leases whose residency no instance claimed (clients that name no instance) are untouched.
        Leases an earlier incarnation created on users' behalf are closed: their jobs died with it, and they
        must not count against their owners' lease limit or keep a share of the group."""
        for what, v in (("instance", instance), ("incarnation", incarnation)):
            if not isinstance(v, str) or not v or len(v) > 256 or not v.isprintable():
                raise InvalidArgument(f"{what} must be a non-empty printable name (at most 256 characters), got {v!r}")
        dropped = revoked = 0
        with self._lock:
            now = self.clock()
            for L in [
                L
                for L in self._leases.values()
                if L.actor == caller and L.res_instance == instance and L.res_incarnation != incarnation
            ]:
                s = L.slice
                if s is not None and s.ticket.incarnation != incarnation:
                    self._revoke(s, now, f"the process {instance!r} that held it was replaced by a new one")
                    revoked += 1
                if L.slice is None and L.state_loc in ("device", "evicting", "host"):
                    self._drop_residency(L, "none")
                    dropped += 1
                L.res_instance = L.res_incarnation = ""
                self._save(L)
            for L in [
                L
                for L in self._leases.values()
                if L.agent == caller and L.agent_instance == instance and L.agent_incarnation != incarnation
            ]:
                if L.slice is not None:
                    self._revoke(L.slice, now, f"the process {instance!r} that held it was replaced by a new one")
                    revoked += 1
                self._drop_lease(L, f"the process {instance!r} that drove it was replaced by a new one")
        return dropped, revoked

    def heartbeat(
        self, owner: str, lease_ids: Iterable[str] = (), slice_ids: Iterable[str] = (), sub: Subscription | None = None
    ) -> list[LeaseEvent]:
        """Renews the leases (TTL) and keeps the listed slices alive. Returns events the caller must act on:
        `evict` (not yet reported), `revoked` (a listed slice is gone), `unknown_lease`."""
        events: list[LeaseEvent] = []
        with self._lock:
            now = self.clock()
            valid = set()
            for lid in lease_ids:
                L = self._leases.get(lid)
                if L is None or L.actor != owner:
                    events.append(
                        LeaseEvent(
                            type="unknown_lease",
                            lease_id=lid,
                            message=f"lease {lid!r} not found (expired, closed, or the orchestrator lost it)",
                        )
                    )
                    continue
                valid.add(lid)
                self._touch(L, now)
                fresh = sub is not None and lid not in sub.leases
                if L.evict_switch and (fresh or now - L.evict_sent_at >= EVICT_RESEND_S):
                    L.evict_sent_at = now
                    events.append(self._evict_event(L))
            if sub is not None:
                sub.leases = valid
            for sid in slice_ids:
                s = self._slices.get(sid)
                if s is not None and s.lease.actor == owner:
                    s.last_claimed = now
                    self._touch(s.lease, now)
                elif (ended := self._ended.get(sid)) is not None and ended[0] == owner and ended[1] == "revoked":
                    events.append(LeaseEvent(type="revoked", lease_id="", slice_id=sid, message=ended[2]))
        return events

    # --- the machinery -----------------------------------------------------------------------------
    # Interactive priority: every key is (class, *the policy's key), class 0 for a waiting interactive lease
    # while the group's interactive share lasts, else 1; so with no interactive waiter the policy alone orders.
    def _priority_open(self, g: Group, now: float) -> bool:
        """Whether interactive phases go first on `g` now: their share of the sliding window is not used up."""
        share, window = self.config.interactive_share, self.config.interactive_window_s
        return share >= 1 or (share > 0 and g.priority_used(now, window) < share * window)

    def _served_as(self, g: Group, L: Lease, now: float, open_: bool | None = None) -> str:
        """How `L`'s waiting phase is queued now: PRIORITIZED, CAPPED (interactive, queued as batch) or batch."""
        if L.priority != "interactive":
            return "batch"
        return PRIORITIZED if (self._priority_open(g, now) if open_ is None else open_) else CAPPED

    def _key(self, g: Group, now: float) -> Callable[[Ticket], tuple]:
        base = POLICIES[g.policy].key
        if not any(t.lease.priority == "interactive" for t in g.queue) or not self._priority_open(g, now):
            return lambda t: (1, *base(t))
        return lambda t: (0 if t.lease.priority == "interactive" else 1, *base(t))

    def _pick(self, g: Group, now: float | None = None) -> Ticket | None:
        """The waiter the group serves next (None: nobody counts in its queue, e.g. only gangs still assembling)."""
        now = self.clock() if now is None else now
        if not any(t.gang is not None for t in g.queue):
            return min(g.queue, key=self._key(g, now)) if g.queue else None
        order = self._order(g, now)
        return order[0] if order and order[0].ready() else None

    def _order(self, g: Group, now: float) -> list[Ticket]:
        """The group's waiters in the order it serves them: the policy's order (interactive first while the share
        lasts) of the ready tickets, with the places of gang members given to the gangs by their completion
        order (see "Gangs" above); then the members of gangs still assembling, which do not count yet."""
        key = self._key(g, now)
        if not any(t.gang is not None for t in g.queue):
            return sorted(g.queue, key=key)
        order = sorted((t for t in g.queue if t.ready()), key=key)
        places = [i for i, t in enumerate(order) if t.gang is not None]
        for i, t in zip(places, sorted((order[i] for i in places), key=lambda t: t.gang.seq)):  # type: ignore[union-attr]
            order[i] = t
        return order + sorted((t for t in g.queue if not t.ready()), key=lambda t: t.seq)

    def _gang_reason(self, X: Gang, viewer: str | None, now: float) -> str:
        """Why a gang waits: which of its slices are reserved for it and which it waits for, on whom."""
        if not X.complete:
            return reporting.gang_assembling_reason(
                X, max(0.0, X.created_at + self.config.gang_assemble_s - now), self.config.gang_assemble_s
            )
        parts: list[tuple[str, str, Lease | None, str]] = []
        for gid, t in sorted(X.members.items()):
            g = t.group
            if g.holder is not None:
                what = "backfill" if g.holder.rec.priority == BACKFILL else "holder"
                parts.append((gid, what, g.holder.lease, g.holder.ticket.kind))
            elif g.switch is not None:
                parts.append((gid, "switch", g.switch.evicting, ""))
            elif g.hold is not None and g.hold[0] is not t.lease:
                parts.append((gid, "hold", g.hold[0], ""))
            else:
                first = self._pick(g, now)
                if first is None or first is t:
                    parts.append((gid, "reserved", None, ""))
                elif first.gang is not None:
                    parts.append((gid, "gang", first.lease, first.kind))
                else:
                    parts.append((gid, "first", first.lease, first.kind))
        return reporting.gang_reason(X.size, parts, viewer)

    def _gang_reasons(self, order: list[Ticket], viewer: str | None, now: float) -> list[str]:
        """Per ticket of `order`, the gang's reason for a gang member, else "" (the group's own reason)."""
        return [self._gang_reason(t.gang, viewer, now) if t.gang is not None else "" for t in order]

    def _interactive_use(self, g: Group, now: float) -> tuple[float, float, float]:
        """(seconds used, seconds allowed, window) of the group's interactive share now."""
        cfg = self.config
        return (
            g.priority_used(now, cfg.interactive_window_s),
            cfg.interactive_share * cfg.interactive_window_s,
            cfg.interactive_window_s,
        )

    def _priority_notes(self, g: Group, order: list[Ticket], now: float) -> list[str]:
        """Per waiting ticket of `order`, what its class does to its place ("" for batch with no interactive
        ahead)."""
        open_ = self._priority_open(g, now)
        used, cap, window = self._interactive_use(g, now)
        notes, first = [], 0
        for t in order:
            served = self._served_as(g, t.lease, now, open_)
            notes.append(reporting.priority_note(served, first, used, cap, window))
            first += served == PRIORITIZED
        return notes

    def _prefer_releaser(self, g: Group, L: Lease, best: Ticket) -> bool:
        returning = POLICIES[g.policy].returning_key
        grace = self.config.reacquire_grace_s
        if returning is None or grace <= 0 or L.gap_ewma is None or L.gap_ewma > grace:
            return False
        now = self.clock()
        cls = 0 if self._served_as(g, L, now) == PRIORITIZED else 1
        return (cls, *returning(g, L)) < self._key(g, now)(best)

    def _dispatch(self, g: Group, now: float) -> None:
        """Serves the group's next waiter if it is free; then, while gangs wait, tries each complete one."""
        self._dispatch_one(g, now)
        if self._gangs:
            self._try_gangs(now)

    def _dispatch_one(self, g: Group, now: float) -> Ticket | None:
        """If the group is free: grants its first waiter, or starts the eviction of another lease's resident state
        for it. A gang member first is not granted here (`_try_gang` grants all of its gang at once); the group
        is then reserved for it. Returns the first waiter when the group is free and it was not granted."""
        if g.holder is not None or g.switch is not None or not g.queue:
            return None
        if g.hold is not None:
            L, until = g.hold
            t = L.ticket
            if t is not None and t.group is g and t.gang is None:
                g.hold = None
                self._grant(g, t, now)
                return None
            if t is not None and t.group is g and t.ready():
                g.hold = None  # the job came back as a complete gang's member: it competes as one
            elif now < until:
                return None  # held (for its gang too, while it assembles)
            else:
                g.hold = None
        t = self._pick(g, now)
        if t is None:
            return None
        if g.resident is not None and g.resident is not t.lease:
            # reserved for a gang: the resident lease's own waiting phase may run first if it fits (no eviction
            # is started for a backfill); else the state goes, as for any waiter
            b = self._backfill(g, t, now, only=g.resident) if t.gang is not None else None
            if b is not None:
                self._grant(g, b, now, backfill=True)
            else:
                self._start_switch(g, g.resident, t, now, "idle")
            return None
        if t.gang is not None:
            b = self._backfill(g, t, now) if g.resident is None else None  # never evict the gang's own state
            if b is not None:
                self._grant(g, b, now, backfill=True)
                return None
            return t  # reserved for its gang
        self._grant(g, t, now)
        return None

    def _backfill(self, g: Group, t: Ticket, now: float, only: Lease | None = None) -> Ticket | None:
        """The single-device waiter (of lease `only`, if given) that free group `g`, reserved for the gang of its
        first waiter `t`, may grant out of order now (see "Gangs" above), or None. It must be expected to end
        before the gang could start anyway: its lease's own mean phase (plus the group's typical switch cost if
        its lease keeps state, which the gang would then wait to see evicted) is at most the least expected
        remaining run of the phases holding the gang's other groups (a holder with no history: no backfill)."""
        X = t.gang
        if not self.config.gang_backfill or X is None or not X.complete:
            return None
        budget = math.inf
        for m in X.members.values():
            h = m.group.holder
            if m.group is g or h is None:
                continue
            P = reporting.own_phase(h.lease)
            if P is None:
                return None
            budget = min(budget, P - (now - h.granted_at))
        if not budget < math.inf or budget <= 0:
            return None  # the gang waits for no running phase (or one already past its expected end)
        S = reporting.typical_switch(g)
        for c in self._order(g, now):
            if c.gang is not None or not c.ready() or (only is not None and c.lease is not only):
                continue
            P = reporting.own_phase(c.lease)
            if P is not None and P + (S if c.lease.state_loc != "none" else 0.0) <= budget:
                return c
        return None

    def _try_gangs(self, now: float) -> None:
        for X in sorted((X for X in self._gangs.values() if X.complete), key=lambda X: X.seq):
            if self._gangs.get((X.owner, X.key)) is X:
                self._try_gang(X, now)

    def _try_gang(self, X: Gang, now: float) -> None:
        """Grants all of the gang's slices if every one of its groups is reserved for it (free, switched, its
        member first); else settles each of its free groups (serving whoever is first there instead)."""
        ready = True
        for t in X.members.values():
            if self._dispatch_one(t.group, now) is not t:
                ready = False
        if not ready:
            return
        del self._gangs[(X.owner, X.key)]
        for t in sorted(X.members.values(), key=lambda t: t.group.id):
            self._grant(t.group, t, now)

    def _start_switch(self, g: Group, R: Lease, target: Ticket, now: float, reason: str) -> Switch:
        self._switch_seq += 1
        same = bool(R.res_incarnation) and target is not None and target.incarnation == R.res_incarnation
        sw = Switch(id=self._switch_seq, evicting=R, target=target, started_at=now, reason=reason, same_process=same)
        g.switch = sw
        g.evictions += 1
        R.state_loc = "evicting"
        R.evictions += 1
        R.evict_switch = sw.id
        R.evict_sent_at = now
        if reason == "idle":
            ev = self._evict_event(R)
            for sub in self._event_subs.get(R.actor, ()):
                if R.id in sub.leases:
                    sub.put(ev)
            if self.on_evict_request is not None:
                self.on_evict_request(ev)
        self._save(R)
        return sw

    def _evict_event(self, L: Lease) -> LeaseEvent:
        sw = self._groups[L.group_id].switch
        same = sw is not None and sw.evicting is L and sw.same_process
        return LeaseEvent(
            type="evict",
            lease_id=L.id,
            group_id=L.group_id,
            switch_id=L.evict_switch,
            message=f"another job waits for group {L.group_id!r}: move job {L.name!r}'s state off",
            waiter_same_process=same,
        )

    def _finish_switch(self, g: Group, evict_s: float, state: str) -> None:
        sw = g.switch
        assert sw is not None  # called while the group switches
        g.switch = None
        R = sw.evicting
        R.state_loc = state
        R.evict_switch = 0
        if g.resident is R:
            g.resident = None
        self._save(R)
        self._save_group(g)
        g.last_switch = (sw.started_at, evict_s)
        now = self.clock()
        if sw.target is not None and not sw.target.done() and g.hold is None and sw.target.gang is None:
            self._grant(g, sw.target, now)
        else:
            self._dispatch(g, now)
        g.last_switch = None

    def _grant(self, g: Group, t: Ticket, now: float, backfill: bool = False) -> None:
        # the fair-share clock moves to where the policy alone would have served: a phase that jumped the
        # queue as interactive or as a gang's backfill does not push it past waiting phases (their tags), nor
        # leave it behind
        fair_tag = min(x.start_tag for x in g.queue if x.ready())  # t is among them
        g.queue.remove(t)
        L = t.lease
        L.ticket = None
        must_restore = L.state_loc == "host"
        L.state_loc = "device"
        L.res_instance, L.res_incarnation = t.instance, t.incarnation
        g.resident = L
        served = BACKFILL if backfill else self._served_as(g, L, now)
        g.vclock = max(g.vclock, t.start_tag if served not in (PRIORITIZED, BACKFILL) else fair_tag)
        switch_wait, evict_s = 0.0, 0.0
        if g.last_switch is not None:
            switch_wait, evict_s = max(0.0, now - g.last_switch[0]), g.last_switch[1]
            g.last_switch = None
        L.slices += 1
        L.last_served_at = now
        g.slices += 1
        if must_restore:
            g.restores += 1
            L.restores += 1
        self._touch(L, now)
        sid = "slice-" + uuid.uuid4().hex[:16]
        self._seq += 1
        rec = Rec(
            seq=self._seq,
            slice_id=sid,
            group_id=g.id,
            lease_id=L.id,
            job=L.name,
            owner=L.owner,
            kind=t.kind,
            requested_at=t.requested_at,
            granted_at=now,
            released_at=0.0,
            wait_s=now - t.requested_at,
            run_s=0.0,
            switch_s=switch_wait,
            restore_s=0.0,
            evict_s=evict_s,
            must_restore=must_restore,
            outcome="running",
            error="",
            switch_wait_s=switch_wait,
            priority=served,
            gang=t.gang.key if t.gang is not None else "",
            gang_size=t.gang.size if t.gang is not None else 0,
        )
        g.records.append(rec)
        s = Held(id=sid, lease=L, group=g, ticket=t, granted_at=now, last_claimed=now, rec=rec)
        g.holder = s
        L.slice = s
        self._slices[sid] = s
        t.grant = Grant(
            slice_id=sid,
            lease_id=L.id,
            group_id=g.id,
            job=L.name,
            kind=t.kind,
            waited_s=now - t.requested_at,
            must_restore=must_restore,
            granted_at=now,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            switch_wait_s=switch_wait,
        )
        self._emit(g, rec)
        self._save(L)
        self._save_group(g)
        t.event.set()
        if self.on_grant is not None:
            self.on_grant(t.grant)

    def _end_slice(self, s: Held, now: float, outcome: str, error: str = "", restore_s: float = 0.0) -> None:
        L, g = s.lease, s.group
        run = max(0.0, now - s.granted_at)
        L.used_s += run
        L.finish_tag = s.ticket.start_tag + max(run, MIN_CHARGE_S) / L.weight
        g.holder = None
        L.slice = None
        del self._slices[s.id]
        rec = s.rec
        rec.released_at = now
        rec.restore_s = restore_s
        rec.run_s = max(0.0, run - restore_s)
        rec.switch_s = rec.switch_wait_s + restore_s
        rec.outcome = outcome
        rec.error = error
        self._seq += 1
        rec.seq = self._seq
        g.note_phase(L, rec)
        self._emit(g, rec)
        why = {"ok": "it was released", "failed": "it was released after its phase failed"}.get(outcome, error)
        self._ended[s.id] = (L.actor, outcome, why)
        while len(self._ended) > 10000:
            self._ended.popitem(last=False)

    def _emit(self, g: Group, rec: Rec) -> None:
        if self.store is not None:
            self.store.slice_later(rec.row())
        for sub in self._timeline_subs:
            if sub.group_id == g.id:
                sub.put(reporting.slice_record(rec, sub.owner))

    def _revoke(self, s: Held, now: float, why: str) -> None:
        L, g = s.lease, s.group
        msg = f"slice {s.id} of group {g.id!r} was revoked: {why}"
        self._end_slice(s, now, "revoked", error=msg)
        g.revocations += 1
        # Its holder is gone, hung or overran: whatever it had on the device is not trusted, and nobody is
        # made to wait for it to be evicted.
        L.state_loc = "none"
        L.last_release_at = None
        if g.resident is L:
            g.resident = None
        for sub in self._event_subs.get(L.actor, ()):
            if L.id in sub.leases:
                sub.put(LeaseEvent(type="revoked", lease_id=L.id, group_id=g.id, slice_id=s.id, message=msg))
        self._save(L)
        self._save_group(g)
        self._dispatch(g, now)

    def tick(self) -> float:
        """Applies timeouts (dead holders, stalled evictions, an expired hold, expired leases). Returns the
        seconds until it should run again."""
        cfg = self.config
        with self._lock:
            now = self.clock()
            nxt = min(0.25, cfg.holder_timeout_s / 4)
            for g in self._groups.values():
                s = g.holder
                if s is not None and now - s.last_claimed > cfg.holder_timeout_s:
                    self._revoke(
                        s,
                        now,
                        f"its holder sent no heartbeat for {now - s.last_claimed:.1f} s (holder "
                        f"timeout {cfg.holder_timeout_s:g} s)",
                    )
                elif s is not None and g.max_phase_s and any(t.ready() for t in g.queue):
                    ran = now - s.granted_at
                    if ran > g.max_phase_s:
                        self._revoke(
                            s,
                            now,
                            f"its phase ran {ran:.1f} s while another job waited, longer than "
                            f"group {g.id!r} allows (max_phase_s {g.max_phase_s:g} s)",
                        )
                    else:
                        nxt = min(nxt, g.max_phase_s - ran)
                sw = g.switch
                if sw is not None:
                    R = sw.evicting
                    if now - R.last_seen > cfg.holder_timeout_s:  # the job is gone: its state went with it
                        self._finish_switch(g, evict_s=now - sw.started_at, state="none")
                    elif now - sw.started_at > cfg.evict_timeout_s:  # alive but stuck: go on, it restores later
                        self._finish_switch(g, evict_s=now - sw.started_at, state="host")
                if g.hold is not None:
                    if now >= g.hold[1]:
                        g.hold = None
                        self._dispatch(g, now)
                    else:
                        nxt = min(nxt, g.hold[1] - now)
            for X in [X for X in self._gangs.values() if not X.complete]:
                left = X.created_at + cfg.gang_assemble_s - now
                if left <= 0:
                    groups = ", ".join(sorted(X.members))
                    self._fail_gang(
                        X,
                        f"only {len(X.members)} of {X.size} ranks asked for their slices within "
                        f"{cfg.gang_assemble_s:g} s (ranks asked on {groups}; the others' groups are not known: "
                        "a rank's process may have died or be stuck before its phase)",
                    )
                else:
                    nxt = min(nxt, left)
            if self._gangs and not now - GANG_RETRY_S < self._gangs_tried < now:
                # an order may change with time alone (the interactive share's window slides on)
                self._gangs_tried = now
                self._try_gangs(now)
            if now - self._last_expiry_check >= 1.0:
                self._last_expiry_check = now
                for L in [
                    L for L in self._leases.values() if L.slice is None and L.ticket is None and now > L.expires_at
                ]:
                    self._drop_lease(L, f"it expired after {L.ttl_s:g} s without a heartbeat")
            return max(nxt, 0.001)

    def start_reaper(self) -> None:
        """Runs `tick` on a background thread until `close`."""
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="orchestrator-reaper", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        while not self._closed:
            wait = self.tick()
            self._wake.wait(wait)
            self._wake.clear()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        with self._lock:
            for subs in self._event_subs.values():
                for sub in subs:
                    sub.close()
            for sub in self._timeline_subs:
                sub.close()
            for g in self._groups.values():
                for t in list(g.queue):
                    t.error = Cancelled(f"the orchestrator is shutting down; acquire of group {g.id!r} again")
                    t.cancelled = True
                    t.event.set()
        if self.store is not None:
            self.store.close()

    # --- subscriptions -----------------------------------------------------------------------------
    def subscribe_events(self, owner: str) -> Subscription:
        """A queue of `LeaseEvent`s for `owner`'s leases that the subscriber heartbeats (`heartbeat(sub=...)`)."""
        sub = Subscription(owner)
        with self._lock:
            self._event_subs[owner].append(sub)
        return sub

    def subscribe_timeline(self, viewer: str, group_id: str) -> Subscription:
        """A queue of `SliceRecord`s of one group as they change (start and end of each slice), as `viewer`
        may see them."""
        with self._lock:
            sub = Subscription(viewer, self._group(group_id).id)
            self._timeline_subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.close()
        with self._lock:
            if sub in self._timeline_subs:
                self._timeline_subs.remove(sub)
            subs = self._event_subs.get(sub.owner)
            if subs and sub in subs:
                subs.remove(sub)

    # --- what it reports ---------------------------------------------------------------------------
    def list_groups(self) -> list[GroupInfo]:
        return [reporting.group_info(g) for g in self._groups.values()]

    def status(self, viewer: str | None, group_id: str | None = None, window_s: float = 60.0) -> list[GroupStatus]:
        """Holder, queue (each entry with why it waits), resident job and duty cycle, as `viewer` may see them."""
        with self._lock:
            groups = [self._group(group_id)] if group_id else list(self._groups.values())
            now = self.clock()
            out = []
            for g in groups:
                order = self._order(g, now)
                out.append(
                    reporting.group_status(
                        g,
                        order,
                        viewer,
                        reporting.group_duty(g, now - window_s, now, now),
                        now=now,
                        served_as=[self._served_as(g, t.lease, now) for t in order],
                        notes=self._priority_notes(g, order, now),
                        interactive=self._interactive_use(g, now),
                        reasons=self._gang_reasons(order, viewer, now),
                    )
                )
            return out

    def timeline(
        self, viewer: str | None, group_id: str, since: float = 0.0, since_seq: int = 0, limit: int = 1000
    ) -> Timeline:
        if not isinstance(limit, int) or limit < 0 or limit > 100000:
            raise InvalidArgument(f"limit must be 0..100000, got {limit!r}")
        limit = limit or 1000
        with self._lock:
            g = self._group(group_id)
            now = self.clock()
            recs = [
                r
                for r in g.records
                if r.seq > since_seq and (not since or r.released_at >= since or r.outcome == "running")
            ]
            older = []
            if self.store is not None and len(g.records) == g.records.maxlen:  # older ones are in SQLite only
                first = g.records[0]
                if (since_seq and since_seq < first.seq - 1) or (not since_seq and since < first.granted_at):
                    older = [
                        Rec.from_row(r) for r in self.store.slices_between(g.id, since_seq, first.seq, since, limit)
                    ]
            recs = sorted(older + recs, key=lambda r: r.seq)[:limit]
            duty = reporting.group_duty(g, since or (recs[0].granted_at if recs else now), now, now)
            return Timeline(
                records=tuple(reporting.slice_record(r, viewer) for r in recs),
                duty=duty,
                last_seq=recs[-1].seq if recs else self._seq,
            )

    def duty_cycle(self, group_id: str, since: float | None = None, until: float | None = None) -> DutyCycle:
        with self._lock:
            g = self._group(group_id)
            now = self.clock()
            until = now if until is None else until
            if since is None:
                since = g.records[0].granted_at if g.records else until
            return reporting.group_duty(g, since, until, now)

    def counters(self, group_id: str) -> dict[str, int]:
        with self._lock:
            g = self._group(group_id)
            return {
                "slices": g.slices,
                "evictions": g.evictions,
                "restores": g.restores,
                "revocations": g.revocations,
                "waiting": len(g.queue),
            }


def _number(name: str, value, low: float, high: float, low_open: bool = False, unit: str = "") -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
    if value < low or (low_open and value == low):
        raise InvalidArgument(f"{name} must be {'>' if low_open else '>='} {low:g}{unit}, got {value:g}")
    if value > high:
        raise InvalidArgument(f"{name} of {value:g}{unit} is absurd: the most allowed is {high:g}{unit}")
    return float(value)
