"""The scheduler alone (no gRPC), on a fake clock: ordering, fairness, lazy yield, timeouts, bad input, owners.

Everything here is counted, not timed: the clock only moves when a test moves it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import re

import pytest

from openrl_lab.orchestrator.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from openrl_lab.orchestrator.scheduler import Scheduler
from tests.orchestrator.conftest import FakeClock


def make(policy: str = "weighted", **cfg):
    clock = FakeClock()
    evicts = []
    s = Scheduler(
        {
            "groups": [
                {"id": "g", "devices": ["d0"], "policy": policy, "aliases": ["g-alias"]},
                {"id": "h", "devices": ["d1"]},
            ],
            "holder_timeout_s": 1.0,
            **cfg,
        },
        clock=clock,
        on_evict_request=evicts.append,
    )
    return s, clock, evicts


class Sim:
    """Discrete events on the fake clock; the scheduler's timeouts run whenever it asks to be ticked."""

    def __init__(self, sched: Scheduler, clock: FakeClock):
        self.s, self.clock = sched, clock
        self.q: list = []
        self.n = itertools.count()
        self.next_tick = math.inf
        self.jobs: dict[str, Job] = {}
        sched.on_grant = lambda grant: self.jobs[grant.lease_id].granted(grant)
        sched.on_evict_request = lambda ev: self.jobs[ev.lease_id].evict(ev.switch_id)

    def at(self, t: float, fn) -> None:
        heapq.heappush(self.q, (t, next(self.n), fn))

    def run(self, duration: float) -> None:
        until = self.clock.t + duration
        while self.q and self.q[0][0] <= until:
            t, _, fn = heapq.heappop(self.q)
            self.clock.t = max(self.clock.t, t)
            if fn == "tick":
                self.next_tick = math.inf
            else:
                fn()
            nt = self.clock.t + self.s.tick()
            if nt < self.next_tick:
                self.next_tick = nt
                self.at(nt, "tick")


class Job:
    """Asks for the group, runs `run` s on it, then spends `gap` s off it (gap 0: a greedy job); repeats."""

    def __init__(
        self,
        sim: Sim,
        name: str,
        run: float = 1.0,
        gap: float = 0.0,
        keep: bool = False,
        evict_s: float = 0.0,
        first: float = 0.0,
        weight: float | None = None,
        owner: str | None = None,
        priority: str | None = None,
    ):
        self.sim, self.name, self.run, self.gap, self.keep, self.evict_s = sim, name, run, gap, keep, evict_s
        self.owner = owner or name
        self.lease = sim.s.create_lease(self.owner, "g", name, weight=weight, priority=priority).lease_id
        sim.jobs[self.lease] = self
        self.grants, self.evictions = [], 0
        sim.at(sim.clock.t + first, self.request)

    def request(self) -> None:
        self.sim.s.request(self.owner, self.lease, "phase")

    def granted(self, grant) -> None:
        self.grants.append(grant)
        self.sim.at(self.sim.clock.t + self.run, lambda: self.release(grant))

    def release(self, grant) -> None:
        r = self.sim.s.release(self.owner, grant.slice_id, keep_resident=self.keep)
        if r.evict_requested:
            self.evict(r.switch_id)
        self.sim.at(self.sim.clock.t + self.gap, self.request)

    def evict(self, switch_id: int) -> None:
        self.evictions += 1
        self.sim.at(
            self.sim.clock.t + self.evict_s,
            lambda: self.sim.s.report_evicted(self.owner, self.lease, switch_id, self.evict_s),
        )


# --- ordering and fairness -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["weighted", "lrs", "fifo"])
@pytest.mark.parametrize("keep", [False, True])
def test_no_starvation_under_a_steady_stream_from_one_greedy_job(policy, keep):
    s, clock, _ = make(policy, holder_timeout_s=5)
    sim = Sim(s, clock)
    greedy = Job(sim, "greedy", run=1.0, gap=0.0, keep=keep, evict_s=0.05)
    other = Job(sim, "other", run=1.0, gap=2.5, keep=keep, evict_s=0.05, first=0.3)
    sim.run(300)
    assert len(other.grants) >= 70 and len(greedy.grants) >= 150
    # every request of the other job is served within one greedy slice (plus the switch)
    assert max(g.waited_s for g in other.grants) <= 1.0 + 0.05 + 1e-9
    assert s.counters("g")["revocations"] == 0


