"""What users see of the scheduler's records: status, lease info, timeline records, duty cycles, and the
sentence that says why a job waits. Computed here once; every view (gRPC, the server extension, the
widgets) shows these as they are.

Redaction (one viewer never learns another user's chosen names): a viewer sees its own leases in full.
Of another user's, it sees that a slice ran (when, how long, its wait, switch cost and outcome, so duty
cycles stay whole) and a stable opaque `lease_ref`, never the lease name, the error, or a phase kind the
user chose: only the server's own kinds (`SERVER_KINDS`, what the kernels run) are shown, any other is "".
A `viewer` of None (in-process callers: tests, benchmarks) sees everything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from openrl_lab.orchestrator.records import Group, Lease, Rec
from openrl_lab.orchestrator.types import (
    CAPPED,
    PRIORITIZED,
    DutyCycle,
    GroupInfo,
    GroupStatus,
    LeaseInfo,
    QueueEntry,
    SliceRecord,
)

# Phase kinds the server itself names (the Tinker primitives and the kernel's own phases): the same for
# every user, so showing them reveals nothing of anyone's choosing.
SERVER_KINDS = frozenset(
    {
        "forward",
        "forward_backward",
        "optim_step",
        "sample",
        "compute_logprobs",
        "save_state",
        "load_state",
        "save_weights_for_sampler",
        "create_model",
        "fork",
        "open_sampler",
        "phase",
    }
)


def lease_ref(lease_id: str) -> str:
    """A stable opaque name for a lease that reveals nothing about it (colours other users' jobs)."""
    return hashlib.sha256(lease_id.encode()).hexdigest()[:10]


def sees(viewer: str | None, owner: str) -> bool:
    """Whether `viewer` may see the names of `owner`'s jobs."""
    return viewer is None or viewer == owner


def shown_kind(kind: str, mine: bool) -> str:
    return kind if mine or kind in SERVER_KINDS else ""


def group_info(g: Group) -> GroupInfo:
    return GroupInfo(group_id=g.id, aliases=g.aliases, devices=g.devices, policy=g.policy, max_phase_s=g.max_phase_s)


def slice_record(r: Rec, viewer: str | None) -> SliceRecord:
    mine = sees(viewer, r.owner)
    return SliceRecord(
        seq=r.seq,
        slice_id=r.slice_id,
        group_id=r.group_id,
        job=r.job if mine else "",
        mine=mine,
        lease_ref=lease_ref(r.lease_id),
        kind=shown_kind(r.kind, mine),
        requested_at=r.requested_at,
        granted_at=r.granted_at,
        released_at=r.released_at,
        wait_s=r.wait_s,
        run_s=r.run_s,
        switch_s=r.switch_s,
        restore_s=r.restore_s,
        evict_s=r.evict_s,
        must_restore=bool(r.must_restore),
        outcome=r.outcome,
        error=r.error if mine else "",
        priority=r.priority,
        gang=r.gang if mine else "",
        gang_size=r.gang_size,
    )


def queue_entry(
    L: Lease,
    kind: str,
    since: float,
    viewer: str | None,
    position: int = 0,
    reason: str = "",
    expected_wait_s: float | None = None,
    priority: str = "",
) -> QueueEntry:
    mine = sees(viewer, L.owner)
    return QueueEntry(
        job=L.name if mine else "",
        mine=mine,
        lease_ref=lease_ref(L.id),
        kind=shown_kind(kind, mine),
        since=since,
        weight=L.weight,
        position=position,
        reason=reason,
        expected_wait_s=expected_wait_s,
        priority=priority or L.priority,
    )


# --- how long a job waits (rough) ---------------------------------------------------------------------


def _mean(xs) -> float | None:
    return sum(xs) / len(xs) if xs else None


def own_phase(L: Lease) -> float | None:
    """How long a phase of `L` usually runs by its own recent phases alone (None: it has no history yet). What
    gang backfill trusts: a guess from other jobs' phases is not good enough to run a phase out of order."""
    return _mean(L.phases)


def typical_switch(g: Group) -> float:
    """The group's recent mean switch cost per hand-off that had one (0 when none was recorded)."""
    return _mean(g.switches) or 0.0


def typical_phase(g: Group, L: Lease) -> float | None:
    """How long a phase of `L` usually runs: its recent mean, else the group's recent mean (any job), else the
    group's max_phase_s (a phase is revoked after that while someone waits); None when nothing is known."""
    for guess in (_mean(L.phases), _mean(g.phases), g.max_phase_s or None):
        if guess is not None:
            return guess
    return None


def expected_waits(g: Group, order: list, now: float) -> list[float | None]:
    """A rough wait (s) for each ticket of `order` (the group's queue in the policy's order), None when unknown.

    E(1) = R + S, E(p) = E(p-1) + P(p-1) + S: R is what is left of the group's present use (the holder's typical
    phase less the time it has run, or, once it has run longer than that, as long again as it has run; capped by
    what max_phase_s leaves it; a switch in progress: the group's
    typical switch less its time so far, and its own S is not added again; a brief hold for a job coming back:
    that job's typical phase), P(k) the typical phase of the job at position k (`typical_phase`), S the group's
    recent mean switch cost per hand-off that had one (0 when none was recorded). A job whose phase length is
    unknown makes every wait behind it unknown."""
    S = _mean(g.switches) or 0.0
    first_switch = S
    R: float | None = 0.0
    if g.holder is not None:
        h = g.holder
        ran = max(0.0, now - h.granted_at)
        P = typical_phase(g, h.lease)
        # past its typical length it is doing something longer than usual: about as long again as it has run
        R = None if P is None else P - ran if ran < P else ran
        if R is not None and g.max_phase_s:
            R = min(R, max(0.0, g.max_phase_s - ran))
    elif g.switch is not None:
        R = max(0.0, S - (now - g.switch.started_at))
        first_switch = 0.0
    elif g.hold is not None:
        R = typical_phase(g, g.hold[0])
    out: list[float | None] = []
    wait = None if R is None else R + first_switch
    for t in order:
        out.append(wait)
        if wait is not None:
            P = typical_phase(g, t.lease)
            wait = None if P is None else wait + P + S
    return out


def _who(L: Lease, viewer: str | None) -> str:
    if viewer is None:
        return f"job {L.name!r}"
    return f"your job {L.name!r}" if viewer == L.owner else "another user's job"


def priority_note(served_as: str, interactive_ahead: int, used_s: float, cap_s: float, window_s: float) -> str:
    """What a waiting phase's class does to its place: `served_as` is how it is queued now (PRIORITIZED, CAPPED
    or batch), `interactive_ahead` how many ahead of it go first as interactive."""
    share = f"{used_s:.0f} of {cap_s:.0f} s in the last {window_s:g} s"
    if served_as == PRIORITIZED:
        return f"interactive: goes before batch phases (interactive share {share})"
    if served_as == CAPPED:
        return f"interactive, queued as batch: the group's interactive share is used up ({share})"
    if interactive_ahead:
        many = interactive_ahead > 1
        return f"batch: {interactive_ahead} interactive phase{'s go' if many else ' goes'} first"
    return ""


def wait_reason(g: Group, position: int, viewer: str | None, note: str = "") -> str:
    """Why the ticket at `position` (1-based, in the group's order) of the group's queue waits; `note`
    (`priority_note`) is added."""
    reason = _wait_reason(g, position, viewer)
    return f"{reason}; {note}" if note else reason


def _wait_reason(g: Group, position: int, viewer: str | None) -> str:
    if position > 1:
        return f"{position - 1} ahead in the queue (policy {g.policy})"
    if g.holder is not None:
        h = g.holder
        kind = shown_kind(h.ticket.kind, sees(viewer, h.lease.owner))
        limit = f" (revoked at {g.max_phase_s:g} s)" if g.max_phase_s else ""
        return f"next: waits for {_who(h.lease, viewer)} to finish its {kind + ' ' if kind else ''}slice{limit}"
    if g.switch is not None:
        return f"next: waits while {_who(g.switch.evicting, viewer)} moves its state off the devices"
    if g.hold is not None:
        return f"next: the group is held briefly for {_who(g.hold[0], viewer)}, which usually comes back at once"
    return "next: being granted"


def gang_reason(size: int, parts: list[tuple[str, str, Lease | None, str]], viewer: str | None) -> str:
    """Why a complete gang waits. `parts`: per group of the gang, (group id, what, whose, phase kind) where
    what is reserved (free and kept for the gang), holder (`whose` slice runs there), backfill (`whose` slice runs
    there out of order, expected to end before the gang could start), switch (`whose` state
    is being moved off), hold (held briefly for `whose`), gang (reserved for an earlier gang, `whose` rank)
    or first (`whose` phase is first there by the policy)."""
    reserved = [gid for gid, what, _, _ in parts if what == "reserved"]
    waits = []
    for gid, what, L, kind in parts:
        if what == "reserved" or L is None:
            continue
        who = _who(L, viewer)
        k = shown_kind(kind, sees(viewer, L.owner))
        waits.append(
            {
                "holder": f"{gid} (held by {who}{', a ' + k + ' slice' if k else ''})",
                "backfill": f"{gid} (backfilled meanwhile by {who}{', a ' + k + ' slice' if k else ''})",
                "switch": f"{gid} (while {who} moves its state off)",
                "hold": f"{gid} (held briefly for {who}, which usually comes back at once)",
                "gang": f"{gid} (reserved for an earlier gang, {who})",
                "first": f"{gid} ({who} goes first there{', a ' + k + ' phase' if k else ''})",
            }[what]
        )
    head = f"gang of {size}: "
    if not waits:
        return head + "all its slices are reserved for it; being granted"
    have = f"{', '.join(reserved)} reserved, " if reserved else ""
    return head + have + "waits for " + ", ".join(waits)


def gang_assembling_reason(X, left_s: float, assemble_s: float) -> str:
    """Why a gang member waits while its gang assembles (not all its ranks asked yet)."""
    return (
        f"gang of {X.size}: {len(X.members)} of {X.size} ranks asked (on {', '.join(sorted(X.members))}); waits "
        f"for the others to ask (it fails if they have not within {assemble_s:g} s: {left_s:.0f} s left)"
    )


def group_status(
    g: Group,
    order: list,
    viewer: str | None,
    duty: DutyCycle,
    now: float,
    served_as: list[str],
    notes: list[str],
    interactive: tuple[float, float, float],
    reasons: list[str] | None = None,
) -> GroupStatus:
    """`order`: the group's waiting tickets in the group's order; `served_as` and `notes`: per ticket, how it is
    queued and its `priority_note`; `interactive`: (used, allowed, window) seconds of the interactive share;
    `reasons`: per ticket, a reason that replaces the group's own ("" keeps it: gang members have their own)."""
    h = g.holder
    waits = expected_waits(g, order, now)
    return GroupStatus(
        group=group_info(g),
        holder=queue_entry(h.lease, h.ticket.kind, h.granted_at, viewer, priority=h.rec.priority) if h else None,
        queue=tuple(
            queue_entry(
                t.lease,
                t.kind,
                t.requested_at,
                viewer,
                i + 1,
                (reasons[i] if reasons and reasons[i] else wait_reason(g, i + 1, viewer, notes[i])),
                None if reasons and reasons[i] else waits[i],
                priority=served_as[i],
            )
            for i, t in enumerate(order)
        ),
        resident=queue_entry(g.resident, "", 0.0, viewer) if g.resident else None,
        switching=g.switch is not None,
        duty=duty,
        slices=g.slices,
        evictions=g.evictions,
        restores=g.restores,
        revocations=g.revocations,
        interactive_used_s=interactive[0],
        interactive_cap_s=interactive[1],
        interactive_window_s=interactive[2],
    )


def lease_info(
    L: Lease,
    g: Group,
    position: int,
    viewer: str | None,
    config,
    reattached: bool = False,
    expected_wait_s: float | None = None,
    note: str = "",
    reason: str = "",
) -> LeaseInfo:
    """`position`: 1-based in the group's queue while the lease waits, else 0 (`expected_wait_s`: see
    `expected_waits`; `note`: see `priority_note`)."""
    return LeaseInfo(
        lease_id=L.id,
        name=L.name,
        group_id=L.group_id,
        owner=L.owner,
        weight=L.weight,
        quota_s=L.quota_s,
        used_s=L.used_s,
        slices=L.slices,
        ttl_s=L.ttl_s,
        expires_at=L.expires_at,
        created_at=L.created_at,
        state="holding" if L.slice else "waiting" if L.ticket else "idle",
        resident=L.state_loc,
        evictions=L.evictions,
        restores=L.restores,
        heartbeat_interval_s=config.heartbeat_interval_s,
        holder_timeout_s=config.holder_timeout_s,
        reattached=reattached,
        queue_position=position,
        driven_by=L.agent,
        reason=(reason or wait_reason(g, position, viewer, note)) if position else "",
        expected_wait_s=expected_wait_s if position else None,
        priority=L.priority,
    )


# --- duty cycle ---------------------------------------------------------------------------------------


def duty_cycle(group_id: str, spans: Iterable[tuple[float, float, float]], since: float, until: float) -> DutyCycle:
    """Busy (run) and switch (eviction wait + restore) time as shares of the wall time over [since, until].

    `spans`: (switch_start, run_start, run_end) per slice: its switch part is [switch_start, run_start), its
    run [run_start, run_end); both are clipped to the window, and a slice counts if either part is in it.
    The one definition of duty cycle: the scheduler and the notebook's TimelineView both use it.
    """
    busy = switch = 0.0
    n = 0
    for sw, start, end in spans:
        if end < since or sw > until:
            continue
        n += 1
        busy += _overlap(start, end, since, until)
        switch += _overlap(sw, start, since, until)
    wall = max(0.0, until - since)
    return DutyCycle(
        group_id=group_id,
        since=since,
        until=until,
        wall_s=wall,
        busy_s=busy,
        switch_s=switch,
        duty_cycle=busy / wall if wall else 0.0,
        switch_share=switch / wall if wall else 0.0,
        slices=n,
    )


def group_duty(g: Group, since: float, until: float, now: float) -> DutyCycle:
    """The group's duty cycle from the records it keeps in memory (a running slice runs until `now`)."""

    def spans():
        for r in reversed(g.records):
            end = r.released_at or (now if r.outcome == "running" else r.granted_at)
            if end < since:
                return  # slices of a group never overlap and are kept in grant order: the rest are older
            yield r.granted_at - r.switch_wait_s, r.granted_at + r.restore_s, end

    return duty_cycle(g.id, spans(), since, until)


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))
