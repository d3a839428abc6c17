"""The CPU BLAS with and without the strict reproducible mode kernels run in (`MKL_CBWR=AUTO,STRICT`,
`openrl_lab/kernel/threads.py`): do rows agree bit for bit whatever the row and thread counts (what the sampler's
batching stands on, `sample/invariant.py`), and what does the mode cost per matrix product.

    .venv/bin/python benchmarks/blas_modes.py [--threads 2]

Each mode runs in a fresh process (MKL reads the mode at its first call). Prints, per mode, the row counts whose
rows differ from the same rows computed among 300, whether 1 and 2 threads agree, and ms per product (best of 3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SHAPES = [(896, 4864), (4864, 896), (1024, 4096), (64, 128)]  # (inputs, outputs) of a linear
TIMED = [(1, 896, 4864), (16, 896, 4864), (64, 896, 4864), (512, 896, 4864), (2048, 896, 896), (4864, 2048, 896)]

_PROBE = """
import json, sys, time
import torch
from torch.nn import functional
threads = int(sys.argv[1])
out = {"agree": {}, "ms": {}}
torch.manual_seed(0)
for k, n in SHAPES:
    w, x = torch.randn(n, k), torch.randn(300, k)
    torch.set_num_threads(1)
    one = functional.linear(x, w)
    torch.set_num_threads(threads)
    every = functional.linear(x, w)
    rows = (*range(1, 33), 48, 64, 96, 128, 129, 256)
    differ = [r for r in rows if not torch.equal(functional.linear(x[:r], w), every[:r])]
    out["agree"][f"{k}x{n}"] = {"rows_that_differ": differ, "threads_agree": torch.equal(one, every)}
for m, k, n in TIMED:
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    reps, best = max(3, int(2e9 / (2 * m * k * n))), float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, (time.perf_counter() - t) / reps)
    out["ms"][f"{m}x{k}x{n}"] = round(best * 1e3, 3)
print(json.dumps(out))
"""


def run(mode: str | None, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if mode:
        env["MKL_CBWR"] = mode
    code = f"SHAPES = {SHAPES!r}\nTIMED = {TIMED!r}\n" + _PROBE
    argv = [sys.executable, "-c", code, str(threads)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    results = {"default": run(None, args.threads), "AUTO,STRICT": run("AUTO,STRICT", args.threads)}
    for mode, r in results.items():
        print(f"MKL_CBWR={mode}, {args.threads} threads")
        for shape, a in r["agree"].items():
            differ = a["rows_that_differ"]
            rows = f"rows differ at {differ[0]}..{differ[-1]} ({len(differ)} counts)" if differ else "all rows agree"
            print(f"  {shape:>10}: {rows}; 1 and {args.threads} threads {'agree' if a['threads_agree'] else 'differ'}")
    print("ms per product (best of 3), default -> strict")
    for shape in results["default"]["ms"]:
        print(f"  {shape:>16}: {results['default']['ms'][shape]:8.3f} -> {results['AUTO,STRICT']['ms'][shape]:8.3f}")


if __name__ == "__main__":
    main()