def test_a_heavily_weighted_greedy_job_still_lets_the_other_through():
    s, clock, _ = make("weighted", holder_timeout_s=5)
    sim = Sim(s, clock)
    greedy = Job(sim, "greedy", gap=0.0, weight=8)
    other = Job(sim, "other", gap=0.5, first=0.3)
    sim.run(300)
    assert len(other.grants) >= 20
    assert max(g.waited_s for g in other.grants) <= 10.0
    assert len(greedy.grants) > 5 * len(other.grants)


@pytest.mark.parametrize("keep", [False, True])
def test_weights_are_respected_under_contention(keep):
    s, clock, _ = make("weighted", holder_timeout_s=5)
    sim = Sim(s, clock)
    heavy = Job(sim, "heavy", gap=0.0, weight=2, keep=keep, evict_s=0.01)
    light = Job(sim, "light", gap=0.0, weight=1, keep=keep, evict_s=0.01, first=0.001)
    sim.run(600)
    ratio = len(heavy.grants) / len(light.grants)
    assert 1.8 <= ratio <= 2.2, ratio


def test_equal_weights_share_equally_and_lrs_goes_round_robin():
    for policy in ("weighted", "lrs"):
        s, clock, _ = make(policy, holder_timeout_s=5)
        sim = Sim(s, clock)
        jobs = [Job(sim, f"j{i}", gap=0.0, first=0.001 * i) for i in range(3)]
        sim.run(300)
        counts = [len(j.grants) for j in jobs]
        assert max(counts) - min(counts) <= 2, (policy, counts)


def test_fifo_grants_in_arrival_order():
    s, clock, _ = make("fifo")
    leases = [s.create_lease(f"u{i}", "g", f"j{i}").lease_id for i in range(5)]
    first = s.acquire("u0", leases[0], timeout=0)
    tickets = [s.request(f"u{i}", leases[i]) for i in (3, 1, 4, 2)]
    order = []
    cur = first
    for _ in range(4):
        clock.advance(1)
        s.release(s._slices[cur.slice_id].lease.owner, cur.slice_id)
        cur = next(t.grant for t in tickets if t.grant and t.grant.slice_id not in {o.slice_id for o in order})
        order.append(cur)
    assert [g.job for g in order] == ["j3", "j1", "j4", "j2"]


# --- lazy yield (counted) ----------------------------------------------------------------------------
def test_a_lone_job_pays_nothing():
    s, clock, evicts = make()
    a = s.create_lease("alice", "g", "a").lease_id
    for _ in range(20):
        grant = s.acquire("alice", a, "forward_backward", timeout=0)
        assert grant.must_restore is False
        clock.advance(1.0)
        assert s.release("alice", grant.slice_id, keep_resident=True).evict_requested is False
        clock.advance(0.5)
    assert evicts == []
    c = s.counters("g")
    assert (c["slices"], c["evictions"], c["restores"]) == (20, 0, 0)
    assert s.get_lease("alice", a).resident == "device"


