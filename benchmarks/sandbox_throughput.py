"""What the warm pool buys: executions per second of a trivial Python program through `SandboxPool` at pool
sizes 1, 2, 4, against a plain `subprocess.run([sys.executable, "-c", ...])` (no isolation at all), and the
median latency of one execution warm (a sandbox already started) vs cold (bubblewrap and the interpreter
started for it), in one run.

    .venv/bin/python benchmarks/sandbox_throughput.py [--runs 60] [--latency-trials 15]

Throughput: `runs` programs submitted at once (the pool runs `size` at a time and refills in the background);
the ratio column is against the plain subprocess, run one after another. Latency: one program at a time, with
the pool given time to refill between (warm), or a fresh `Sandbox` started for each (cold).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CODE = "print(sum(range(100)))"


def plain(runs: int) -> float:
    t0 = time.perf_counter()
    for _ in range(runs):
        subprocess.run([sys.executable, "-c", CODE], check=True, capture_output=True)
    return runs / (time.perf_counter() - t0)


async def pooled(size: int, runs: int) -> float:
    from openrl_lab.sandbox.pool import SandboxPool

    pool = SandboxPool(size=size)
    await pool.start()
    while pool.stats()["warm"] < size:  # start from a warm pool, as a service that has been up a while
        await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(pool.run(CODE) for _ in range(runs)))
    rate = runs / (time.perf_counter() - t0)
    await pool.aclose()
    assert all(r.stdout == "4950\n" for r in results), [r for r in results if r.stdout != "4950\n"][:1]
    return rate


async def latency(trials: int) -> tuple[float, float]:
    from openrl_lab.sandbox.isolation import Sandbox
    from openrl_lab.sandbox.pool import SandboxPool

    pool = SandboxPool(size=1)
    await pool.start()
    warm = []
    for _ in range(trials):
        while pool.stats()["warm"] < 1:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        await pool.run(CODE)
        warm.append(time.perf_counter() - t0)
    await pool.aclose()
    cold = []
    for _ in range(trials):
        t0 = time.perf_counter()
        sb = Sandbox()
        await sb.start()
        await sb.run(CODE)
        cold.append(time.perf_counter() - t0)
    return statistics.median(warm), statistics.median(cold)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--latency-trials", type=int, default=15)
    args = ap.parse_args()
    from openrl_lab.sandbox.isolation import check_host

    print(check_host())
    base = plain(args.runs)
    rows = [("plain subprocess.run (no isolation)", base)]
    for size in (1, 2, 4):
        rows.append((f"SandboxPool(size={size})", asyncio.run(pooled(size, args.runs))))
    warm, cold = asyncio.run(latency(args.latency_trials))
    print(f"\n{args.runs} executions of {CODE!r} each")
    print(f"  {'':40s} {'exec/s':>8s} {'vs plain':>9s}")
    for name, rate in rows:
        print(f"  {name:40s} {rate:8.1f} {rate / base:8.2f}x")
    print(f"\nlatency of one execution (median of {args.latency_trials}):")
    print(f"  warm (from the pool)      {warm * 1000:7.1f} ms")
    print(f"  cold (sandbox started)    {cold * 1000:7.1f} ms   warm is {cold / warm:.1f}x faster")


if __name__ == "__main__":
    main()
