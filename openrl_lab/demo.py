"""`make demo`: start a lab on this machine and train the built-in model through the unchanged tinker SDK.

(The RL recipe will take this over; for now it runs a short supervised loop and shows the loss falling.)
"""

from __future__ import annotations

import os
from pathlib import Path

from openrl_lab.home import DEFAULT_MODEL, default_home


def arithmetic_batch(tokenizer, n: int = 16, seed: int = 0):
    """Short sums the tiny model can memorise quickly: "12+7=19"."""
    import random

    import tinker

    rng = random.Random(seed)
    data = []
    for _ in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        prompt, answer = f"{a}+{b}=", f"{a + b}"
        p = tokenizer.encode(prompt, add_special_tokens=False)
        c = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        tokens = p + c
        weights = [0.0] * (len(p) - 1) + [1.0] * len(c)  # learn the answer, not the prompt
        data.append(tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights}))
    return data


def main(home: Path | None = None, steps: int = 20) -> int:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker
    from tqdm import tqdm

    from openrl_lab.server import LabServer

    home = home or default_home() / "demo"
    with LabServer(home) as lab:
        print(f"lab running at {lab.base_url} (home {home})")
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        trainer = service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=16, seed=0).result()
        tokenizer = trainer.get_tokenizer()
        batch = arithmetic_batch(tokenizer)
        n_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
        losses = []
        bar = tqdm(range(steps), desc="supervised", unit="step")
        for _ in bar:
            fb = trainer.forward_backward(batch, "cross_entropy")
            opt = trainer.optim_step(tinker.types.AdamParams(learning_rate=5e-3))
            loss = fb.result().metrics["loss:sum"] / n_tokens
            opt.result()
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}")
        path = trainer.save_state("demo-final").result().path
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = tinker.types.ModelInput.from_ints(tokenizer.encode("3+4=", add_special_tokens=False))
        out = sampler.sample(prompt, num_samples=1,
                             sampling_params=tinker.types.SamplingParams(max_tokens=4, temperature=0.0)).result()
        print(f"loss per answer token: {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps")
        print(f"checkpoint: {path}")
        print(f"sample for '3+4=': {tokenizer.decode(out.sequences[0].tokens)!r}")
        service.close("success").result()
    if not losses[-1] < losses[0]:
        print("FAILED: the loss did not go down")
        return 1
    return 0