def test_the_holder_is_told_to_evict_only_when_someone_waits():
    s, clock, evicts = make()
    a = s.create_lease("alice", "g", "a").lease_id
    b = s.create_lease("bob", "g", "b").lease_id

    # A holds, B waits: A's release asks it to evict, and B runs only once A reports.
    ga = s.acquire("alice", a, timeout=0)
    tb = s.request("bob", b)
    clock.advance(1)
    r = s.release("alice", ga.slice_id, keep_resident=True)
    assert r.evict_requested and tb.grant is None
    assert s.status("alice", "g")[0].switching
    clock.advance(0.2)
    s.report_evicted("alice", a, r.switch_id, evict_s=0.2)
    assert tb.grant is not None and tb.grant.must_restore is False and tb.grant.switch_wait_s == pytest.approx(0.2)

    # B releases with A waiting: B evicts; A comes back with must_restore.
    ta = s.request("alice", a)
    clock.advance(1)
    r = s.release("bob", tb.grant.slice_id, keep_resident=True)
    assert r.evict_requested
    s.report_evicted("bob", b, r.switch_id, 0.1)
    assert ta.grant.must_restore is True

    # A releases with nobody waiting: nothing moves. B arrives while A is between phases: A is asked by event.
    clock.advance(1)
    assert s.release("alice", ta.grant.slice_id, keep_resident=True).evict_requested is False
    assert evicts == []
    tb = s.request("bob", b)
    assert tb.grant is None and [e.lease_id for e in evicts] == [a]
    clock.advance(0.3)
    s.report_evicted("alice", a, evicts[0].switch_id, 0.3)
    assert tb.grant.must_restore is True and tb.grant.switch_wait_s == pytest.approx(0.3)
    c = s.counters("g")
    assert (c["evictions"], c["restores"]) == (3, 2)

    # a job that keeps no state is never asked to evict
    clock.advance(1)
    s.release("bob", tb.grant.slice_id, keep_resident=False)
    ga = s.acquire("alice", a, timeout=0)
    assert ga.must_restore is True and s.counters("g")["evictions"] == 3


def test_an_eviction_reported_twice_or_unasked_is_refused():
    s, _clock, _ = make()
    a = s.create_lease("alice", "g", "a").lease_id
    with pytest.raises(FailedPrecondition, match="no eviction of lease 'a' is pending"):
        s.report_evicted("alice", a, 0, 0.0)


def test_a_job_whose_state_left_on_its_own_is_not_waited_for():
    s, _clock, evicts = make()
    a = s.create_lease("alice", "g", "a").lease_id
    b = s.create_lease("bob", "g", "b").lease_id
    grant = s.acquire("alice", a, timeout=0)
    s.release("alice", grant.slice_id, keep_resident=True)
    tb = s.request("bob", b)
    assert tb.grant is None and len(evicts) == 1
    assert s.drop_residency("alice", a) is True  # alice's process ended instead of evicting
    assert tb.grant is not None and tb.grant.must_restore is False
    s.release("bob", tb.grant.slice_id)
    grant = s.acquire("alice", a, timeout=0)
    assert grant.must_restore is False  # nothing to restore: the state is gone
    s.release("alice", grant.slice_id, keep_resident=True)
    assert s.drop_residency("alice", a, kept_on_host=True) is True  # moved off by the job itself
    assert s.drop_residency("alice", a) is False
    tb = s.request("bob", b)
    assert tb.grant is not None and len(evicts) == 1  # nobody to ask
    with pytest.raises(FailedPrecondition, match="holds slice"):
        s.drop_residency("bob", b)


# --- holders that die ----------------------------------------------------------------------------------
def test_a_holder_that_stops_heartbeating_loses_its_slice():
    s, clock, _ = make()
    a = s.create_lease("alice", "g", "a").lease_id
    b = s.create_lease("bob", "g", "b").lease_id
    ga = s.acquire("alice", a, timeout=0)
    tb = s.request("bob", b)
    for _ in range(5):  # heartbeating holders keep their slice however long the phase runs
        clock.advance(0.6)
        s.heartbeat("alice", [a], [ga.slice_id])
        s.tick()
    assert tb.grant is None
    clock.advance(0.9)
    s.tick()
    assert tb.grant is None
    clock.advance(0.2)
    s.tick()
    assert tb.grant is not None
    with pytest.raises(FailedPrecondition, match=r"revoked.*no heartbeat"):
        s.release("alice", ga.slice_id)
    events = s.heartbeat("alice", [a], [ga.slice_id])
    assert [e.type for e in events] == ["revoked"]
    rec = next(r for r in s.timeline("alice", "g").records if r.slice_id == ga.slice_id)
    assert rec.outcome == "revoked" and s.counters("g")["revocations"] == 1


