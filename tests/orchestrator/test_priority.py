"""Interactive priority on the scheduler alone, on a fake clock: interactive phases go before waiting batch
phases, within the group's interactive share over a sliding window; past it they queue as batch. Then the
same rule over real gRPC, and what the views say of it.

Counted, not timed: the clock only moves when a simulation moves it.
"""

from __future__ import annotations

import sqlite3
import statistics

import pytest

from openrl_lab.orchestrator.errors import InvalidArgument
from openrl_lab.orchestrator.scheduler import Scheduler
from tests.orchestrator.conftest import FakeClock
from tests.orchestrator.test_scheduler import Job, Sim, make
from tests.orchestrator.test_service import wait_for

BATCH_PHASE_S = 0.5
EVICT_S = 0.01


def saturated(policy: str, interactive: bool, minutes: float = 5, **cfg):
    """Two greedy batch jobs with 0.5 s phases and a person sampling every ~3 s (0.1 s phases): the issue's
    benchmark, simulated. Returns (scheduler, person, batch jobs)."""
    s, clock, _ = make(policy, holder_timeout_s=5, **cfg)
    sim = Sim(s, clock)
    batch = [Job(sim, f"batch{i}", run=BATCH_PHASE_S, keep=True, evict_s=EVICT_S, first=0.01 * i) for i in range(2)]
    person = Job(
        sim,
        "person",
        run=0.1,
        gap=2.9,
        keep=True,
        evict_s=EVICT_S,
        first=1.234,
        priority="interactive" if interactive else None,
    )
    sim.run(60 * minutes)
    return s, person, batch


def p95(xs):
    return statistics.quantiles(xs, n=20, method="inclusive")[-1]


@pytest.mark.parametrize("policy", ["weighted", "lrs", "fifo"])
def test_an_interactive_phase_waits_at_most_one_batch_phase_and_a_switch(policy):
    s, person, batch = saturated(policy, interactive=True)
    waits = [g.waited_s for g in person.grants]
    assert len(waits) >= 90
    # the goal of the issue: p95 <= one batch phase plus one switch; here even the worst case is
    assert max(waits) <= BATCH_PHASE_S + EVICT_S + 1e-9
    recs = s.timeline(None, "g", limit=100000).records
    assert {r.priority for r in recs if r.job == "person"} == {"interactive"}
    assert {r.priority for r in recs if r.job != "person"} == {"batch"}
    assert min(len(j.grants) for j in batch) > 200  # the batch jobs kept the group busy throughout


def test_without_priority_the_same_person_queues_behind_batch_phases():
    """The rule is what makes the difference: under fifo the person waits for the holder and the batch job
    queued before it."""
    _, person, _ = saturated("fifo", interactive=False)
    _, person_first, _ = saturated("fifo", interactive=True)
    slow = [g.waited_s for g in person.grants]
    fast = [g.waited_s for g in person_first.grants]
    assert p95(slow) > BATCH_PHASE_S + 2 * EVICT_S
    assert p95(fast) < p95(slow) / 1.5


@pytest.mark.parametrize("policy", ["weighted", "fifo"])
def test_priority_costs_the_batch_jobs_nothing_beyond_the_time_it_uses(policy):
    _, _, plain = saturated(policy, interactive=False)
    _, _, first = saturated(policy, interactive=True)
    done = lambda jobs: sum(len(j.grants) for j in jobs)  # noqa: E731
    # the same interactive work, only reordered: the batch jobs lose (almost) nothing
    assert done(first) >= 0.98 * done(plain)


def greedy_interactive(share: float, window: float, policy: str = "fifo", seconds: float = 300):
    """An interactive job that always wants the group again at once (1 s phases) beside two greedy batch
    jobs: each time it comes back a batch job waits, so with priority it would always go next."""
    s, clock, _ = make(policy, holder_timeout_s=5, interactive_share=share, interactive_window_s=window)
    sim = Sim(s, clock)
    hog = Job(sim, "hog", run=1.0, priority="interactive")
    workers = [Job(sim, f"worker{i}", run=1.0, first=0.001 * (i + 1)) for i in range(2)]
    sim.run(seconds)
    hog_share = len(hog.grants) / (len(hog.grants) + sum(len(w.grants) for w in workers))
    return s, hog_share, workers


