"""A fake-clock simulation of gang acquisition: many gangs (2-4 ranks over 5 groups) and single-device jobs,
random phase lengths and gaps, lazy yield with evictions, some interactive leases, under every policy. It
checks, for thousands of phases: every phase is granted (no deadlock), within a bound relative to the load
(no starvation), never part of a gang, never two holders of a group; with gang backfill on and off, and busy
time rises with it (summed busy simulated seconds: deterministic under a seed). Seeded; counted, not timed."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

import pytest

from openrl_lab.orchestrator.scheduler import Scheduler
from tests.orchestrator.conftest import FakeClock

N_GROUPS = 5
OWNER = "alice"


@dataclass
class SimJob:
    name: str
    groups: list[str]  # one for a single-device job; 2-4 for a gang
    run: float  # mean phase length
    gap: float  # mean time off the groups between phases
    keep: bool  # keeps its state resident (lazy yield: evictions)
    interactive: bool
    leases: dict[str, str] = field(default_factory=dict)  # group -> lease id
    phase: int = 0
    asked_at: float = 0.0
    granted: dict[str, str] = field(default_factory=dict)  # group -> slice id, this phase
    released: int = 0
    waits: list[float] = field(default_factory=list)


class GangSim:
    def __init__(self, policy: str, seed: int, n_gangs: int = 8, n_singles: int = 6, **cfg):
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.groups = [f"g{i}" for i in range(N_GROUPS)]
        self.s = Scheduler(
            {
                "groups": [{"id": g, "devices": [f"d{i}"], "policy": policy} for i, g in enumerate(self.groups)],
                "holder_timeout_s": 1e6,
                "max_phase_s": 0.0,
                "default_ttl_s": 1e6,
                "max_ttl_s": 1e7,
                "interactive_window_s": 20.0,
                # the interactive share is of wall time, and groups idle while reserved for gangs: at 0.5 greedy
                # interactive jobs leave a batch job on their group little (measured: waits of ~25 rounds)
                "interactive_share": 0.25,
                **cfg,
            },
            clock=self.clock,
            on_grant=self._granted,
            on_evict_request=lambda ev: self.at(self.clock.t + self.evict_s, lambda: self._evict(ev.lease_id)),
        )
        self.q: list = []
        self.n = itertools.count()
        self.next_tick = math.inf
        self.evict_s = 0.05
        self.jobs: list[SimJob] = []
        self.by_lease: dict[str, tuple[SimJob, str]] = {}
        self.holder: dict[str, str | None] = dict.fromkeys(self.groups)  # group -> lease holding it (our ledger)
        self.stop_at = math.inf
        self.pending_evict: set[str] = set()
        self.busy_since: dict[str, float] = {}  # group -> when its present slice was granted
        self.busy_s = 0.0  # summed held seconds of all groups within [start, stop_at]
        self.start = self.clock.t
        for i in range(n_gangs):
            size = self.rng.randint(2, 4)
            self._add(f"gang{i}", self.rng.sample(self.groups, size))
        for i in range(n_singles):
            self._add(f"single{i}", [self.rng.choice(self.groups)])

    def _add(self, name: str, groups: list[str]) -> None:
        j = SimJob(
            name,
            groups,
            run=self.rng.uniform(0.05, 1.0),
            gap=self.rng.choice([0.0, 0.0, self.rng.uniform(0.0, 1.0)]),
            keep=self.rng.random() < 0.6,
            interactive=self.rng.random() < 0.25,
        )
        for g in groups:
            lid = self.s.create_lease(OWNER, g, name, priority="interactive" if j.interactive else None).lease_id
            j.leases[g] = lid
            self.by_lease[lid] = (j, g)
        self.jobs.append(j)
        self.at(self.clock.t + self.rng.uniform(0, 1.0), lambda: self._start(j))

    # --- events ---------------------------------------------------------------------------------------
    def at(self, t: float, fn) -> None:
        heapq.heappush(self.q, (t, next(self.n), fn))

    def _start(self, j: SimJob) -> None:
        if self.clock.t >= self.stop_at:
            return
        j.phase += 1
        j.granted, j.released, j.asked_at = {}, 0, self.clock.t
        for g in j.groups:  # the ranks ask at slightly different times
            self.at(self.clock.t + self.rng.uniform(0, 0.02), lambda g=g: self._ask(j, g))

    def _ask(self, j: SimJob, g: str) -> None:
        gang = (f"{j.name}/{j.phase}", len(j.groups)) if len(j.groups) > 1 else ("", 0)
        self.s.request(OWNER, j.leases[g], "forward_backward", gang=gang[0], gang_size=gang[1])

    def _granted(self, grant) -> None:
        j, g = self.by_lease[grant.lease_id]
        assert self.holder[g] is None, f"{g} granted to {j.name} while {self.holder[g]} holds it"
        self.holder[g] = grant.lease_id
        self.busy_since[g] = self.clock.t
        j.granted[g] = grant.slice_id
        if len(j.granted) == len(j.groups):
            j.waits.append(self.clock.t - j.asked_at)
            run = self.rng.expovariate(1 / j.run)
            for gg, sid in j.granted.items():
                self.at(
                    self.clock.t + run * self.rng.uniform(0.9, 1.0), lambda gg=gg, sid=sid: self._release(j, gg, sid)
                )

    def _release(self, j: SimJob, g: str, sid: str) -> None:
        self.holder[g] = None
        self.busy_s += max(0.0, min(self.clock.t, self.stop_at) - self.busy_since.pop(g))
        r = self.s.release(OWNER, sid, keep_resident=j.keep)
        if r.evict_requested:
            self.at(self.clock.t + self.evict_s, lambda: self._evict(j.leases[g], r.switch_id))
        j.released += 1
        if j.released == len(j.groups):
            self.at(self.clock.t + self.rng.expovariate(1 / j.gap) if j.gap else self.clock.t, lambda: self._start(j))

    def _evict(self, lease_id: str, switch_id: int = 0) -> None:
        lease = self.s._leases[lease_id]
        if lease.evict_switch and (not switch_id or lease.evict_switch == switch_id):
            self.s.report_evicted(OWNER, lease_id, lease.evict_switch, evict_s=self.evict_s)

    def check_gangs_whole(self) -> None:
        """No gang is ever partly granted: each job holds none or all of its phase's slices."""
        for j in self.jobs:
            held = sum(1 for g in j.groups if self.holder[g] == j.leases[g])
            if j.released == 0:
                assert held in (0, len(j.groups)), f"{j.name} holds {held} of its {len(j.groups)} slices"

    def duty(self) -> float:
        """Busy share of all groups' time while jobs started phases (the drain after is not counted)."""
        return self.busy_s / (N_GROUPS * (self.stop_at - self.start))

    def run(self, until: float, drain: float) -> None:
        self.stop_at = self.clock.t + until
        end = self.stop_at + drain
        while self.q and self.q[0][0] <= end:
            t, _, fn = heapq.heappop(self.q)
            self.clock.t = max(self.clock.t, t)
            if fn == "tick":
                if t != self.next_tick:
                    continue  # superseded by an earlier one
                self.next_tick = math.inf
            else:
                fn()
            self.check_gangs_whole()
            nt = self.clock.t + self.s.tick()
            if nt < self.next_tick:
                self.next_tick = nt
                self.at(nt, "tick")


