"""What a sandbox costs and what the warm pool buys: executions per second of two programs through `SandboxPool`
at pool sizes 1, 2, 4, against a plain `subprocess.run([sys.executable, ...])` (no isolation at all), and the
median latency of one execution warm (a sandbox already started) vs cold (bubblewrap and the interpreter
started for it), in one run. The programs: a trivial one (`print(sum(range(100)))`), and a small test-case
grader as an RL code reward runs one (a model's solution and 20 test cases as files; the grader imports the
solution and checks each case), the shape of tinker-cookbook's code_rl check.

    .venv/bin/python benchmarks/sandbox_throughput.py [--runs 60] [--latency-trials 15]

Throughput: `runs` programs submitted at once (the pool runs `size` at a time and refills in the background);
the ratio column is against the plain subprocess run one after another (the lab's interpreter, so its venv's
start-up too), with the plain subprocess 4 at a time beside it. Latency: one program at a time, with
the pool given time to refill between (warm), or a fresh `Sandbox` started for each (cold).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CODE = "print(sum(range(100)))"
SOLUTION = "def solve(a, b):\n    return sorted(a)[len(a) // 2] + b\n"
CASES = [{"args": [[(i * 7 + j) % 23 for j in range(9)], i], "want": sorted((i * 7 + j) % 23 for j in range(9))[4] + i}
         for i in range(20)]  # fmt: skip
GRADER = """import json
from solution import solve
cases = json.load(open("tests.json"))
passed = sum(solve(*c["args"]) == c["want"] for c in cases)
print(f"{passed}/{len(cases)}")
"""
# (code, files, expected stdout) of each workload
GRADER_FILES = {"solution.py": SOLUTION.encode(), "tests.json": json.dumps(CASES).encode()}
WORKLOADS = {"trivial program": (CODE, {}, "4950\n"), "test-case grader (20 cases)": (GRADER, GRADER_FILES, "20/20\n")}


def plain(runs: int, code: str, files: dict[str, bytes], at_once: int = 1) -> float:
    """`runs` plain subprocesses, `at_once` at a time, each in a fresh directory with its files (as a sandbox)."""

    def one(_: int) -> None:
        with tempfile.TemporaryDirectory() as d:
            for name, data in files.items():
                Path(d, name).write_bytes(data)
            Path(d, "main.py").write_text(code)
            subprocess.run([sys.executable, "main.py"], check=True, capture_output=True, cwd=d)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(at_once) as ex:
        list(ex.map(one, range(runs)))
    return runs / (time.perf_counter() - t0)


async def pooled(size: int, runs: int, code: str, files: dict[str, bytes], want: str) -> float:
    from openrl_lab.sandbox.pool import SandboxPool

    pool = SandboxPool(size=size)
    await pool.start()
    while pool.stats()["warm"] < size:  # start from a warm pool, as a service that has been up a while
        await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(pool.run(code, files=files) for _ in range(runs)))
    rate = runs / (time.perf_counter() - t0)
    await pool.aclose()
    assert all(r.stdout == want for r in results), [r for r in results if r.stdout != want][:1]
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
    for workload, (code, files, want) in WORKLOADS.items():
        base = plain(args.runs, code, files)
        rows = [("plain subprocess.run (no isolation)", base)]
        rows.append(("plain subprocess.run, 4 at once", plain(args.runs, code, files, at_once=4)))
        for size in (1, 2, 4):
            rows.append((f"SandboxPool(size={size})", asyncio.run(pooled(size, args.runs, code, files, want))))
        print(f"\n{workload}: {args.runs} executions")
        print(f"  {'':40s} {'exec/s':>8s} {'vs plain':>9s}")
        for name, rate in rows:
            print(f"  {name:40s} {rate:8.1f} {rate / base:8.2f}x")
    warm, cold = asyncio.run(latency(args.latency_trials))
    print(f"\nlatency of one execution (median of {args.latency_trials}):")
    print(f"  warm (from the pool)      {warm * 1000:7.1f} ms")
    print(f"  cold (sandbox started)    {cold * 1000:7.1f} ms   warm is {cold / warm:.1f}x faster")


if __name__ == "__main__":
    main()
