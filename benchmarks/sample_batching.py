"""Concurrent sample requests as one batch: an RL step's requests through the tinker SDK, at once vs one at a time.

    .venv/bin/python benchmarks/sample_batching.py [--requests 16] [--samples 8] [--tokens 16] [--rounds 5]

Two labs on the built-in model, side by side: the default (the torch sampler batches concurrent requests) and
one with `OPENRL_KERNEL_SAMPLE_BATCH_TOKENS=1` (no request joins another's batch: each is its own phase, prefill
and decode loop, as before batching). On each, one sampler snapshot of a LoRA run gets `--requests` requests of
`--samples` x `--tokens` (seeded, stop=[] so every sequence is `--tokens` long), once all at once (the SDK's
futures, as an RL step sends them) and once one after another. Rounds alternate the labs and the order; the figure
is the ratio of medians within the run. Seeded results are checked to be the same tokens in every mode.
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


def run(sampler, inputs, args, at_once: bool) -> tuple[float, list[list[list[int]]]]:
    params = [
        types.SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1000 + i, stop=[])
        for i in range(len(inputs))
    ]
    t = time.perf_counter()
    if at_once:
        futures = [sampler.sample(p, args.samples, sp) for p, sp in zip(inputs, params)]
        results = [f.result() for f in futures]
    else:
        results = [sampler.sample(p, args.samples, sp).result() for p, sp in zip(inputs, params)]
    return time.perf_counter() - t, [[s.tokens for s in r.sequences] for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    inputs = prompts(args.requests)
    tokens = args.requests * args.samples * args.tokens
    labs = {"batched": {}, "one phase per request": {"OPENRL_KERNEL_SAMPLE_BATCH_TOKENS": "1"}}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {name: LabServer(Path(tmp) / str(i), env=env).start() for i, (name, env) in enumerate(labs.items())}
        try:
            samplers = {}
            for name, lab in servers.items():
                service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
                trainer = service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=8, seed=0).result()
                samplers[name] = trainer.save_weights_and_get_sampling_client("bench").result()
                run(samplers[name], inputs[:2], args, at_once=True)  # warm: model loaded, first calls made
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
    print(f"{args.requests} requests x {args.samples} samples x {args.tokens} tokens = {tokens} tokens per run")
    print(f"{'lab':<24}{'mode':<16}{'median s':>10}{'tokens/s':>10}")
    for (name, mode), s in median.items():
        print(f"{name:<24}{mode:<16}{s:>10.3f}{tokens / s:>10.0f}")
    speedup = median[("one phase per request", "one at a time")] / median[("batched", "at once")]
    print(f"batched, at once vs one at a time (no batching): {speedup:.2f}x")
    within = median[("batched", "one at a time")] / median[("batched", "at once")]
    print(f"batched lab, at once vs one at a time: {within:.2f}x")
    old = median[("one phase per request", "one at a time")] / median[("one phase per request", "at once")]
    print(f"without batching, at once vs one at a time: {old:.2f}x")
    print("seeded results: the same tokens in every lab and mode")
    if args.out:
        args.out.write_text(json.dumps({" / ".join(k): v for k, v in times.items()}, indent=1))


if __name__ == "__main__":
    main()
