"""Scheduler decision latency: 1,000 jobs over 256 accelerators, the pure `Scheduler` (no gRPC), simulated time.

    .venv/bin/python benchmarks/scheduler_sim.py [--jobs 1000] [--accelerators 256] [--sim-s 600] [--sqlite]

Each job leases one group and loops: off the device for a while (reward / environment, 0.5-3 s), then
one phase on its group (0.2-2 s). 70% of the jobs keep state on the device between phases (they are
asked to evict when someone else waits and report 5-20 ms later); weights are 1, 2 or 4. Time is
simulated (a fake clock), so the only real time measured is the scheduler's own: every call the jobs
make (request, release, report_evicted) and every timeout sweep (tick) is timed with perf_counter_ns.
A "decision" is one such call; p50 / p99 / p99.9 / max are over all of them (the max is
whatever the machine and Python's garbage collector did at that moment; read p99 and p99.9). Two layouts of the 256
accelerators: 256 groups of 1, and 32 groups of 8 (node-sized groups, ~31 jobs per queue).

Also reported, as sanity checks of the policy: the longest wait, and Jain's fairness index of
device-time / weight among the jobs of each group that were contending (1.0 = perfectly weighted-fair).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openrl_lab.orchestrator.scheduler import Scheduler


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run(jobs: int, accelerators: int, per_group: int, sim_s: float, policy: str, seed: int, sqlite: bool) -> dict:
    rng = random.Random(seed)
    clock = FakeClock()
    groups = [
        {"id": f"g{i}", "devices": [f"cuda:{i * per_group + k}" for k in range(per_group)], "policy": policy}
        for i in range(accelerators // per_group)
    ]
    tmp = tempfile.TemporaryDirectory() if sqlite else None
    sched = Scheduler(
        {"groups": groups, "holder_timeout_s": 30.0, "max_leases_per_user": 100},
        store=Path(tmp.name) / "o.db" if tmp else None,
        clock=clock,
    )
    lat: dict[str, list[int]] = defaultdict(list)

    def timed(op, fn, *a, **kw):
        t0 = time.perf_counter_ns()
        r = fn(*a, **kw)
        lat[op].append(time.perf_counter_ns() - t0)
        return r

    q: list = []
    seq = itertools.count()

    def at(t, fn):
        heapq.heappush(q, (t, next(seq), fn))

    job_of: dict[str, dict] = {}
    waits: list[float] = []
    used: dict[str, float] = defaultdict(float)

    def request(j):
        timed("request", sched.request, j["owner"], j["lease"], "phase")

    def on_grant(grant):
        j = job_of[grant.lease_id]
        waits.append(grant.waited_s)
        run_s = rng.uniform(0.2, 2.0)
        used[grant.lease_id] += run_s
        at(clock.t + run_s, lambda: release(j, grant))

    def release(j, grant):
        r = timed("release", sched.release, j["owner"], grant.slice_id, j["keep"])
        if r.evict_requested:
            evict(j, r.switch_id)
        at(clock.t + rng.uniform(0.5, 3.0), lambda: request(j))

    def evict(j, switch_id):
        dt = rng.uniform(0.005, 0.02)
        at(clock.t + dt, lambda: timed("report_evicted", sched.report_evicted, j["owner"], j["lease"], switch_id, dt))

    sched.on_grant = on_grant
    sched.on_evict_request = lambda ev: evict(job_of[ev.lease_id], ev.switch_id)
    for i in range(jobs):
        g = groups[rng.randrange(len(groups))]["id"]
        owner = f"user{i % 97}"
        lease = sched.create_lease(owner, g, f"job{i}", weight=rng.choice([1, 2, 4])).lease_id
        j = {
            "owner": owner,
            "lease": lease,
            "keep": rng.random() < 0.7,
            "group": g,
            "weight": sched.get_lease(owner, lease).weight,
        }
        job_of[lease] = j
        at(rng.uniform(0, 3.0), lambda j=j: request(j))

    next_tick = 0.0
    while q and q[0][0] <= sim_s:
        t, _, fn = heapq.heappop(q)
        clock.t = max(clock.t, t)
        fn()
        if clock.t >= next_tick:  # the service's reaper ticks at most every 0.25 s (or at a hold's end)
            wait = timed("tick", sched.tick)
            next_tick = clock.t + min(wait, 0.25)

    # Jain's index of device-time / weight per group, then averaged over groups with >= 2 jobs
    by_group: dict[str, list[float]] = defaultdict(list)
    for lease, j in job_of.items():
        by_group[j["group"]].append(used[lease] / j["weight"])
    jains = [sum(x) ** 2 / (len(x) * sum(v * v for v in x)) for x in by_group.values() if len(x) >= 2 and sum(x)]
    busy = sum(used.values())
    all_ns = sorted(itertools.chain.from_iterable(lat.values()))
    sched.close()
    if tmp:
        tmp.cleanup()

    def pct(xs, p):
        return xs[min(len(xs) - 1, int(p * len(xs)))] / 1000

    return {
        "layout": f"{len(groups)} groups x {per_group}",
        "policy": policy,
        "decisions": len(all_ns),
        "p50_us": pct(all_ns, 0.5),
        "p99_us": pct(all_ns, 0.99),
        "p999_us": pct(all_ns, 0.999),
        "max_us": all_ns[-1] / 1000,
        "per_op": {op: (len(v), pct(sorted(v), 0.5), pct(sorted(v), 0.99)) for op, v in sorted(lat.items())},
        "decisions_per_s": len(all_ns) / (sum(all_ns) / 1e9),  # of scheduler time alone
        "max_wait_s": max(waits),
        "mean_wait_s": statistics.fmean(waits),
        "grants": len(waits),
        "jain": statistics.fmean(jains) if jains else math.nan,
        "utilisation": busy / (sim_s * len(groups)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--accelerators", type=int, default=256)
    p.add_argument("--sim-s", type=float, default=600.0, help="simulated seconds")
    p.add_argument("--policy", default="weighted", choices=["weighted", "lrs", "fifo"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sqlite", action="store_true", help="with the SQLite store (write-behind) attached")
    args = p.parse_args()
    print(
        f"{args.jobs} jobs, {args.accelerators} accelerators, {args.sim_s:g} simulated s, policy {args.policy}"
        f"{', SQLite store' if args.sqlite else ''}"
    )
    print(
        f"{'layout':<18}{'decisions':>10}{'p50 us':>9}{'p99 us':>9}{'p99.9 us':>10}{'max us':>9}{'dec/s':>10}"
        f"{'util':>7}{'max wait':>10}{'Jain':>7}"
    )
    for per_group in (1, 8):
        r = run(args.jobs, args.accelerators, per_group, args.sim_s, args.policy, args.seed, args.sqlite)
        print(
            f"{r['layout']:<18}{r['decisions']:>10}{r['p50_us']:>9.1f}{r['p99_us']:>9.1f}{r['p999_us']:>10.1f}"
            f"{r['max_us']:>9.0f}"
            f"{r['decisions_per_s']:>10.0f}{r['utilisation']:>7.0%}{r['max_wait_s']:>9.1f}s{r['jain']:>7.3f}"
        )
        for op, (n, p50, p99) in r["per_op"].items():
            print(f"    {op:<16}{n:>8}  p50 {p50:7.1f} us  p99 {p99:7.1f} us")


if __name__ == "__main__":
    main()