def test_an_unclaimed_grant_is_revoked_even_if_the_lease_heartbeats():
    s, clock, _ = make()
    a = s.create_lease("alice", "g", "a").lease_id
    ga = s.acquire("alice", a, timeout=0)
    for _ in range(3):  # the client heartbeats its lease but never learnt of the grant
        clock.advance(0.5)
        s.heartbeat("alice", [a], [])
        s.tick()
    assert s.get_lease("alice", a).state == "idle"
    assert s.timeline("alice", "g").records[-1].outcome == "revoked" and ga.slice_id


def test_an_eviction_by_a_dead_job_is_given_up_after_the_timeout():
    s, clock, evicts = make()
    a = s.create_lease("alice", "g", "a").lease_id
    b = s.create_lease("bob", "g", "b").lease_id
    ga = s.acquire("alice", a, timeout=0)
    s.release("alice", ga.slice_id, keep_resident=True)
    tb = s.request("bob", b)
    assert evicts and tb.grant is None
    clock.advance(0.6)
    s.tick()
    assert tb.grant is None
    clock.advance(0.6)
    s.tick()
    assert tb.grant is not None
    assert s.get_lease("alice", a).resident == "none"  # its state went with it


# --- bad input --------------------------------------------------------------------------------------
def test_bad_input_is_refused_with_errors_naming_the_problem():
    s, _clock, _ = make(max_leases_per_user=3)
    with pytest.raises(NotFound, match="group 'nope' not found; groups here: g \\(aliases g-alias\\), h"):
        s.create_lease("alice", "nope", "a")
    for w in (0, -1, float("nan"), float("inf"), 1e9, True):
        with pytest.raises(InvalidArgument, match="weight"):
            s.create_lease("alice", "g", "a", weight=w)
    with pytest.raises(InvalidArgument, match="quota_s must be >= 0 accelerator-seconds, got -5"):
        s.create_lease("alice", "g", "a", quota_s=-5)
    with pytest.raises(InvalidArgument, match="quota_s of 1e\\+12 accelerator-seconds is absurd"):
        s.create_lease("alice", "g", "a", quota_s=1e12)
    with pytest.raises(InvalidArgument, match="ttl_s"):
        s.create_lease("alice", "g", "a", ttl_s=0)
    for name in ("", "../etc", "a b", "x" * 200):
        with pytest.raises(InvalidArgument, match="lease name"):
            s.create_lease("alice", "g", name)
    a = s.create_lease("alice", "g", "a").lease_id
    with pytest.raises(InvalidArgument, match="phase kind"):
        s.request("alice", a, "")
    grant = s.acquire("alice", a, "sample", timeout=0)
    with pytest.raises(FailedPrecondition, match=r"lease 'a' already holds slice .* of group 'g' \(a sample phase\)"):
        s.request("alice", a)
    b = s.create_lease("bob", "g", "b").lease_id
    tb = s.request("bob", b)
    with pytest.raises(FailedPrecondition, match="already waiting"):
        s.request("bob", b)
    with pytest.raises(NotFound, match="slice 'slice-nope' not found"):
        s.release("alice", "slice-nope")
    with pytest.raises(NotFound):  # bob is not the holder: to him alice's slice does not exist
        s.release("bob", grant.slice_id)
    with pytest.raises(InvalidArgument, match="restore_s"):
        s.release("alice", grant.slice_id, restore_s=-1)
    s.release("alice", grant.slice_id)
    with pytest.raises(FailedPrecondition, match="not held any more: it was released"):
        s.release("alice", grant.slice_id)
    assert tb.grant is not None  # nothing above disturbed the queue
    with pytest.raises(InvalidArgument, match="timeout_s"):
        s.wait(s.request("alice", a), timeout=-1)
    s.create_lease("alice", "g", "a2")
    s.create_lease("alice", "h", "a3")
    with pytest.raises(ResourceExhausted, match="already has 3 leases"):
        s.create_lease("alice", "g", "a4")


def test_a_lease_that_used_its_quota_is_refused():
    s, clock, _ = make()
    a = s.create_lease("alice", "g", "a", quota_s=2.0).lease_id
    for _ in range(2):
        grant = s.acquire("alice", a, timeout=0)
        clock.advance(1.0)
        s.release("alice", grant.slice_id)
    with pytest.raises(ResourceExhausted, match="used its quota of 2 accelerator-seconds"):
        s.request("alice", a)
    s.create_lease("alice", "g", "a", quota_s=10)  # reattach with a larger quota
    s.acquire("alice", a, timeout=0)