@pytest.mark.parametrize("share", [0.15, 0.4])
def test_the_interactive_share_caps_priority_over_any_window(share):
    window = 20.0
    s, hog_share, workers = greedy_interactive(share, window)
    recs = [r for r in s.timeline(None, "g", limit=100000).records if r.outcome == "ok"]
    first = [(r.granted_at, r.released_at) for r in recs if r.priority == "interactive"]
    assert {r.priority for r in recs if r.job == "hog"} == {"interactive", "interactive-capped"}
    # in every window (ending where a phase that went first ends), what went first is within the cap,
    # overshooting by at most the one phase that was granted just under it
    for _, end in first:
        used = sum(max(0.0, min(b, end) - max(a, end - window)) for a, b in first)
        assert used <= share * window + 1.0 + 1e-9, (end, used)
    # with no cap it would take half the group (next after every batch phase); the cap holds it nearer its third
    assert 1 / 3 - 0.03 <= hog_share <= 1 / 3 + share / 2
    for w in workers:  # never starved: a batch job waits at most the cap's worth plus a round
        assert max(g.waited_s for g in w.grants) <= share * window + 3.0 + 1e-9


def test_a_share_of_zero_turns_priority_off_and_one_removes_the_cap():
    s, hog_share, _ = greedy_interactive(0.0, 20.0)
    assert {r.priority for r in s.timeline(None, "g", limit=100000).records if r.job == "hog"} == {"interactive-capped"}
    assert hog_share == pytest.approx(1 / 3, abs=0.01)  # fifo round robin, as if all three were batch
    _, hog_share, _ = greedy_interactive(1.0, 20.0)
    assert hog_share == pytest.approx(1 / 2, abs=0.01)  # no cap: it goes next after every batch phase


@pytest.mark.parametrize("share", [0.2, 0.5])
def test_under_weighted_an_interactive_job_gets_its_fair_share_or_the_interactive_share(share):
    """Priority reorders; it does not buy device time beyond the cap: a phase that went first still counts
    against its lease's fair share, so a greedy interactive job ends with the larger of its fair third and
    the interactive share (without the cap it would hold the group: it is always next, and comes back at once)."""
    _, hog_share, workers = greedy_interactive(share, 20.0, policy="weighted", seconds=600)
    assert hog_share == pytest.approx(max(1 / 3, share), abs=0.04)
    a, b = (len(w.grants) for w in workers)
    assert abs(a - b) <= 0.05 * (a + b)  # the batch jobs share the rest evenly


def test_the_reason_says_what_the_class_does():
    s, clock, _ = make("fifo", interactive_share=0.1, interactive_window_s=10)
    a = s.create_lease("alice", "g", "batch-a").lease_id
    b = s.create_lease("bob", "g", "batch-b").lease_id
    p = s.create_lease("carol", "g", "notebook", priority="interactive").lease_id
    held = s.acquire("alice", a, timeout=0)
    s.request("bob", b)
    s.request("carol", p)
    assert s.get_lease("carol", p).priority == "interactive"
    info = s.get_lease("carol", p)
    assert info.queue_position == 1
    assert "interactive: goes before batch phases (interactive share 0 of 1 s in the last 10 s)" in info.reason
    bob = s.get_lease("bob", b)
    assert bob.queue_position == 2 and bob.reason.endswith("batch: 1 interactive phase goes first")
    st = s.status("carol", "g")[0]
    assert [(q.mine, q.priority) for q in st.queue] == [(True, "interactive"), (False, "batch")]
    assert (st.interactive_used_s, st.interactive_cap_s, st.interactive_window_s) == (0.0, 1.0, 10.0)
    assert "interactive 0 of 1 s in the last 10 s" in str(st)
    # carol goes first and uses the share up (2 s of an allowed 1 s): her next phase queues as batch
    clock.advance(1)
    s.release("alice", held.slice_id)
    grant = s.status("carol", "g")[0].holder
    assert grant.job == "notebook" and grant.priority == "interactive"
    clock.advance(2)
    s.release("carol", s.timeline("carol", "g").records[-1].slice_id)
    s.request("carol", p)
    info = s.get_lease("carol", p)
    assert info.queue_position == 1  # fifo: bob is holding now, carol is the only one waiting
    assert "interactive, queued as batch: the group's interactive share is used up (2 of 1 s in the last 10 s)" in (
        info.reason
    )
    assert s.status("carol", "g")[0].queue[0].priority == "interactive-capped"
    # the window slides on: priority comes back
    clock.advance(10)
    assert "goes before batch phases" in s.get_lease("carol", p).reason


def test_priority_is_checked_and_can_change_on_reattach():
    s, _clock, _ = make()
    with pytest.raises(InvalidArgument, match="priority 'urgent' is not a priority class: one of interactive, batch"):
        s.create_lease("alice", "g", "a", priority="urgent")
    assert s.create_lease("alice", "g", "a").priority == "batch"
    assert s.create_lease("alice", "g", "a", priority="interactive").priority == "interactive"
    assert s.create_lease("alice", "g", "a").priority == "interactive"  # unchanged when not given
    with pytest.raises(Exception, match="interactive_share"):
        make(interactive_share=1.5)


