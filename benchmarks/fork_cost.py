"""What a fork costs: `Lab.fork` (the run's state copied on its kernel) against the checkpoint round trip a
researcher would do without it (`save_state` + `create_training_client_from_state_with_optimizer`).

    .venv/bin/python benchmarks/fork_cost.py [--trials 5] [--model openrl-lab/tiny-llama-1m] [--rank 16 | --full]

A real lab (`LabServer`: gateway, kernel, orchestrator on loopback), one LoRA run stepped once (so AdamW has
state to copy). Each trial makes one fork and one checkpoint copy (in a session of its own), interleaved,
and frees both before the next (a copy left on the kernel would be evicted by the next phase of the run,
and that would be timed); the figures are medians (wall seconds, client side) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--model", default="openrl-lab/tiny-llama-1m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--full", action="store_true", help="a full fine-tuning run instead of LoRA")
    args = ap.parse_args()
    import tinker
    from tqdm import tqdm

    from openrl_lab.lab import Lab
    from openrl_lab.server import LabServer

    with tempfile.TemporaryDirectory(prefix="openrl-fork-cost-") as tmp, LabServer(Path(tmp) / "home") as server:
        lab = Lab.connect(server.base_url, api_key=server.api_key)
        run = lab.lease("fork-cost", model=args.model, **({"full": True} if args.full else {"rank": args.rank}))
        ids = run.tokenizer().encode("the quick brown fox jumps over the lazy dog", add_special_tokens=False)
        datum = tinker.Datum(
            model_input=tinker.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
        )
        run.training.forward_backward([datum], "cross_entropy").result()
        run.training.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
        fork_s, copy_s = [], []
        for i in tqdm(range(args.trials), desc="trials", unit="trial"):
            t0 = time.perf_counter()
            (fork,) = lab.fork(run, [f"fork-{i}"])
            fork_s.append(time.perf_counter() - t0)
            lab.release(fork.name)
            # its own session, closed after: its run is freed, so no copy is left on the kernel to be evicted
            service = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key)
            t0 = time.perf_counter()
            path = run.training.save_state(f"copy-{i}").result().path
            service.create_training_client_from_state_with_optimizer(path).result()
            copy_s.append(time.perf_counter() - t0)
            service.close("success").result()
        lab.release(run.name)
        lab.close()
    f, c = statistics.median(fork_s), statistics.median(copy_s)
    what = "full fine-tuning" if args.full else f"LoRA rank {args.rank}"
    print(f"{args.model} {what}, {args.trials} trials (medians)")
    print(f"  Lab.fork (copied on the kernel):              {f * 1000:8.1f} ms")
    print(f"  save_state + load with optimizer (round trip): {c * 1000:8.1f} ms")
    print(f"  fork / round trip: {f / c:.2f}x the time ({c / f:.1f}x faster)")


if __name__ == "__main__":
    main()
