"""Steps/s of a job sharded over 2 ranks (FSDP2, gloo on the CPU; train/distributed.py) against the same job on one
device: forward_backward(cross_entropy) + optim_step on a fixed batch, after warm-up steps.

    .venv/bin/python benchmarks/gang_steps.py [--model openrl-lab/tiny-llama-10m] [--steps 20] [--full]

The one-device job runs with 1 torch thread (what each rank has) and with 2 (the cores both ranks use together).
On a 2-core machine two ranks cannot beat one device: the point is what sharding costs here (gloo all-gathers and
reduce-scatters on every layer, twice the Python work), not a speed-up. Prints a summary table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

BATCH, LENGTH = 8, 64


def _data(vocab: int):
    from openrl_lab.train.trainer import Datum

    rng = np.random.default_rng(0)
    out = []
    for _ in range(BATCH):
        t = rng.integers(3, vocab, size=LENGTH + 1).astype(np.int64)
        out.append(Datum(tokens=t[:-1], inputs={"target_tokens": t[1:]}))
    return out


def _timed(job, steps: int, warmup: int = 3) -> float:
    from openrl_lab.train.hparams import AdamSettings

    data = _data(job.host.card.vocab_size)
    for _ in range(warmup):
        job.forward_backward(data, "cross_entropy")
        job.optim_step(AdamSettings())
    t0 = time.perf_counter()
    for _ in range(steps):
        job.forward_backward(data, "cross_entropy")
        job.optim_step(AdamSettings())
    return steps / (time.perf_counter() - t0)


def _rank(rank: int, port: int, model_dir: str, full: bool, steps: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from openrl_lab.train.distributed import ShardedJob, init_gang
    from openrl_lab.train.hparams import LoraSettings

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    init_gang(store, rank, 2, "cpu")
    job = ShardedJob(model_dir, "bench", None if full else LoraSettings(rank=16), seed=0)
    rate = _timed(job, steps)
    queue.put(rate)
    dist.destroy_process_group()


def _single(model_dir: str, full: bool, steps: int, threads: int) -> float:
    import torch

    from openrl_lab.train.hparams import LoraSettings
    from openrl_lab.train.trainer import BaseModelHost

    torch.set_num_threads(threads)
    job = BaseModelHost(model_dir).create_job("bench", None if full else LoraSettings(rank=16), seed=0)
    return _timed(job, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="openrl-lab/tiny-llama-10m")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--full", action="store_true", help="full fine-tuning (default: LoRA rank 16)")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from openrl_lab.train.models import resolve_model_dir

    model_dir = str(resolve_model_dir(args.model))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, model_dir, args.full, args.steps, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    gang = min(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    one_1 = _single(model_dir, args.full, args.steps, 1)
    one_2 = _single(model_dir, args.full, args.steps, 2)
    kind = "full fine-tuning" if args.full else "LoRA rank 16"
    print(f"{args.model}, {kind}, batch {BATCH} x {LENGTH} tokens, {args.steps} steps, {os.cpu_count()} cores")
    print(f"{'run':<28}{'steps/s':>10}{'vs 1 device (1 thread)':>26}")
    for name, rate in (("1 device, 1 thread", one_1), ("1 device, 2 threads", one_2), ("2 ranks x 1 thread", gang)):
        print(f"{name:<28}{rate:>10.2f}{rate / one_1:>26.2f}")


if __name__ == "__main__":
    main()
