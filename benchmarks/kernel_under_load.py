"""A kernel beside a busy machine: training steps/s and sampling tokens/s through the lab, quiet vs with CPU hogs.

    .venv/bin/python benchmarks/kernel_under_load.py [--hogs N] [--steps 20] [--rounds 3]

Issue 27, item 3: the configuration a user gets without flags must slow down in proportion when other work
takes the cores, not collapse. Three labs side by side, each `openrl-lab serve` with no flags:
- *default*: what the lab ships (kernel torch threads `max(1, min(cores - 1, 2))`, OpenMP threads that sleep
  while they wait, kernel/__main__.py);
- *<cores> threads, sleeping waits*: one torch thread per core, OpenMP threads that sleep (OPENRL_KERNEL_THREADS);
- *before*: the default before issue 27 (one torch thread per core, OpenMP's own spinning waits:
  OPENRL_KERNEL_THREADS=<cores>, OMP_WAIT_POLICY=ACTIVE).
On each, rounds of: `--steps` supervised LoRA steps (forward_backward + optim_step, 4 x 24 tokens) through the
tinker SDK, and one RL step's sampling (8 concurrent requests x 8 samples x 16 tokens), once on a quiet machine
and once beside `--hogs` busy-looping processes (default: one per core). The figure is busy / quiet within each
lab (medians of rounds); a slowdown in proportion is about the CPU share left to the kernel's threads.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker
from tinker import types
from tqdm import tqdm

from openrl_lab.home import DEFAULT_MODEL
from openrl_lab.server import LabServer


def _spin() -> None:
    x = 0
    while True:
        x += 1


class Hogs:
    """`n` processes that each keep one core busy (plain Python loops: no threads, no I/O)."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_spin, daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5)  # running before the measurement starts
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.join()


def train_steps_per_s(trainer, steps: int) -> float:
    rows = [[3 + (7 * i + j) % 200 for j in range(25)] for i in range(4)]
    batch = [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * 24},
        )
        for r in rows
    ]
    adam = types.AdamParams(learning_rate=1e-4)
    t = time.perf_counter()
    for _ in range(steps):
        fb, opt = trainer.forward_backward(batch, "cross_entropy"), trainer.optim_step(adam)
        fb.result(), opt.result()
    return steps / (time.perf_counter() - t)


def sample_tokens_per_s(sampler, requests: int = 8, samples: int = 8, tokens: int = 16) -> float:
    t = time.perf_counter()
    futures = [
        sampler.sample(
            types.ModelInput.from_ints([5 + i, 17, 42, 9]),
            samples,
            types.SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, stop=[]),
        )
        for i in range(requests)
    ]
    for f in futures:
        f.result()
    return requests * samples * tokens / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = os.cpu_count() or 1
    ap.add_argument("--hogs", type=int, default=cores)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    configs = {
        "default (no flags)": {},
        f"{cores} threads, sleeping waits": {"OPENRL_KERNEL_THREADS": str(cores)},
        "before issue 27": {"OPENRL_KERNEL_THREADS": str(cores), "OMP_WAIT_POLICY": "ACTIVE"},
    }
    print(f"{cores} cores, {args.hogs} hog processes, load average {os.getloadavg()[0]:.2f} at the start")
    labs = [LabServer(Path(tempfile.mkdtemp(prefix="openrl-load-")), env=env) for env in configs.values()]
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in configs}
    try:
        clients = []
        for lab in labs:
            lab.start()
            service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
            trainer = service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=8, seed=0).result()
            sampler = trainer.save_weights_and_get_sampling_client().result()
            train_steps_per_s(trainer, 3), sample_tokens_per_s(sampler, 2)  # warm-up
            clients.append((service, trainer, sampler))
        for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
            for name, (_, trainer, sampler) in zip(configs, clients):
                for busy in (False, True):
                    with Hogs(args.hogs if busy else 0):
                        got = figures[name]
                        got.setdefault(f"train {busy}", []).append(train_steps_per_s(trainer, args.steps))
                        got.setdefault(f"sample {busy}", []).append(sample_tokens_per_s(sampler))
        for service, _, _ in clients:
            service.close("success").result()
    finally:
        for lab in labs:
            lab.stop()
    print(f"load average at the end: {os.getloadavg()[0]:.2f}\n")
    print(
        "| kernel configuration | train steps/s quiet | busy | busy / quiet"
        " | sample tokens/s quiet | busy | busy / quiet |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, got in figures.items():
        m = {k: statistics.median(v) for k, v in got.items()}
        print(
            f"| {name} | {m['train False']:.2f} | {m['train True']:.2f} | {m['train True'] / m['train False']:.2f} "
            f"| {m['sample False']:.0f} | {m['sample True']:.0f} | {m['sample True'] / m['sample False']:.2f} |"
        )


if __name__ == "__main__":
    main()
