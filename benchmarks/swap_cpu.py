"""Swap efficiency on a CPU "device": evict/restore against a plain copy of the same bytes, same run.

    .venv/bin/python benchmarks/swap_cpu.py [--rounds 30] [--threads 1] [--home DIR]

efficiency = bytes moved / (time x bandwidth of a plain copy of the same bytes), i.e. plain copy time / swap
time, measured in alternating rounds (plain, evict, plain, restore, ...) and reported as the median of the
per-round ratios, because the machine is shared and noisy. Cases:
  (a) a LoRA tenant of the built-in tiny-llama-10m: rank 16 on every linear layer, AdamW state after one step;
  (b) ~200 MB of fp32 tensors shaped like a small Llama (embeddings, 3 layers, head);
  and the tenant-switch time (evict A + restore B) for two LoRA tenants sharing the resident base.
Each case runs packed (one buffer per set, the default) and per-tensor.

On a CPU the "device" memory an eviction frees goes back to the C library, which returns big blocks to the
OS; a restore then gets fresh pages, and the OS zero-fills them on first touch. A GPU has no such cost: the
CUDA caching allocator keeps freed blocks. So the script runs every case twice, in child processes: with the
default glibc malloc, and with glibc told to keep freed memory (GLIBC_TUNABLES, the CPU counterpart of the
caching allocator). `restore vs alloc` compares the restore with allocating fresh memory and copying into it.

Copies run single-threaded by default (--threads 1): on two shared cores a multi-threaded copy waits for a
busy core and varies tenfold from run to run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

CONFIGS = {
    "glibc default": {},
    "glibc keeps freed memory": {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"},
}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _measure(ss, rounds: int) -> dict:
    """Alternate plain copies and swaps of the same bytes; medians of times and of per-round ratios."""
    import torch

    for _ in range(3):  # warm: arena allocated, state packed (packed mode), caches hot
        ss.evict()
        ss.restore()
    n = ss.nbytes
    device_buf = torch.ones(n, dtype=torch.uint8)
    host_buf = torch.ones(n, dtype=torch.uint8)
    rows = {k: [] for k in ("plain_out", "evict", "plain_in", "restore", "alloc_in")}
    copies = {}
    for _ in range(rounds):
        rows["plain_out"].append(_timed(lambda: host_buf.copy_(device_buf)))
        t0 = time.perf_counter()
        e = ss.evict()
        rows["evict"].append(time.perf_counter() - t0)
        rows["plain_in"].append(_timed(lambda: device_buf.copy_(host_buf)))
        t0 = time.perf_counter()
        r = ss.restore()
        rows["restore"].append(time.perf_counter() - t0)
        rows["alloc_in"].append(_timed(lambda: torch.empty(n, dtype=torch.uint8).copy_(host_buf)))
        copies = {"evict": e.copies, "restore": r.copies, "tensors": e.tensors}
    med = statistics.median
    return {
        "bytes": n,
        **copies,
        "plain_gbps": n / med(rows["plain_out"] + rows["plain_in"]) / 1e9,
        "evict_ms": med(rows["evict"]) * 1e3,
        "restore_ms": med(rows["restore"]) * 1e3,
        "evict_eff": med(p / s for p, s in zip(rows["plain_out"], rows["evict"])),
        "restore_eff": med(p / s for p, s in zip(rows["plain_in"], rows["restore"])),
        "restore_vs_alloc": med(p / s for p, s in zip(rows["alloc_in"], rows["restore"])),
    }


def _lora_host(model_dir: Path):
    import numpy as np

    from openrl_lab.train.trainer import AdamSettings, BaseModelHost, Datum, LoraSettings

    host = BaseModelHost(model_dir)
    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 300, size=33) for _ in range(4)]
    data = [Datum(tokens=r[:-1], inputs={"target_tokens": r[1:]}) for r in rows]
    jobs = []
    for i, name in enumerate(("a", "b")):
        job = host.create_job(name, LoraSettings(rank=16, seed=i))  # attn + mlp + lm_head: every linear layer
        job.forward_backward(data, "cross_entropy")
        job.optim_step(AdamSettings())  # AdamW state exists; grads are gone (set to None), as between steps
        jobs.append(job)
    return host, jobs


def _lora_set(host, job, packed: bool):
    from openrl_lab.swap import SwapSet

    ss = SwapSet(f"{job.job_id}-{'packed' if packed else 'per-tensor'}", "cpu", packed=packed)
    ss.add_module(host.peft, lambda n, a=job.adapter: ".lora_" in n and f".{a}." in n)
    ss.add_optimizer(lambda: job.optimizer)
    return ss


def _synthetic(hidden=1024, inter=2816, layers=3, vocab=6144):
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(0)
    shapes = {"embed_tokens": (vocab, hidden), "norm": (hidden,), "lm_head": (vocab, hidden)}
    for i in range(layers):
        for k in ("q", "k", "v", "o"):
            shapes[f"layers.{i}.{k}_proj"] = (hidden, hidden)
        shapes[f"layers.{i}.gate_proj"] = (inter, hidden)
        shapes[f"layers.{i}.up_proj"] = (inter, hidden)
        shapes[f"layers.{i}.down_proj"] = (hidden, inter)
        shapes[f"layers.{i}.input_norm"] = (hidden,)
        shapes[f"layers.{i}.post_norm"] = (hidden,)
    module = nn.Module()
    module.weights = nn.ParameterDict(
        {k.replace(".", "_"): nn.Parameter(torch.randn(s, generator=g)) for k, s in shapes.items()}
    )
    return module


def child(model_dir: Path, rounds: int, threads: int) -> dict:
    import torch

    from openrl_lab.swap import SwapSet, switch

    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    out = {"cases": []}
    host, jobs = _lora_host(model_dir)
    for packed in (True, False):
        ss = _lora_set(host, jobs[0], packed)
        out["cases"].append(
            {
                "case": "(a) LoRA tenant, tiny-llama-10m r16",
                "mode": "packed" if packed else "per-tensor",
                **_measure(ss, rounds),
            }
        )
        ss.close()
    synthetic = _synthetic()
    for packed in (True, False):
        ss = SwapSet("synthetic", "cpu", packed=packed)
        ss.add_module(synthetic)
        out["cases"].append(
            {
                "case": "(b) model-shaped fp32 set",
                "mode": "packed" if packed else "per-tensor",
                **_measure(ss, max(5, rounds // 3)),
            }
        )
        ss.close()
    # (c) tenant switch: A and B share the resident base; one is on the device at a time.
    out["switch"] = []
    for packed in (True, False):
        a, b = (_lora_set(host, j, packed) for j in jobs)
        b.evict()
        for _ in range(3):
            switch(a, b)
            switch(b, a)
        times = []
        for _ in range(rounds * 2):
            times.append(_timed(lambda a=a, b=b: switch(a, b)))
            a, b = b, a
        n = a.nbytes
        src, dst = torch.ones(n, dtype=torch.uint8), torch.ones(n, dtype=torch.uint8)
        plain = statistics.median(_timed(lambda s=src, d=dst: d.copy_(s)) for _ in range(rounds))
        times.sort()
        out["switch"].append(
            {
                "mode": "packed" if packed else "per-tensor",
                "bytes_each_way": n,
                "p50_ms": times[len(times) // 2] * 1e3,
                "p90_ms": times[int(len(times) * 0.9)] * 1e3,
                "two_plain_copies_ms": 2 * plain * 1e3,
            }
        )
        b.restore()
        a.close()
        b.close()
    return out


def table(results: dict) -> str:
    lines = [
        (
            "| malloc | case | mode | MB | tensors | copies out/in | plain copy GB/s | evict ms | evict eff "
            "| restore ms | restore eff | restore vs alloc |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, res in results.items():
        for c in res["cases"]:
            lines.append(
                f"| {config} | {c['case']} | {c['mode']} | {c['bytes'] / 1e6:.1f} | {c['tensors']} | "
                f"{c['evict']}/{c['restore']} | {c['plain_gbps']:.1f} | {c['evict_ms']:.2f} | "
                f"{c['evict_eff']:.2f} | {c['restore_ms']:.2f} | {c['restore_eff']:.2f} | "
                f"{c['restore_vs_alloc']:.2f} |"
            )
    lines += [
        "",
        (
            "| malloc | tenant switch (evict A + restore B), tiny-llama-10m r16 | MB each way | p50 ms | "
            "p90 ms | two plain copies ms |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for config, res in results.items():
        for s in res["switch"]:
            lines.append(
                f"| {config} | {s['mode']} | {s['bytes_each_way'] / 1e6:.1f} | {s['p50_ms']:.2f} | "
                f"{s['p90_ms']:.2f} | {s['two_plain_copies_ms']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for every copy (default 1)")
    parser.add_argument("--home", type=Path, help="where the built-in model is built (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds, args.threads)))
        return

    from openrl_lab.train.models import resolve_model_dir

    home = args.home or Path(tempfile.mkdtemp(prefix="openrl-bench-"))
    os.environ.setdefault("HF_HOME", str(home / "hf"))
    model_dir = resolve_model_dir("openrl-lab/tiny-llama-10m", home)
    results = {}
    for config, env in CONFIGS.items():
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                str(model_dir),
                "--rounds",
                str(args.rounds),
                "--threads",
                str(args.threads),
            ],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        results[config] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"torch threads {args.threads}, {args.rounds} rounds, CPU count {os.cpu_count()}\n")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
