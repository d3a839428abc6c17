"""Gang backfill on the scheduler alone, on a fake clock: a group reserved for a gang that waits for a running phase
on another of its groups grants a waiting single-device phase out of order only when that phase's expected length
(its lease's own recent phases) fits in the blocking phase's expected remaining run; never when it does not or is
unknown, never evicting anyone for it, never delaying a gang whose blocker ends on time; `gang_backfill = false`
restores the all-or-nothing idling. Counted, not timed: the clock only moves when a test moves it."""

from __future__ import annotations

import pytest

from openrl_lab.orchestrator.records import Ticket
from openrl_lab.orchestrator.scheduler import Scheduler
from openrl_lab.orchestrator.types import BACKFILL
from tests.orchestrator.conftest import FakeClock

GROUPS = ("g0", "g1")
GANG = "gang-job/1"


def make(policy: str = "weighted", **cfg) -> tuple[Scheduler, FakeClock, list]:
    clock = FakeClock()
    evicts: list = []
    s = Scheduler(
        {
            "groups": [{"id": g, "devices": [f"d{i}"], "policy": policy} for i, g in enumerate(GROUPS)],
            "holder_timeout_s": 1000.0,
            "reacquire_grace_s": 0.5,  # a backfilled releaser must not be held for (it comes back at once below)
            **cfg,
        },
        clock=clock,
        on_evict_request=evicts.append,
    )
    return s, clock, evicts


def lease(s: Scheduler, group: str, name: str) -> str:
    return s.create_lease("alice", group, name).lease_id


def history(s: Scheduler, clock: FakeClock, lid: str, *lengths: float, keep: bool = False) -> None:
    """Runs phases of these lengths on the lease (nobody else waits): its own history of phase lengths."""
    for length in lengths:
        g = s.acquire("alice", lid, "forward_backward", timeout=0)
        clock.advance(length)
        s.release("alice", g.slice_id, keep_resident=keep)


def setup(blocker_s: float = 10.0, candidate_s: float | None = 3.0, **cfg):
    """`long` (phases of `blocker_s`) holds g1 from t0; a gang of 2 then waits for g1 with g0 reserved; `short`
    on g0 (phases of `candidate_s`; None: no history) is the would-be backfill. Returns the scheduler, clock,
    evict requests, t0, the gang's tickets and `short`'s lease id."""
    s, clock, evicts = make(**cfg)
    long_ = lease(s, "g1", "long")
    short = lease(s, "g0", "short")
    history(s, clock, long_, blocker_s, blocker_s)
    if candidate_s is not None:
        history(s, clock, short, candidate_s, candidate_s)
    t0 = clock.t
    held = s.acquire("alice", long_, "forward_backward", timeout=0)
    ranks = [lease(s, g, "gang-job") for g in GROUPS]
    gang = [s.request("alice", r, "forward_backward", gang=GANG, gang_size=2) for r in ranks]
    assert not any(t.done() for t in gang)
    return s, clock, evicts, t0, gang, short, held


def record(s: Scheduler, t: Ticket):
    assert t.grant is not None
    (rec,) = [r for r in s.timeline(None, t.group.id).records if r.slice_id == t.grant.slice_id]
    return rec


def test_a_reserved_group_backfills_a_phase_that_fits_and_the_gang_still_starts_when_its_blocker_ends():
    s, clock, evicts, t0, gang, short, held = setup(blocker_s=10.0, candidate_s=3.0)
    used0 = s.get_lease("alice", short).used_s
    clock.advance(1.0)
    t = s.request("alice", short, "forward")
    assert t.grant is not None and t.grant.group_id == "g0"  # 3 s fits in the 9 s left of g1's 10 s phase
    rec = record(s, t)
    assert rec.priority == BACKFILL and rec.gang == ""  # marked on the timeline (status too)
    (g0,) = s.status("alice", "g0")
    assert g0.holder is not None and g0.holder.priority == BACKFILL
    reason = {q.job: q.reason for q in g0.queue}["gang-job"]
    assert reason == (
        "gang of 2: waits for g0 (backfilled meanwhile by your job 'short', a forward slice), "
        "g1 (held by your job 'long', a forward_backward slice)"
    )
    # the same lease comes back at once (no hold for it: it must fit again), and fits twice more: 6 s left, 3 s
    for _ in range(2):
        clock.advance(3.0)
        s.release("alice", t.grant.slice_id)
        t = s.request("alice", short, "forward")
        assert t.grant is not None and record(s, t).priority == BACKFILL
    clock.advance(3.0)  # t0 + 10: 0 s left of long's expected phase
    s.release("alice", t.grant.slice_id)
    t = s.request("alice", short, "forward")
    assert not t.done()  # it no longer fits: g0 is reserved for the gang again
    assert s.get_lease("alice", short).used_s == pytest.approx(used0 + 9.0)  # charged as usual
    s.release("alice", held.slice_id)  # long ends when expected: the gang is not delayed
    assert all(m.grant is not None and m.grant.granted_at == t0 + 10.0 for m in gang)
    assert {record(s, m).priority for m in gang} == {"batch"}
    assert not t.done() and evicts == []


