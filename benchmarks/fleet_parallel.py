"""Two independent jobs on two single-core CPU kernels vs both on one kernel: aggregate steps/s.

    .venv/bin/python benchmarks/fleet_parallel.py [--steps 20] [--rounds 2] [--batch 8] [--length 48]

One control plane with `--cpu-kernels 2` (two groups, `cpu0` and `cpu1`, each kernel pinned to its own core),
two users, each running supervised steps (forward_backward + optim_step) through the real tinker SDK at the
same time. Layouts, alternated in rounds on the same server (the machine is shared and noisy):

* `split`: the jobs on different kernels (groups), which run truly in parallel;
* `shared`: both jobs on kernel `cpu0`, time-sliced phase by phase (lazy yield, swapping each job's state).

A second server with one kernel on every core (`serve` without --cpu-kernels) runs the `shared` layout too:
`one kernel, all cores`, what a user without the flag gets. Figure: aggregate steps/s = 2 x steps / wall time,
and the ratio split / shared (goal >= 1.7 on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tqdm import tqdm  # noqa: E402

from openrl_lab.home import DEFAULT_MODEL  # noqa: E402
from openrl_lab.server import LabServer  # noqa: E402


def batch(n: int = 8, length: int = 48, seed: int = 0) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, 250, size=length + 1).tolist() for _ in range(n)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * length},
        )
        for r in rows
    ]


def trainer(lab: LabServer, key: str, group: str | None):
    service = tinker.ServiceClient(base_url=lab.base_url, api_key=key)
    md = {"openrl_group": group} if group else None
    return service, service.create_lora_training_client(
        base_model=DEFAULT_MODEL, rank=8, seed=0, user_metadata=md
    ).result()


def run_pair(trainers, steps: int, size: tuple[int, int]) -> float:
    """Both jobs step concurrently; aggregate steps/s."""
    data = batch(*size)
    for t in trainers:  # warm: base model loaded, state resident
        t.forward_backward(data, "cross_entropy").result()
        t.optim_step(types.AdamParams(learning_rate=1e-4)).result()

    def loop(t):
        for _ in range(steps):
            t.forward_backward(data, "cross_entropy").result()
            t.optim_step(types.AdamParams(learning_rate=1e-4)).result()

    threads = [threading.Thread(target=loop, args=(t,)) for t in trainers]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return 2 * steps / (time.perf_counter() - start)


def new_key(home: Path, user: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "openrl_lab.cli", "keys", "create", user, "--home", str(home)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--length", type=int, default=48, help="tokens per sequence")
    args = p.parse_args()
    results: dict[str, list[float]] = {"split": [], "shared": [], "one kernel, all cores": []}
    with tempfile.TemporaryDirectory() as tmp:
        two = LabServer(Path(tmp) / "two", args=("--cpu-kernels", "2")).start()
        one = LabServer(Path(tmp) / "one").start()
        try:
            keys2 = [two.api_key, new_key(two.home, "bob")]
            keys1 = [one.api_key, new_key(one.home, "bob")]
            layouts = {
                "split": (two, keys2, ("cpu0", "cpu1")),
                "shared": (two, keys2, ("cpu0", "cpu0")),
                "one kernel, all cores": (one, keys1, (None, None)),
            }
            for _ in tqdm(range(args.rounds), desc="rounds"):
                for name, (lab, keys, groups) in layouts.items():
                    pairs = [trainer(lab, k, g) for k, g in zip(keys, groups)]
                    results[name].append(run_pair([t for _, t in pairs], args.steps, (args.batch, args.length)))
                    for service, _ in pairs:
                        service.close("success").result()
        finally:
            two.stop()
            one.stop()
    med = {k: float(np.median(v)) for k, v in results.items()}
    print(
        f"cpus: {len(os.sched_getaffinity(0))}, steps per job: {args.steps}, rounds: {args.rounds}, "
        f"batch {args.batch} x {args.length} tokens"
    )
    print(f"{'layout':<24} {'aggregate steps/s':>18}")
    for k, v in med.items():
        print(f"{k:<24} {v:>18.2f}")
    print(f"split / shared (same single-core kernels): {med['split'] / med['shared']:.2f}x")
    print(f"split / one kernel on all cores:          {med['split'] / med['one kernel, all cores']:.2f}x")
    print(
        json.dumps(
            {
                "median_steps_per_s": med,
                "ratio_split_shared": med["split"] / med["shared"],
                "ratio_split_one_kernel": med["split"] / med["one kernel, all cores"],
            }
        )
    )


if __name__ == "__main__":
    main()