def test_acquire_times_out_and_leaves_the_queue():
    s, _clock, _ = make()
    a = s.create_lease("alice", "g", "a").lease_id
    b = s.create_lease("bob", "g", "b").lease_id
    s.acquire("alice", a, timeout=0)
    with pytest.raises(TimeoutError, match=re.escape("no slice of group 'g' for lease 'b' within 0.01 s")):
        s.acquire("bob", b, timeout=0.01)
    assert s.status("bob", "g")[0].queue == ()


# --- owners -------------------------------------------------------------------------------------------
def test_one_users_key_never_reaches_another_users_leases():
    s, clock, _ = make()
    a = s.create_lease("alice", "g", "a").lease_id
    for call in (
        lambda: s.get_lease("bob", a),
        lambda: s.close_lease("bob", a),
        lambda: s.request("bob", a),
        lambda: s.report_evicted("bob", a),
    ):
        with pytest.raises(NotFound, match="not found"):
            call()
    assert s.list_leases("bob") == [] and [L.name for L in s.list_leases("alice")] == ["a"]
    # the same name is a different lease for another user
    assert s.create_lease("bob", "g", "a").lease_id != a
    events = s.heartbeat("bob", [a])
    assert [e.type for e in events] == ["unknown_lease"]
    grant = s.acquire("alice", a, timeout=0)
    holder = s.status("bob", "g")[0].holder
    assert holder.job == "" and holder.mine is False and holder.lease_ref
    assert s.status("alice", "g")[0].holder.job == "a"
    clock.advance(1)
    s.release("alice", grant.slice_id, outcome="failed", error="secret detail")
    rec = s.timeline("bob", "g").records[-1]
    assert (rec.job, rec.mine, rec.error) == ("", False, "")
    assert s.timeline("alice", "g").records[-1].error == "secret detail"


def test_leases_reattach_by_name_and_expire_without_heartbeats():
    s, clock, _ = make()
    first = s.create_lease("alice", "g-alias", "run-1", weight=1, ttl_s=5)
    again = s.create_lease("alice", "g", "run-1", weight=3)
    assert again.lease_id == first.lease_id and again.reattached and again.weight == 3 and again.group_id == "g"
    for _ in range(3):  # heartbeats renew it
        clock.advance(4)
        s.heartbeat("alice", [first.lease_id])
        s.tick()
    assert s.get_lease("alice", first.lease_id).slices == 0
    clock.advance(6)
    s.tick()
    with pytest.raises(NotFound):
        s.get_lease("alice", first.lease_id)
    assert s.create_lease("alice", "g", "run-1").lease_id != first.lease_id


# --- timeline ---------------------------------------------------------------------------------------
def test_timeline_records_every_slice_and_the_duty_cycle():
    s, clock, evicts = make()
    a = s.create_lease("alice", "g", "a").lease_id
    b = s.create_lease("bob", "g", "b").lease_id
    t0 = clock()
    for _ in range(10):  # alone: 1 s on the group, 1 s off
        grant = s.acquire("alice", a, "forward_backward", timeout=0)
        clock.advance(1)
        s.release("alice", grant.slice_id, keep_resident=True)
        clock.advance(1)
    d = s.duty_cycle("g", since=t0, until=clock())
    assert d.duty_cycle == pytest.approx(0.5) and d.switch_share == 0 and d.slices == 10
    # bob arrives: alice evicts (0.2 s); bob restores nothing; then alice restores (0.1 s) in her slice
    tb = s.request("bob", b, "sample")
    clock.advance(0.2)
    s.report_evicted("alice", a, evicts[-1].switch_id, 0.2)
    clock.advance(1)
    s.release("bob", tb.grant.slice_id)
    grant = s.acquire("alice", a, "optim_step", timeout=0)
    assert grant.must_restore
    clock.advance(0.5)
    s.release("alice", grant.slice_id, restore_s=0.1)
    tl = s.timeline("alice", "g")
    recs = tl.records
    assert [r.kind for r in recs[-3:]] == ["forward_backward", "sample", "optim_step"]
    sample, optim = recs[-2], recs[-1]
    assert sample.switch_s == pytest.approx(0.2) and sample.evict_s == pytest.approx(0.2) and not sample.mine
    assert optim.restore_s == pytest.approx(0.1) and optim.run_s == pytest.approx(0.4) and optim.must_restore
    d = s.duty_cycle("g", since=clock() - 1.7, until=clock())
    assert d.busy_s == pytest.approx(1.4) and d.switch_s == pytest.approx(0.3)
    # paging by sequence number
    page = s.timeline("alice", "g", since_seq=0, limit=4)
    assert len(page.records) == 4
    rest = s.timeline("alice", "g", since_seq=page.last_seq)
    assert {r.slice_id for r in page.records}.isdisjoint({r.slice_id for r in rest.records})