def check_guarantees(sim: GangSim) -> None:
    """Every phase asked for was granted and ended, nobody starved, waits were bounded (no partial gang and one
    holder per group are checked at every event while it runs)."""
    assert sum(j.phase for j in sim.jobs) > 1000
    for j in sim.jobs:
        assert len(j.waits) == j.phase and j.released == len(j.groups), (j.name, j.phase, len(j.waits))
        assert j.phase >= 5, f"{j.name} ran only {j.phase} phases in 600 s"  # nobody starves
    assert all(h is None for h in sim.holder.values())
    assert all(st.holder is None and not st.queue for st in sim.s.status(None))
    # bounded wait relative to the load: the system is saturated (most jobs come straight back), and a group
    # idles while it is reserved for a gang that waits for its other groups, so a phase may wait for several
    # rounds of every other job's phase; never without bound. Measured over seeds 1-5 and the three policies:
    # single-device phases up to ~11.4 rounds without backfill and ~12.2 with it (behind gangs a backfill that
    # overran its estimate delayed: the sim's phase lengths are exponential); gang phases up to ~2.7 rounds
    one_round = sum(j.run + sim.evict_s for j in sim.jobs)
    worst = max(w for j in sim.jobs for w in j.waits)
    assert worst < 16 * one_round, f"a phase waited {worst:.1f} s (one round of every job: {one_round:.1f} s)"
    worst_gang = max(w for j in sim.jobs if len(j.groups) > 1 for w in j.waits)
    assert worst_gang < 4 * one_round, f"a gang phase waited {worst_gang:.1f} s (one round: {one_round:.1f} s)"


@pytest.mark.parametrize("policy, seed", [("weighted", 1), ("lrs", 2), ("fifo", 3)])
def test_many_gangs_and_single_jobs_never_deadlock_starve_or_split_and_backfill_raises_busy_time(policy, seed):
    """The same seeded workload (the same jobs; their phases then differ as the schedules do) without and with
    gang backfill: every guarantee holds in both, and the groups are busy more of the time with it."""
    sims = {}
    for backfill in (False, True):
        sim = sims[backfill] = GangSim(policy, seed, gang_backfill=backfill)
        sim.run(until=600.0, drain=600.0)
        check_guarantees(sim)
    backfills = sum(
        1 for g in sims[True].groups for r in sims[True].s.timeline(None, g).records if r.priority == "backfill"
    )
    assert backfills > 0
    assert not any(
        r.priority == "backfill" for g in sims[False].groups for r in sims[False].s.timeline(None, g).records
    )
    off, on = sims[False].duty(), sims[True].duty()
    print(
        f"\n{policy} seed {seed}: duty cycle {off:.3f} without backfill, {on:.3f} with it ({backfills} backfills kept)"
    )
    # measured: weighted 0.483 -> 0.567, lrs 0.509 -> 0.585, fifo 0.524 -> 0.556 (over seeds 1-5, every run rose)
    assert on > off * 1.03, (off, on)


def test_gangs_alone_over_few_groups_all_progress():
    """Only gangs, each wanting 2-4 of the 5 groups: the order alone must keep them all moving."""
    sim = GangSim("weighted", 7, n_gangs=10, n_singles=0)
    sim.run(until=200.0, drain=300.0)
    for j in sim.jobs:
        assert len(j.waits) == j.phase >= 5
