"""Where a supervised SDK step's CPU goes: CPU milliseconds per step in the client, the gateway and the kernel.

    .venv/bin/python benchmarks/api_cpu_split.py [--steps 100] [--depth 2] [--serve-args "--cpu-kernels 1"]

The small step of `api_overhead.py` (LoRA rank 16, forward_backward + optim_step on 4 x 24 tokens, each step's
results awaited) through the tinker SDK, `--steps` times; user + system CPU of each process (psutil) divided by
the steps, beside the wall time per step. On a machine with fewer cores than the three processes keep busy, the
sum exceeding the wall time says the step waits for cores, not for the API. `--depth`: OPENRL_LAB_PIPELINE_DEPTH;
`--serve-args`: more `openrl-lab serve` flags (e.g. pinning the kernel to a core of its own).
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import psutil
import tinker
from api_overhead import make_batch
from tinker import types

from openrl_lab.home import DEFAULT_MODEL
from openrl_lab.server import LabServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--serve-args", default="")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="openrl-cpu-"))
    env = {"OPENRL_LAB_PIPELINE_DEPTH": str(args.depth)}
    with LabServer(home, args=tuple(shlex.split(args.serve_args)), env=env) as lab:
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        trainer = service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=16, seed=0).result()
        batch, _ = make_batch(4, 24, trainer.get_tokenizer().vocab_size)
        adam = types.AdamParams(learning_rate=1e-3)
        me = psutil.Process()
        procs = {"client (tinker SDK)": me}
        for child in me.children(recursive=True):
            role = "kernel" if "openrl_lab.kernel" in " ".join(child.cmdline()) else "gateway + orchestrator"
            procs[role] = child

        def cpu() -> dict[str, float]:
            return {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}

        def step() -> None:
            fb, opt = trainer.forward_backward(batch, "cross_entropy"), trainer.optim_step(adam)
            fb.result(), opt.result()

        for _ in range(5):
            step()  # warm-up
        before, t0 = cpu(), time.perf_counter()
        for _ in range(args.steps):
            step()
        wall, after = (time.perf_counter() - t0) / args.steps * 1e3, cpu()
        service.close("success").result()
    print(f"{os.cpu_count()} cores; depth {args.depth}; serve {args.serve_args or '(no flags)'}")
    print(f"wall: {wall:.1f} ms per step")
    for name in procs:
        print(f"{name}: {(after[name] - before[name]) / args.steps * 1e3:.1f} ms CPU per step")


if __name__ == "__main__":
    main()
