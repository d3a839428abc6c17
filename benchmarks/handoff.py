"""Hand-off latency: how long a group stands idle between one job's phase and the next, through the public
`on_accelerators` decorator and the real gRPC orchestrator on loopback.

    .venv/bin/python benchmarks/handoff.py [--jobs 1,2,4] [--duration 12] [--acc-ms 40] [--gap-ms 60]
                                           [--store sqlite|memory] [--auth keys|none] [--repeat 1]

N = 1, 2, 4 job processes, each with its own `TimeSliceOrchestratorClient`, share one group. Each loops:

* a CPU-BOUND phase of `acc_ms` (a busy loop, not a sleep) inside `@client.on_accelerators(group_id=...)`,
* then `time.sleep(gap_ms)`; no evict/restore hooks (the issue's check used the bare decorator).

Alone a job would keep the group acc / (acc + gap) = 40% busy; the limit is min(1, N x 40%). On a 2-core
machine at most one phase body burns CPU at a time (a body runs only while its job holds the group), so
N = 4 does not oversubscribe the cores with phase bodies.

The orchestrator is started in this process like `openrl-lab serve` starts it: a SQLite store and each
call's API key looked up in a control-plane key table (`--store memory --auth none` to leave both out).

Every job records, on its own clock (`time.monotonic`, system-wide on Linux, so comparable across the
processes): when it called the phase, when the body started, when the body ended, when the call returned.
Reported over the window after a 2 s warm-up:

* duty: busy / wall of the group from the orchestrator's timeline, and from the jobs' own body times;
* hand-off: body end of one holder -> body start of the next holder, for every next holder that was
  already waiting when the body ended (a contended hand-off: nothing but orchestration in between);
* acquire (free): call -> body start when the group was free at the call (no hand-off involved);
* release: body end -> the decorated call returning (the release round trip, as the job sees it);
* cycle overhead: a job's mean period minus acc + gap (what N = 2's duty loses per job and cycle).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP = "trainer-group"
WARMUP_S = 2.0
KEY = "handoff-bench-key"


def job_main(args) -> None:
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient

    kw = {"lane": False} if args.grpc_only else {}
    client = TimeSliceOrchestratorClient(args.target, api_key=KEY, job=f"job-{args.job}", **kw)
    acc, gap = args.acc_ms / 1000, args.gap_ms / 1000

    @client.on_accelerators(group_id=GROUP, kind="handoff")
    def phase():
        t0 = time.monotonic()
        end = t0 + acc
        x = 0
        while True:  # CPU-bound, as a phase that drives a device from Python would be, not a sleep
            x += 1
            if not x & 63 and time.monotonic() >= end:
                break
        return t0, time.monotonic()

    phase()  # warm-up: the lease, the channel, the session (before the window)
    rows = []
    while time.monotonic() < args.start_at:
        time.sleep(0.002)
    time.sleep(random.Random(args.job).uniform(0, acc + gap))  # start off-phase with one another
    stop = args.start_at + args.duration
    while time.monotonic() < stop:
        called = time.monotonic()
        start, end = phase()
        rows.append((called, start, end, time.monotonic()))
        time.sleep(gap)
    client.close()
    print(json.dumps(rows), flush=True)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_n(n: int, args, target: str, server) -> dict:
    start_at = time.monotonic() + 2.0 + 0.4 * n  # time for the job processes to import and connect
    wall_off = time.time() - time.monotonic()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--as-job",
                str(i),
                "--target",
                target,
                "--start-at",
                repr(start_at),
                "--duration",
                str(args.duration),
                "--acc-ms",
                str(args.acc_ms),
                "--gap-ms",
                str(args.gap_ms),
            ]
            + (["--grpc-only"] if args.grpc_only else []),
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for i in range(n)
    ]
    outs = [json.loads(p.communicate(timeout=args.duration + 60)[0].strip().splitlines()[-1]) for p in procs]
    lo, hi = start_at + WARMUP_S, start_at + args.duration
    phases = sorted((row[1], row[2], row[0], row[3], j) for j, rows in enumerate(outs) for row in rows)
    busy = sum(max(0.0, min(end, hi) - max(start, lo)) for start, end, *_ in phases)
    handoffs, free_acquires, releases = [], [], []
    for prev, nxt in itertools.pairwise(phases):
        start, _end, called, _ret, job = nxt
        if not lo <= start <= hi:
            continue
        if job != prev[4] and called < prev[1]:  # it waited while the previous body ran
            handoffs.append(start - prev[1])
        elif called > prev[3]:  # the previous holder had released before this call
            free_acquires.append(start - called)
    releases = [ret - end for start, end, called, ret, job in phases if lo <= start <= hi]
    periods = []
    for rows in outs:
        kept = [r for r in rows if lo <= r[1] <= hi]
        if len(kept) > 1:
            periods.append((kept[-1][1] - kept[0][1]) / (len(kept) - 1))
    d = server.scheduler.duty_cycle(GROUP, since=lo + wall_off, until=hi + wall_off)
    ms = lambda xs, q: 1000 * pct(xs, q)  # noqa: E731
    return {
        "n": n,
        "limit": min(1.0, n * args.acc_ms / (args.acc_ms + args.gap_ms)),
        "duty_orchestrator": d.duty_cycle,
        "duty_jobs": busy / (hi - lo),
        "slices": d.slices,
        "handoffs": len(handoffs),
        "handoff_p50_ms": ms(handoffs, 0.5),
        "handoff_p90_ms": ms(handoffs, 0.9),
        "acquire_free_p50_ms": ms(free_acquires, 0.5),
        "acquire_free_n": len(free_acquires),
        "release_p50_ms": ms(releases, 0.5),
        "release_p90_ms": ms(releases, 0.9),
        "cycle_overhead_ms": 1000 * statistics.mean(periods) - args.acc_ms - args.gap_ms if periods else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="1,2,4")
    p.add_argument("--duration", type=float, default=12.0, help="seconds per N (the first 2 s are warm-up)")
    p.add_argument("--acc-ms", type=float, default=40.0)
    p.add_argument("--gap-ms", type=float, default=60.0)
    p.add_argument("--store", choices=("sqlite", "memory"), default="sqlite")
    p.add_argument("--auth", choices=("keys", "none"), default="keys")
    p.add_argument("--repeat", type=int, default=1, help="run the whole set this many times")
    p.add_argument(
        "--grpc-only",
        action="store_true",
        help="clients keep Acquire and Release on gRPC (lane=False), as before the hand-off lane",
    )
    p.add_argument("--as-job", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--target", default=None, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_job is not None:
        args.job = args.as_job
        return job_main(args)

    from openrl_lab.orchestrator import serve_orchestrator

    tmp = tempfile.TemporaryDirectory(prefix="handoff-")
    authenticate = None
    if args.auth == "keys":  # as `openrl-lab serve` does: every call's key looked up in the control plane's table
        from openrl_lab.identity import KeyStore

        keys = KeyStore(Path(tmp.name) / "state.db")
        keys.add_key("bench", "bench", KEY)
        authenticate = keys.user_for_key
    server = serve_orchestrator(
        Path(tmp.name) / "orchestrator.db" if args.store == "sqlite" else None,
        port=0,
        authenticate=authenticate,
        config={"groups": [{"id": "default", "devices": ["placeholder:0"], "aliases": [GROUP]}]},
    )
    print(
        f"CPU-bound phases of {args.acc_ms:g} ms, {args.gap_ms:g} ms between them, {args.duration:g} s per run "
        f"({WARMUP_S:g} s warm-up), store {args.store}, auth {args.auth}, gRPC on {server.target}"
        f"{' (clients: gRPC only)' if args.grpc_only else ''}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'N':>2}{'limit':>7}{'duty':>8}{'jobs':>8}{'slices':>7}{'hand-offs':>10}{'p50':>8}{'p90':>8}"
        f"{'acq free':>10}{'release':>9}{'cycle +':>9}"
    )
    results = []
    try:
        for _ in range(args.repeat):
            for n in [int(x) for x in args.jobs.split(",")]:
                r = run_n(n, args, server.target, server)
                results.append(r)
                co = r["cycle_overhead_ms"]
                print(
                    f"{n:>2}{r['limit']:>7.0%}{r['duty_orchestrator']:>8.1%}{r['duty_jobs']:>8.1%}{r['slices']:>7}"
                    f"{r['handoffs']:>10}{r['handoff_p50_ms']:>6.2f}ms{r['handoff_p90_ms']:>6.2f}ms"
                    f"{r['acquire_free_p50_ms']:>8.2f}ms{r['release_p50_ms']:>7.2f}ms"
                    f"{co if co is not None else float('nan'):>7.2f}ms",
                    flush=True,
                )
    finally:
        server.stop(0).wait(5)
        tmp.cleanup()
    print(
        "(duty: orchestrator's timeline; jobs: their own body times. p50/p90: contended hand-off, body end -> "
        "next body start. acq free: call -> body start on a free group. release: body end -> call returns. "
        "cycle +: a job's mean period - acc - gap.)"
    )
    print(
        json.dumps(
            {
                "benchmark": "handoff",
                "acc_ms": args.acc_ms,
                "gap_ms": args.gap_ms,
                "store": args.store,
                "auth": args.auth,
                "grpc_only": args.grpc_only,
                "load_average": os.getloadavg()[0],
                "results": results,
            }
        )
    )
    return None


if __name__ == "__main__":
    main()