def test_a_phase_longer_than_what_the_blocker_has_left_is_not_backfilled():
    s, clock, _, t0, gang, short, held = setup(blocker_s=10.0, candidate_s=3.0)
    clock.advance(7.5)  # 2.5 s left < 3 s
    t = s.request("alice", short, "forward")
    assert not t.done()
    clock.advance(2.5)
    s.release("alice", held.slice_id)
    assert all(m.grant is not None and m.grant.granted_at == t0 + 10.0 for m in gang)
    assert not t.done()  # it waits for the gang, as without backfill
    for m in gang:
        assert m.grant is not None
        s.release("alice", m.grant.slice_id)
    assert t.grant is not None and record(s, t).priority == "batch"


@pytest.mark.parametrize("blocker_s, candidate_s", [(10.0, None), (None, 3.0)], ids=["candidate", "blocker"])
def test_no_backfill_when_an_expected_length_is_unknown(blocker_s, candidate_s):
    s, clock, _ = make()
    long_, short = lease(s, "g1", "long"), lease(s, "g0", "short")
    if blocker_s is not None:
        history(s, clock, long_, blocker_s)
    if candidate_s is not None:
        history(s, clock, short, candidate_s)
    held = s.acquire("alice", long_, timeout=0)
    gang = [s.request("alice", lease(s, g, "gang-job"), gang=GANG, gang_size=2) for g in GROUPS]
    t = s.request("alice", short)
    assert not t.done() and not any(m.done() for m in gang)
    s.release("alice", held.slice_id)
    assert all(m.done() for m in gang) and not t.done()


def test_no_backfill_once_the_blocker_has_run_past_its_expected_length():
    s, clock, _, _, _, short, _ = setup(blocker_s=10.0, candidate_s=0.5)
    clock.advance(11.0)  # long overruns: how long it has left is anyone's guess
    t = s.request("alice", short)
    assert not t.done()


def test_turning_it_off_restores_the_reserved_idle_group():
    s, clock, _, _, gang, short, held = setup(blocker_s=10.0, candidate_s=3.0, gang_backfill=False)
    clock.advance(1.0)
    t = s.request("alice", short)
    assert not t.done()  # fits, but backfill is off: g0 idles for the gang
    (g0,) = s.status("alice", "g0")
    assert g0.holder is None and [q.job for q in g0.queue] == ["gang-job", "short"]
    clock.advance(9.0)
    s.release("alice", held.slice_id)
    assert all(m.done() for m in gang) and not t.done()


def test_a_backfill_never_evicts_anyone():
    # the gang's own state is resident on g0: a fitting phase of another lease (behind the gang: fifo) would
    # evict it, so it waits
    s, clock, evicts = make("fifo")
    long_, short, rank0 = lease(s, "g1", "long"), lease(s, "g0", "short"), lease(s, "g0", "gang-job")
    history(s, clock, long_, 10.0)
    history(s, clock, short, 1.0)
    history(s, clock, rank0, 1.0, keep=True)  # rank 0's state stays on g0
    held = s.acquire("alice", long_, timeout=0)
    gang = [s.request("alice", r, gang=GANG, gang_size=2) for r in (rank0, lease(s, "g1", "gang-job"))]
    t = s.request("alice", short)
    assert not t.done() and evicts == []
    s.release("alice", held.slice_id)
    assert all(m.done() for m in gang)

    # another lease's state is resident on g0 and that lease does not wait: it is asked to leave for the gang at
    # once, as without backfill (no backfill keeps it there); a fitting phase backfills once it is gone
    s, clock, evicts = make()
    long_, short, res = lease(s, "g1", "long"), lease(s, "g0", "short"), lease(s, "g0", "resident")
    history(s, clock, long_, 10.0)
    history(s, clock, short, 1.0)
    history(s, clock, res, 1.0, keep=True)  # its state stays on g0
    held = s.acquire("alice", long_, timeout=0)
    gang = [s.request("alice", lease(s, g, "gang-job"), gang=GANG, gang_size=2) for g in GROUPS]
    assert [e.lease_id for e in evicts] == [res]
    t = s.request("alice", short)
    assert not t.done()  # g0 is switching for the gang
    clock.advance(0.5)
    s.report_evicted("alice", res, evicts[0].switch_id, evict_s=0.5)
    assert t.grant is not None and record(s, t).priority == BACKFILL and not t.grant.must_restore
    clock.advance(1.0)
    s.release("alice", t.grant.slice_id)
    clock.advance(8.5)
    s.release("alice", held.slice_id)
    assert all(m.grant is not None and m.grant.granted_at == clock.t for m in gang)


def test_a_backfill_that_overruns_is_still_bounded_by_max_phase_s():
    s, clock, _, _, gang, short, held = setup(blocker_s=10.0, candidate_s=3.0, max_phase_s=20.0)
    t = s.request("alice", short)
    assert t.grant is not None and record(s, t).priority == BACKFILL
    clock.advance(10.0)
    s.release("alice", held.slice_id)  # g1 is the gang's; g0 still runs the backfill, far past its 3 s
    assert not any(m.done() for m in gang)
    clock.advance(9.0)
    s.tick()
    assert not any(m.done() for m in gang)
    clock.advance(1.5)  # the backfill has run 20.5 s while the gang waits: revoked, the gang is granted
    s.tick()
    assert record(s, t).outcome == "revoked"
    assert all(m.grant is not None and m.grant.granted_at == clock.t for m in gang)
