"""Duty cycle of one shared group with N = 1..4 jobs, through the real gRPC orchestrator on loopback.

    .venv/bin/python benchmarks/duty_cycle.py [--jobs 1,2,3,4] [--duration 12] [--swap-ms 7.3]
                                              [--acc-s 0.4] [--cpu-s 0.6] [--sweep]

Each job is its own process with its own `TimeSliceOrchestratorClient`, looping like an RL loop:

* a CPU-side phase (reward / environment): `time.sleep(cpu_s)` — nothing touches the group;
* an accelerator phase, `with on_accelerators(group_id="trainer-group")`, whose body is a PLACEHOLDER:
  `time.sleep(acc_s)`. No device exists here; what is measured is the orchestration around it.

With acc_s = 0.4 and cpu_s = 0.6 (both +-10% jitter, seeded per job) a job alone keeps the group 40% busy.
Every job keeps state on the device between phases and registers evict / restore callbacks that are
also placeholders, `time.sleep(swap_ms)` each way; the default 7.3 ms is the measured per-direction copy
time of a 7B-shaped LoRA tenant (adapters + Adam moments, 381 MB, one contiguous pinned arena) on an
H200 (shared/reference/perf-anchors.md). So evictions happen only when another job waits (lazy yield),
exactly as they would with real state.

Duty cycle = busy time / wall time of the group, from the orchestrator's own timeline (busy = slice
time minus the holder's restore); switch overhead = eviction waits + restores, as a share of wall time.
Both are taken over the window after a 2 s warm-up, while all N jobs run; `restores` counts the slices
in that window that began by restoring state (each one follows an eviction of another job). The job-side column is the
sum of the placeholder phases' own sleeps / wall, a check that the orchestrator does not over-count.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP = "trainer-group"
WARMUP_S = 2.0


def job_main(args) -> None:
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient

    rng = random.Random(args.seed)
    client = TimeSliceOrchestratorClient(args.target, job=f"job-{args.job}")
    swap = args.swap_ms / 1000
    stats = {"phases": 0, "acc_busy_s": 0.0, "waits": [], "restored": 0, "evicted": 0}

    def evict():
        time.sleep(swap)  # placeholder: copy the job's state into its pinned host arena
        stats["evicted"] += 1

    def restore():
        time.sleep(swap)  # placeholder: copy it back
        stats["restored"] += 1

    client.register(GROUP, on_evict=evict, on_restore=restore)
    window = (args.start_at + WARMUP_S, args.start_at + args.duration)

    def accelerator_phase(seconds):
        with client.on_accelerators(group_id=GROUP, kind="train_step") as s:
            t0 = time.time()
            time.sleep(seconds)  # placeholder for device work
            t1 = time.time()
        stats["acc_busy_s"] += max(0.0, min(t1, window[1]) - max(t0, window[0]))
        stats["waits"].append(s.waited_s)

    while time.time() < args.start_at:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, args.cpu_s))  # start off-phase with one another, as independent notebooks would
    while time.time() < args.start_at + args.duration:
        time.sleep(args.cpu_s * rng.uniform(0.9, 1.1))  # placeholder: reward / environment on the CPU
        accelerator_phase(args.acc_s * rng.uniform(0.9, 1.1))
        stats["phases"] += 1
    client.close()
    print(json.dumps(stats), flush=True)


def run_n(n: int, args, target: str, server) -> dict:
    start_at = time.time() + 2.0 + 0.3 * n  # time for the job processes to import and connect
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
                "--acc-s",
                str(args.acc_s),
                "--cpu-s",
                str(args.cpu_s),
                "--swap-ms",
                str(args.swap_ms),
                "--seed",
                str(1000 * n + i),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for i in range(n)
    ]
    outs = [json.loads(p.communicate(timeout=args.duration + 60)[0].strip().splitlines()[-1]) for p in procs]
    since, until = start_at + WARMUP_S, start_at + args.duration
    d = server.scheduler.duty_cycle(GROUP, since=since, until=until)
    tl = server.scheduler.timeline(None, GROUP, since=since, limit=100000)
    recs = [r for r in tl.records if since <= r.granted_at <= until and r.outcome == "ok"]
    waits = sorted(w for o in outs for w in o["waits"])
    return {
        "n": n,
        "duty": d.duty_cycle,
        "switch_share": d.switch_share,
        "slices": d.slices,
        "job_side": sum(o["acc_busy_s"] for o in outs) / (until - since),
        "restores": sum(r.must_restore for r in recs),
        "wait_p50_ms": 1000 * waits[len(waits) // 2] if waits else 0.0,
        "phases": [o["phases"] for o in outs],
        "records": len(recs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="1,2,3,4")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per N (the first 2 s are warm-up)")
    p.add_argument("--acc-s", type=float, default=0.4)
    p.add_argument("--cpu-s", type=float, default=0.6)
    p.add_argument("--swap-ms", type=float, default=7.3)
    p.add_argument("--sweep", action="store_true", help="also swap costs of 0, 50 and 140 ms")
    p.add_argument("--as-job", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--target", default=None, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_job is not None:
        args.job = args.as_job
        return job_main(args)

    from openrl_lab.orchestrator import serve_orchestrator

    server = serve_orchestrator(
        None, port=0, config={"groups": [{"id": "default", "devices": ["placeholder:0"], "aliases": [GROUP]}]}
    )
    target = server.target
    swaps = [args.swap_ms] + ([0.0, 50.0, 140.0] if args.sweep else [])
    ns = [int(x) for x in args.jobs.split(",")]
    print(
        f"accelerator phase {args.acc_s:g} s, CPU phase {args.cpu_s:g} s (alone: "
        f"{args.acc_s / (args.acc_s + args.cpu_s):.0%} busy), {args.duration:g} s per run, gRPC on {target}"
    )
    print(
        f"{'swap ms':>8}{'N':>3}{'duty':>8}{'job-side':>10}{'switch':>8}{'slices':>8}{'restores':>9}"
        f"{'wait p50':>10}  goal"
    )
    goals = {2: 0.78, 4: 0.90}
    try:
        for swap in swaps:
            args.swap_ms = swap
            for n in ns:
                r = run_n(n, args, target, server)
                goal = goals.get(n)
                mark = "" if goal is None else f">= {goal:.0%} {'met' if r['duty'] >= goal else 'NOT met'}"
                print(
                    f"{swap:>8.1f}{n:>3}{r['duty']:>8.1%}{r['job_side']:>10.1%}{r['switch_share']:>8.1%}"
                    f"{r['slices']:>8}{r['restores']:>9}{r['wait_p50_ms']:>8.1f}ms  {mark}",
                    flush=True,
                )
    finally:
        server.stop(0)


if __name__ == "__main__":
    main()
