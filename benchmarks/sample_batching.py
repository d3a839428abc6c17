"""Concurrent sample requests as one batch: an RL step's requests through the tinker SDK, at once vs one at a time.

    .venv/bin/python benchmarks/sample_batching.py [--requests 16] [--samples 8] [--tokens 16] [--rounds 5]
    .venv/bin/python benchmarks/sample_batching.py --samplers 16     # each request on its own checkpoint

Two labs on the built-in model, side by side: the default (the torch sampler batches concurrent requests) and
one with `OPENRL_KERNEL_SAMPLE_BATCH_TOKENS=1` (no request joins another's batch: each is its own phase, prefill
and decode loop, as before batching). On each, one sampler snapshot of a LoRA run gets `--requests` requests of
`--samples` x `--tokens` (seeded, stop=[] so every sequence is `--tokens` long), once all at once (the SDK's
futures, as an RL step sends them) and once one after another. Rounds alternate the labs and the order; the figure
is the ratio of medians within the run. Seeded results are checked to be the same tokens in every mode.

`--samplers N`: the requests go round-robin to N sampler snapshots of one user's LoRA run (a checkpoint after
each optimizer step, so every snapshot's weights differ), and the second lab is `OPENRL_KERNEL_SAMPLE_MIX=0`
(calls on different samplers never share a batch; calls on one sampler still do): what sixteen checkpoints of
one base model cost sampled at once, one batch through their adapters mixed vs one batch per snapshot.
"""

from __future__ import annotations

import argparse
import json
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


def prompts(n: int) -> list[types.ModelInput]:
    return [types.ModelInput.from_ints([5 + i % 50, 17, 42 + i % 7, 9, 11][: 3 + i % 3]) for i in range(n)]


def run(samplers: list, inputs, args, at_once: bool) -> tuple[float, list[list[list[int]]]]:
    """Request i on samplers[i % len(samplers)]."""
    params = [
        types.SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1000 + i, stop=[])
        for i in range(len(inputs))
    ]
    calls = [(samplers[i % len(samplers)], p, sp) for i, (p, sp) in enumerate(zip(inputs, params))]
    t = time.perf_counter()
    if at_once:
        futures = [sampler.sample(p, args.samples, sp) for sampler, p, sp in calls]
        results = [f.result() for f in futures]
    else:
        results = [sampler.sample(p, args.samples, sp).result() for sampler, p, sp in calls]
    return time.perf_counter() - t, [[s.tokens for s in r.sequences] for r in results]


def checkpoints(trainer, n: int) -> list:
    """n sampler snapshots of the run, one after each optimizer step (one snapshot: the untrained adapter)."""
    if n == 1:
        return [trainer.save_weights_and_get_sampling_client("bench").result()]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 17, 42, 9, 11, 23, 8]),
        loss_fn_inputs={"target_tokens": [17, 42, 9, 11, 23, 8, 31], "weights": [1.0] * 7},
    )
    out = []
    for k in range(n):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        out.append(trainer.save_weights_and_get_sampling_client(f"bench-{k}").result())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--samplers", type=int, default=1, help="spread the requests over this many checkpoints")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    inputs = prompts(args.requests)
    tokens = args.requests * args.samples * args.tokens
    if args.samplers > 1:
        labs = {"batched": {}, "no mixing": {"OPENRL_KERNEL_SAMPLE_MIX": "0"}}
    else:
        labs = {"batched": {}, "one phase per request": {"OPENRL_KERNEL_SAMPLE_BATCH_TOKENS": "1"}}
    other = list(labs)[1]
    with tempfile.TemporaryDirectory() as tmp:
        servers = {name: LabServer(Path(tmp) / str(i), env=env).start() for i, (name, env) in enumerate(labs.items())}
        try:
            samplers = {}
            for name, lab in servers.items():
                service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
                trainer = service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=8, seed=0).result()
                samplers[name] = checkpoints(trainer, args.samplers)
                run(samplers[name], inputs[: 2 * args.samplers], args, at_once=True)  # warm: loaded, calls made
            times: dict[tuple[str, str], list[float]] = {}
            reference = None
            for r in tqdm(range(args.rounds), desc="rounds"):
                order = [(name, mode) for name in labs for mode in ("at once", "one at a time")]
                for name, mode in order if r % 2 == 0 else order[::-1]:
                    seconds, got = run(samplers[name], inputs, args, at_once=mode == "at once")
                    times.setdefault((name, mode), []).append(seconds)
                    reference = reference or got
                    assert got == reference, f"{name}, {mode}: seeded results differ from the first run's"
        finally:
            for lab in servers.values():
                lab.stop()
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{args.requests} requests x {args.samples} samples x {args.tokens} tokens = {tokens} tokens per run", end="")
    print(f", on {args.samplers} checkpoints" if args.samplers > 1 else "")
    print(f"{'lab':<24}{'mode':<16}{'median s':>10}{'tokens/s':>10}")
    for (name, mode), s in median.items():
        print(f"{name:<24}{mode:<16}{s:>10.3f}{tokens / s:>10.0f}")
    speedup = median[(other, "one at a time")] / median[("batched", "at once")]
    print(f"batched, at once vs one at a time ({other}): {speedup:.2f}x")
    within = median[("batched", "one at a time")] / median[("batched", "at once")]
    print(f"batched lab, at once vs one at a time: {within:.2f}x")
    old = median[(other, "one at a time")] / median[(other, "at once")]
    print(f"{other}, at once vs one at a time: {old:.2f}x")
    both = median[(other, "at once")] / median[("batched", "at once")]
    print(f"at once, batched vs {other}: {both:.2f}x")
    print("seeded results: the same tokens in every lab and mode")
    if args.out:
        args.out.write_text(json.dumps({" / ".join(k): v for k, v in times.items()}, indent=1))


if __name__ == "__main__":
    main()
