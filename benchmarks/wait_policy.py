"""OpenMP's wait policy for a kernel's large passes: a GRPO-sized LoRA forward_backward on 2 threads, quiet and beside
CPU hogs, under each policy.

    .venv/bin/python benchmarks/wait_policy.py [--rounds 2] [--repeats 8] [--hogs <cores>]

A kernel starts with `OMP_WAIT_POLICY=PASSIVE` (kernel/__main__.py): OpenMP threads sleep while they wait, where by
default they spin for a while first. Each configuration runs in a fresh process (the policy is read once, when
OpenMP starts): the built-in model, a LoRA rank-32 job, 128 datums of 14-24 tokens (an `RLConfig()` step's
training batch), `importance_sampling`, torch on 2 threads as the kernel runs passes this size
(kernel/threads.py); the median of `--repeats` passes after one warm-up. Rounds alternate the configurations;
the figure is the median over rounds, quiet and beside `--hogs` busy-looping processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLICIES = {
    "passive (the kernel's)": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin 10k": {"GOMP_SPINCOUNT": "10000"},
    "OpenMP default (spin 300k)": {},
}


def child(repeats: int) -> float:
    import numpy as np
    import torch

    from openrl_lab.home import DEFAULT_MODEL
    from openrl_lab.train.hparams import LoraSettings
    from openrl_lab.train.models import resolve_model_dir
    from openrl_lab.train.trainer import BaseModelHost, Datum

    torch.set_num_threads(2)
    host = BaseModelHost(resolve_model_dir(DEFAULT_MODEL, Path(tempfile.mkdtemp(prefix="openrl-wait-"))))
    job = host.create_job("j", LoraSettings(rank=32, seed=0))
    rng = np.random.default_rng(0)
    data = []
    for i in range(128):
        prompt, completion = 12 + (i % 16) // 4, 1 + (i % 8)
        ids = rng.integers(0, host.card.vocab_size, prompt + completion + 1)
        mask = np.zeros(len(ids) - 1, np.float32)
        mask[prompt - 1 :] = 1
        data.append(Datum(ids[:-1], {"target_tokens": ids[1:], "logprobs": -mask, "advantages": mask * rng.normal()}))
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        job.forward_backward(data, "importance_sampling")
        job.optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def _spin() -> None:
    while True:
        pass


def run(env: dict[str, str], repeats: int, hogs: int) -> float:
    procs = [mp.Process(target=_spin, daemon=True) for _ in range(hogs)]
    for p in procs:
        p.start()
    try:
        clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(repeats)],
            env={**clean, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            p.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    from tqdm import tqdm

    got: dict[tuple[str, bool], list[float]] = {}
    for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
        for name, env in POLICIES.items():
            for busy in (False, True):
                got.setdefault((name, busy), []).append(run(env, args.repeats, args.hogs if busy else 0))
    print(f"\n{os.cpu_count()} cores, {args.hogs} hogs when busy; s per 128-datum forward_backward (median)\n")
    print("| wait policy | quiet | busy | busy / quiet |")
    print("|---|---|---|---|")
    for name in POLICIES:
        quiet, busy = (statistics.median(got[(name, b)]) for b in (False, True))
        print(f"| {name} | {quiet:.3f} | {busy:.3f} | {quiet / busy:.2f} |")


if __name__ == "__main__":
    main()
