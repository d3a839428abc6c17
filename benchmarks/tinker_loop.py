"""One tinker SDK loop, timed in rounds: what `vs_skyrl.py` drives each server with, from each side's own SDK.

    python tinker_loop.py --base-url URL --api-key KEY --base-model NAME --vocab N

It runs under any tinker SDK from 0.24.1 on (it uses only calls they all have) and imports nothing else of
this project, so the same file drives a server from another project's environment. At start: a LoRA training
client (rank 16) and a warm-up (a server that compiles per shape compiles here). Then, for each line "round" on
stdin, one round, answered with one JSON line on stdout:

- `step_s`: the median of STEPS supervised steps (forward_backward cross_entropy on BATCH x LENGTH tokens, then
  optim_step, each awaited before the next);
- `sample_s` and `sample_tokens`: a sampler snapshot of the current weights, then PROMPTS concurrent sample
  requests of SAMPLES samples x MAX_TOKENS tokens (temperature 1; EOS ends a sample early), awaited together.

Prompts and data are fixed token ids (no tokenizer: each side's tokenizer route would differ).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker
from tinker import types

RANK, BATCH, LENGTH, STEPS = 16, 4, 24, 10
PROMPTS, SAMPLES, MAX_TOKENS, PROMPT_LENGTH = 8, 8, 32, 12


def batch(vocab: int, rng: random.Random) -> list:
    data = []
    for _ in range(BATCH):
        ids = [rng.randrange(3, vocab) for _ in range(LENGTH + 1)]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=ids[1:], dtype="int64", shape=[LENGTH]),
                    "weights": types.TensorData(data=[1.0] * LENGTH, dtype="float32", shape=[LENGTH]),
                },
            )
        )
    return data


def resolved(client):
    """The client itself: since tinker 0.3x, create_* and save_weights_and_get_sampling_client answer futures."""
    return client.result() if callable(getattr(client, "result", None)) else client


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--base-model", required=True)
    ap.add_argument("--vocab", type=int, required=True)
    args = ap.parse_args()
    rng = random.Random(0)
    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    trainer = resolved(service.create_lora_training_client(base_model=args.base_model, rank=RANK))
    data = batch(args.vocab, rng)
    adam = types.AdamParams(learning_rate=1e-4)
    prompts = [types.ModelInput.from_ints([rng.randrange(3, args.vocab) for _ in range(PROMPT_LENGTH)])] * PROMPTS

    def step() -> None:
        fb, opt = trainer.forward_backward(data, "cross_entropy"), trainer.optim_step(adam)
        fb.result()
        opt.result()

    def sample() -> tuple[float, int]:
        t0 = time.perf_counter()
        sampler = resolved(trainer.save_weights_and_get_sampling_client())
        futures = [
            sampler.sample(p, num_samples=SAMPLES, sampling_params=types.SamplingParams(max_tokens=MAX_TOKENS, seed=i))
            for i, p in enumerate(prompts)
        ]
        tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        return time.perf_counter() - t0, tokens

    t0 = time.perf_counter()
    for _ in range(3):
        step()
    sample()
    print(json.dumps({"ready_s": time.perf_counter() - t0, "sdk": tinker.__version__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        times = []
        for _ in range(STEPS):
            s = time.perf_counter()
            step()
            times.append(time.perf_counter() - s)
        sample_s, tokens = sample()
        print(
            json.dumps({"step_s": statistics.median(times), "sample_s": sample_s, "sample_tokens": tokens}), flush=True
        )
    os._exit(0)  # the SDK's heartbeat threads would hold the exit


if __name__ == "__main__":
    main()
