"""What a tenant switch and a control-plane restart cost *afterwards* (two regressions this guards against).

    .venv/bin/python benchmarks/switch_side_effects.py [--steps 20]

1. Step time after a swap: two LoRA jobs on one in-process kernel engine; the time of a training step
   (forward_backward + optim_step) before any swap and after evict/restore round trips, as a ratio in one
   run (1.0 = a swap leaves nothing behind). It was 2.5x when CPU swap copies ran as torch `copy_` on a
   side thread (each thread that runs a parallel op gets its own OpenMP team).
2. First phase after a restart: a run saved, the control plane stopped and started again on the same
   home, then create_training_client_from_state: its wall time and, from the orchestrator's timeline, the
   first slice's wait / switch / evict (they were ~7 s each when the new kernel waited for the dead one's
   residency to time out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import tinker

from openrl_lab.home import DEFAULT_MODEL
from openrl_lab.kernel.api import AdamSettings, LoraSettings
from openrl_lab.kernel.engine import Engine
from openrl_lab.orchestrator import TimeSliceOrchestratorClient
from openrl_lab.server import LabServer

ADAM = AdamSettings(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)


def step_after_swap(home: Path, steps: int) -> None:
    engine = Engine(home)
    for job in ("A", "B"):
        engine.create_job(job, DEFAULT_MODEL, LoraSettings(rank=16, seed=0))
    tokens = np.arange(1, 24, dtype=np.int64)
    data = [(tokens, {"target_tokens": tokens + 1, "weights": np.ones(23, np.float32)})] * 4

    def ms_per_step(job: str) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.forward_backward(job, data, "cross_entropy", None, True)
            engine.optim_step(job, ADAM)
        return (time.perf_counter() - t0) / steps * 1e3

    ms_per_step("A")  # warm-up
    before = statistics.median(ms_per_step("A") for _ in range(3))
    after = []
    for _ in range(3):
        for job in ("A", "B"):
            engine.evict_job(job)
            engine.restore_job(job)
        after.append(ms_per_step("A"))
    after_ms = statistics.median(after)
    print(
        f"step after swap: {before:.1f} ms before any swap, {after_ms:.1f} ms after evict/restore round trips "
        f"(ratio {after_ms / before:.2f}; 1.0 = nothing left behind)"
    )


def first_phase_after_restart(home: Path) -> None:
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(list(range(1, 12))),
        loss_fn_inputs={"target_tokens": list(range(2, 13)), "weights": [1.0] * 11},
    )
    with LabServer(home) as lab:
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        trainer = service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=8).result()
        trainer.forward_backward([datum], "cross_entropy").result()
        path = trainer.save_state("before-restart").result().path
    with LabServer(home) as lab:
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        t0 = time.perf_counter()
        service.create_training_client_from_state(path).result()
        wall = time.perf_counter() - t0
        since = time.time() - wall - 1
        timeline = TimeSliceOrchestratorClient(lab.grpc_target, api_key=lab.api_key).timeline("default", since=since)
        first = timeline.to_dataframe().sort_values("granted_at").iloc[0]
        print(
            f"first phase after a restart: create_training_client_from_state {wall:.2f} s; its first slice "
            f"({first['kind']}) waited {first['wait_s']:.2f} s, switch {first['switch_s']:.2f} s, "
            f"evict {first['evict_s']:.2f} s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        step_after_swap(Path(tmp) / "engine", args.steps)
        first_phase_after_restart(Path(tmp) / "lab")


if __name__ == "__main__":
    main()