def test_the_timeline_streams_to_subscribers():
    s, clock, _ = make()
    a = s.create_lease("alice", "g", "a").lease_id
    sub = s.subscribe_timeline("alice", "g")
    grant = s.acquire("alice", a, "sample", timeout=0)
    clock.advance(1)
    s.release("alice", grant.slice_id)
    got = [sub.get(timeout=1), sub.get(timeout=1)]
    assert [r.outcome for r in got] == ["running", "ok"] and got[1].seq > got[0].seq
    s.unsubscribe(sub)


# --- SQLite -----------------------------------------------------------------------------------------
def test_leases_resident_state_and_timeline_survive_a_restart(tmp_path):
    cfg = {"groups": [{"id": "g", "devices": ["d0"]}], "holder_timeout_s": 1.0}
    clock = FakeClock()
    s1 = Scheduler(cfg, store=tmp_path / "o.db", clock=clock)
    a = s1.create_lease("alice", "g", "a", weight=2, quota_s=100).lease_id
    for _ in range(3):
        grant = s1.acquire("alice", a, timeout=0)
        clock.advance(1)
        s1.release("alice", grant.slice_id, keep_resident=True)
    running = s1.acquire("alice", a, timeout=0)
    s1.store.flush()  # a crash now: no close
    evicts = []
    s2 = Scheduler(cfg, store=tmp_path / "o.db", clock=clock, on_evict_request=evicts.append)
    info = s2.create_lease("alice", "g", "a")
    assert (info.lease_id, info.reattached, info.weight, info.quota_s, info.slices) == (a, True, 2, 100, 4)
    assert info.used_s == pytest.approx(3.0)
    recs = s2.timeline("alice", "g").records
    assert [r.outcome for r in recs] == ["ok", "ok", "ok", "interrupted"] and recs[-1].slice_id == running.slice_id
    # alice's state was on the device: a newcomer still makes her evict first
    b = s2.create_lease("bob", "g", "b").lease_id
    tb = s2.request("bob", b)
    assert [e.lease_id for e in evicts] == [a] and tb.grant is None
    s2.close()
    s1.close()


def test_the_timeline_pages_into_sqlite_beyond_what_is_kept_in_memory(tmp_path):
    clock = FakeClock()
    s = Scheduler(
        {"groups": [{"id": "g", "devices": ["d0"]}], "timeline_kept": 5}, store=tmp_path / "o.db", clock=clock
    )
    a = s.create_lease("alice", "g", "a").lease_id
    ids = []
    for _ in range(12):
        grant = s.acquire("alice", a, timeout=0)
        ids.append(grant.slice_id)
        clock.advance(1)
        s.release("alice", grant.slice_id)
    s.store.flush()
    got, seq = [], 0
    while True:
        page = s.timeline("alice", "g", since_seq=seq, limit=4)
        if not page.records:
            break
        got += [r.slice_id for r in page.records]
        seq = page.last_seq
    assert got == ids
    assert [r.slice_id for r in s.timeline("alice", "g", since=clock() - 7.5).records] == ids[-8:]
    s.close()
