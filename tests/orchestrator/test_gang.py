"""Gang acquisition on the scheduler alone (no gRPC), on a fake clock: all-or-nothing grants, the order that
cannot deadlock, reservations and evictions, failures of one rank failing the gang, assembly timeouts, and
what the views say about a waiting gang. Counted, not timed: the clock only moves when a test moves it."""

from __future__ import annotations

import pytest

from openrl_lab.orchestrator.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument
from openrl_lab.orchestrator.scheduler import Scheduler
from tests.orchestrator.conftest import FakeClock

GROUPS = ("g0", "g1", "g2")


def make(policy: str = "weighted", **cfg):
    clock = FakeClock()
    evicts = []
    s = Scheduler(
        {
            "groups": [{"id": g, "devices": [f"d{i}"], "policy": policy} for i, g in enumerate(GROUPS)],
            "holder_timeout_s": 1000.0,
            **cfg,
        },
        clock=clock,
        on_evict_request=evicts.append,
    )
    return s, clock, evicts


def lease(s: Scheduler, group: str, name: str, owner: str = "alice", **kw) -> str:
    return s.create_lease(owner, group, name, **kw).lease_id


def held_groups(s: Scheduler) -> dict[str, str]:
    """group -> the job holding it."""
    return {st.group.group_id: st.holder.job for st in s.status(None) if st.holder is not None}


def test_a_gang_is_granted_only_once_all_ranks_asked_and_all_its_groups_are_free():
    s, clock, _ = make()
    single = lease(s, "g1", "single")
    held = s.acquire("alice", single)
    r0, r1 = lease(s, "g0", "gang-job"), lease(s, "g1", "gang-job")
    t0 = s.request("alice", r0, "forward_backward", gang="gang-job/1", gang_size=2)
    assert not t0.done()  # only one rank asked: g0 is free, yet nothing is granted
    assert held_groups(s) == {"g1": "single"}
    info = s.get_lease("alice", r0)
    assert info.state == "waiting" and info.reason.startswith("gang of 2: 1 of 2 ranks asked (on g0)")

    t1 = s.request("alice", r1, "forward_backward", gang="gang-job/1", gang_size=2)
    assert not t0.done() and not t1.done()  # complete, but g1 is held: no part of it is granted
    # g0 is reserved for the gang: a later single-device phase there waits although g0 is idle
    other = lease(s, "g0", "other")
    t_other = s.request("alice", other)
    assert not t_other.done() and held_groups(s) == {"g1": "single"}
    (g0,) = s.status("alice", "g0")
    reasons = {q.job: q.reason for q in g0.queue}
    assert reasons["gang-job"] == "gang of 2: g0 reserved, waits for g1 (held by your job 'single', a phase slice)"
    assert g0.queue[0].job == "gang-job"  # first in g0's order
    # another user sees why, without names
    (g0_bob,) = s.status("bob", "g0")
    assert g0_bob.queue[0].reason == "gang of 2: g0 reserved, waits for g1 (held by another user's job, a phase slice)"

    clock.advance(2.0)
    s.release("alice", held.slice_id)
    assert t0.grant is not None and t1.grant is not None  # both at once
    assert t0.grant.granted_at == t1.grant.granted_at
    assert held_groups(s) == {"g0": "gang-job", "g1": "gang-job"}
    assert not t_other.done()
    recs = [r for g in ("g0", "g1") for r in s.timeline(None, g).records if r.job == "gang-job"]
    assert {(r.group_id, r.gang, r.gang_size) for r in recs} == {("g0", "gang-job/1", 2), ("g1", "gang-job/1", 2)}
    assert {r.gang for r in s.timeline("bob", "g0").records} == {""}  # the key is the owner's

    s.release("alice", t0.grant.slice_id)
    assert t_other.grant is not None  # g0 passes on; g1 is still the gang's rank's
    s.release("alice", t1.grant.slice_id)