def test_priority_and_the_used_share_survive_a_restart_and_an_old_database_opens(tmp_path):
    cfg = {"groups": [{"id": "g", "devices": ["d0"]}], "interactive_share": 0.5, "interactive_window_s": 10}
    clock = FakeClock()
    s1 = Scheduler(cfg, store=tmp_path / "o.db", clock=clock)
    p = s1.create_lease("carol", "g", "notebook", priority="interactive").lease_id
    grant = s1.acquire("carol", p, timeout=0)
    clock.advance(3)
    s1.release("carol", grant.slice_id)
    s1.close()
    s2 = Scheduler(cfg, store=tmp_path / "o.db", clock=clock)
    assert s2.get_lease("carol", p).priority == "interactive"
    assert s2.timeline("carol", "g").records[-1].priority == "interactive"
    assert s2.status("carol", "g")[0].interactive_used_s == pytest.approx(3.0)  # the window is rebuilt
    s2.close()

    old = tmp_path / "old.db"
    s3 = Scheduler(cfg, store=old, clock=clock)
    s3.create_lease("dave", "g", "job")
    s3.close()
    with sqlite3.connect(old) as db:  # as written before the priority columns existed
        db.execute("ALTER TABLE orch_leases DROP COLUMN priority")
        db.execute("ALTER TABLE orch_slices DROP COLUMN priority")
    s4 = Scheduler(cfg, store=old, clock=clock)
    assert s4.create_lease("dave", "g", "job").priority == "batch"
    s4.close()


# --- over real gRPC -------------------------------------------------------------------------------------
def test_over_grpc_a_waiting_interactive_phase_is_granted_before_a_batch_one_queued_earlier(make_client):
    import threading

    from openrl_lab.orchestrator import InvalidArgument as GrpcInvalidArgument

    holder, batch = make_client("batch-1"), make_client("batch-2", key="key-bob")
    person = make_client("notebook", priority="interactive")
    assert person.lease("trainer-group").priority == "interactive"
    assert holder.lease("trainer-group").priority == "batch"
    with pytest.raises(GrpcInvalidArgument, match="priority 'soon' is not a priority class"):
        person.lease("trainer-group", "other", priority="soon")
    held = holder.acquire("trainer-group", kind="forward_backward")
    order: list[str] = []

    def take(client, name):
        s = client.acquire("trainer-group", kind="sample")
        order.append(name)
        client.release(s)

    threads = [threading.Thread(target=take, args=(batch, "batch-2"))]
    threads[0].start()
    wait_for(lambda: len(holder.get_status("trainer-group").queue) == 1, what="the batch job to queue")
    threads.append(threading.Thread(target=take, args=(person, "notebook")))
    threads[1].start()
    wait_for(lambda: len(holder.get_status("trainer-group").queue) == 2, what="the person to queue")
    st = person.get_status("trainer-group")
    assert [(q.job, q.priority) for q in st.queue] == [("notebook", "interactive"), ("", "batch")]
    assert "goes before batch phases" in st.queue[0].reason
    assert st.interactive_cap_s == pytest.approx(30.0) and st.interactive_window_s == 60.0
    holder.release(held)
    for t in threads:
        t.join(10)
    assert order == ["notebook", "batch-2"]
    recs = person.timeline("trainer-group").records
    assert [(r.job, r.priority) for r in recs if r.mine] == [("batch-1", "batch"), ("notebook", "interactive")]
    assert [r.priority for r in recs if not r.mine] == ["batch"]  # bob's, its class shown, its name not


def test_a_job_that_comes_back_after_a_pause_gets_no_credit_for_it_when_all_are_interactive():
    """Every grant here goes first as interactive (no cap): the fair-share clock must still move, or a job
    arriving late would start at virtual time 0 and hold the group until it caught up with the others."""
    s, clock, _ = make("weighted", holder_timeout_s=5, interactive_share=1.0)
    sim = Sim(s, clock)
    early = [Job(sim, f"early{i}", run=1.0, priority="interactive", first=0.001 * i) for i in range(2)]
    sim.run(200)
    late = Job(sim, "late", run=1.0, priority="interactive")
    before = [len(j.grants) for j in early]
    sim.run(30)
    assert all(len(j.grants) - n >= 8 for j, n in zip(early, before)), [
        len(j.grants) - n for j, n in zip(early, before)
    ]
    assert 8 <= len(late.grants) <= 12  # its third, not the whole group