def test_the_gang_that_completed_first_goes_first_in_every_group_so_two_gangs_cannot_deadlock():
    """fifo puts A first on g0 and B first on g1 (they asked in that order); granting by each group's own order
    would give each gang one group and neither the other. The earlier-complete gang (B) goes first in both."""
    s, _, _ = make("fifo")
    hold = [s.acquire("alice", lease(s, g, "blocker")) for g in ("g0", "g1")]
    a0, a1 = lease(s, "g0", "A"), lease(s, "g1", "A")
    b0, b1 = lease(s, "g0", "B"), lease(s, "g1", "B")
    ta0 = s.request("alice", a0, gang="A/1", gang_size=2)
    tb1 = s.request("alice", b1, gang="B/1", gang_size=2)
    tb0 = s.request("alice", b0, gang="B/1", gang_size=2)  # B complete (first)
    ta1 = s.request("alice", a1, gang="A/1", gang_size=2)  # A complete (second)
    assert [q.job for q in s.status(None, "g0")[0].queue] == ["B", "A"]
    assert [q.job for q in s.status(None, "g1")[0].queue] == ["B", "A"]
    s.release("alice", hold[0].slice_id)
    assert not any(t.done() for t in (ta0, ta1, tb0, tb1))  # g0 is reserved for B, which waits for g1
    assert "g0 reserved, waits for g1 (held by your job 'blocker'" in s.get_lease("alice", b0).reason
    assert s.get_lease("alice", a0).reason.startswith(
        "gang of 2: waits for g0 (reserved for an earlier gang, your job 'B')"
    )
    s.release("alice", hold[1].slice_id)
    assert tb0.grant is not None and tb1.grant is not None and not ta0.done() and not ta1.done()
    s.release("alice", tb0.grant.slice_id)
    assert not ta0.done()  # never part of a gang
    s.release("alice", tb1.grant.slice_id)
    assert ta0.grant is not None and ta1.grant is not None


def test_a_reserved_group_asks_another_jobs_resident_state_to_leave_and_the_gang_waits_for_it():
    s, _, evicts = make()
    res = lease(s, "g0", "resident")
    sl = s.acquire("alice", res)
    s.release("alice", sl.slice_id, keep_resident=True)  # lazy yield: its state stays on g0
    r0, r1 = lease(s, "g0", "G"), lease(s, "g1", "G")
    t0 = s.request("alice", r0, gang="G/1", gang_size=2)
    assert evicts == []  # not complete: it does not count, nobody is asked to move
    t1 = s.request("alice", r1, gang="G/1", gang_size=2)
    assert [e.lease_id for e in evicts] == [res]  # complete: g0 is reserved, its resident asked to leave
    assert not t0.done() and not t1.done()  # g1 is free, but g0 is not switched yet: nothing is granted
    assert (
        s.get_lease("alice", r1).reason
        == "gang of 2: g1 reserved, waits for g0 (while your job 'resident' moves its state off)"
    )
    s.report_evicted("alice", res, evicts[0].switch_id, evict_s=0.1)
    assert t0.grant is not None and t1.grant is not None


def test_a_rank_that_stops_waiting_fails_its_whole_gang_phase():
    s, _, _ = make()
    held = s.acquire("alice", lease(s, "g1", "busy"))
    r = {g: lease(s, g, "G") for g in GROUPS}
    t = {g: s.request("alice", r[g], "forward", gang="G/7", gang_size=3) for g in GROUPS}
    with pytest.raises(DeadlineExceeded, match="gang 'G/7'"):
        s.wait(t["g1"], timeout=0)  # its own timeout: DeadlineExceeded
    for g in ("g0", "g2"):
        with pytest.raises(FailedPrecondition) as e:
            s.wait(t[g], timeout=0)
        assert "gang 'G/7' of 3 ranks failed: its rank on group 'g1' (lease 'G') stopped waiting" in str(e.value)
    # nothing stays reserved: g0 and g2 serve others at once
    nxt = s.acquire("alice", lease(s, "g0", "next"), timeout=0)
    assert nxt.group_id == "g0"
    s.release("alice", nxt.slice_id)
    # a late rank of the failed gang phase fails at once, with the same error
    with pytest.raises(FailedPrecondition, match="gang 'G/7' of 3 ranks failed"):
        s.request("alice", r["g1"], gang="G/7", gang_size=3)
    s.release("alice", held.slice_id)

    # cancelled (its caller went away) or its lease closed: the same
    t0 = s.request("alice", r["g0"], gang="G/8", gang_size=2)
    t1 = s.request("alice", r["g2"], gang="G/8", gang_size=2)
    assert t0.grant is not None and t1.grant is not None  # granted (all free)
    s.release("alice", t0.grant.slice_id)
    s.release("alice", t1.grant.slice_id)
    hold = s.acquire("alice", r["g1"])
    t0 = s.request("alice", r["g0"], gang="G/9", gang_size=2)
    t1 = s.request("alice", lease(s, "g1", "H"), gang="G/9", gang_size=2)
    s.cancel(t0)
    with pytest.raises(FailedPrecondition, match="gang 'G/9' of 2 ranks failed: its rank on group 'g0'"):
        s.wait(t1, timeout=0)
    s.release("alice", hold.slice_id)


def test_a_gang_whose_ranks_do_not_all_ask_fails_after_gang_assemble_s():
    s, clock, _ = make(gang_assemble_s=30.0)
    r = {g: lease(s, g, "G") for g in GROUPS}
    t0 = s.request("alice", r["g0"], gang="G/1", gang_size=3)
    t2 = s.request("alice", r["g2"], gang="G/1", gang_size=3)
    clock.advance(29.0)
    s.tick()
    assert not t0.done()
    clock.advance(2.0)
    s.tick()
    for t in (t0, t2):
        with pytest.raises(FailedPrecondition) as e:
            s.wait(t, timeout=0)
        assert "only 2 of 3 ranks asked for their slices within 30 s (ranks asked on g0, g2" in str(e.value)
    with pytest.raises(FailedPrecondition, match="only 2 of 3 ranks"):  # the missing rank, late
        s.request("alice", r["g1"], gang="G/1", gang_size=3)
    clock.advance(61.0)  # forgotten after 2 * gang_assemble_s: the key may name a new phase
    t = s.request("alice", r["g1"], gang="G/1", gang_size=3)
    assert not t.done()


def test_bad_gang_requests_are_refused_naming_what_is_wrong():
    s, _, _ = make()
    r0, r1 = lease(s, "g0", "G"), lease(s, "g1", "G")
    other0 = lease(s, "g0", "G2")
    with pytest.raises(InvalidArgument, match="gang_size must be"):
        s.request("alice", r0, gang="k", gang_size=1)
    with pytest.raises(InvalidArgument, match="gang key"):
        s.request("alice", r0, gang="", gang_size=2)
    s.request("alice", r0, gang="k", gang_size=3)
    with pytest.raises(InvalidArgument, match="already has a rank on group 'g0' \\(lease 'G'\\)"):
        s.request("alice", other0, gang="k", gang_size=3)
    with pytest.raises(InvalidArgument, match="says it has 2 ranks, but the ranks that asked before said 3"):
        s.request("alice", r1, gang="k", gang_size=2)
    # another owner's key of the same name is another gang
    b1 = lease(s, "g1", "G", owner="bob")
    tb = s.request("bob", b1, gang="k", gang_size=2)
    assert not tb.done()
    assert s.counters("g1")["waiting"] == 1


def test_a_hold_for_a_returning_gang_rank_lasts_until_its_gang_completes_or_the_grace_ends():
    s, clock, _ = make(reacquire_grace_s=1.0)
    r0, r1 = lease(s, "g0", "G"), lease(s, "g1", "G")
    w = lease(s, "g0", "W", weight=0.01)
    sw = s.acquire("alice", w)
    clock.advance(1.0)
    s.release("alice", sw.slice_id)  # W used 1 s at weight 0.01: it is far behind G in the fair share

    def phase(i: int) -> list:
        t = [s.request("alice", r, gang=f"G/{i}", gang_size=2) for r in (r0, r1)]
        assert all(x.grant is not None for x in t)
        return t

    for i in range(2):  # the gang job comes back at once after each phase: it is held for
        t = phase(i)
        s.release("alice", t[0].grant.slice_id)
        s.release("alice", t[1].grant.slice_id)
    t = phase(2)
    tw = s.request("alice", w)  # W waits on g0 while the gang holds it
    s.release("alice", t[0].grant.slice_id)  # G is ahead of W by the policy: g0 is held for it
    nxt0 = s.request("alice", r0, gang="G/3", gang_size=2)
    assert not nxt0.done() and not tw.done()  # its gang is not complete: still held, W waits
    assert s.get_lease("alice", w).reason.startswith("next: the group is held briefly for your job 'G'")
    s.release("alice", t[1].grant.slice_id)
    nxt1 = s.request("alice", r1, gang="G/3", gang_size=2)
    assert nxt0.grant is not None and nxt1.grant is not None and not tw.done()
    s.release("alice", nxt0.grant.slice_id)
    s.release("alice", nxt1.grant.slice_id)
    # the next time, one rank is slow: when the grace ends g0 goes to W (the incomplete gang does not count)
    nxt0 = s.request("alice", r0, gang="G/4", gang_size=2)
    assert not nxt0.done() and not tw.done()
    clock.advance(1.5)
    s.tick()
    assert tw.grant is not None and not nxt0.done()
    nxt1 = s.request("alice", r1, gang="G/4", gang_size=2)
    assert not nxt0.done() and not nxt1.done()  # g1 is free and reserved; g0 is W's
    s.release("alice", tw.grant.slice_id)
    assert nxt0.grant is not None and nxt1.grant is not None
