"""Supervised fine-tuning on a task's reference answers, written only against the tinker SDK.

    trainer = service.create_lora_training_client(base_model="openrl-lab/tiny-llama-1m", rank=16).result()
    history = sft_train(trainer, Copy(), steps=30)        # a pandas DataFrame: step, loss, seconds

Each step draws a fresh batch of problems from the task's "train" split (never its held-out "eval"
prompts), trains on "prompt + answer + </s>" with the loss on the
answer tokens only, and takes one Adam step. Runs against any Tinker-compatible server.
"""

from __future__ import annotations

import time

import pandas as pd
import tinker
from tinker import types

from openrl_lab.recipes.tasks import Problem, Task


def sft_datum(tokenizer, problem: Problem) -> types.Datum:
    """One supervised example: the model reads the prompt and learns to write the answer, then stop."""
    prompt = tokenizer.encode(problem.prompt, add_special_tokens=False)
    answer = [*tokenizer.encode(problem.answer, add_special_tokens=False), tokenizer.eos_token_id]
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)  # position i scores token i + 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def sft_problems(task: Task, batch_size: int, seed: int, step: int) -> list[Problem]:
    """The problems of one SFT step: from the task's "train" split only, fixed by seed and step."""
    return task.problems(batch_size, seed=seed * 1_000_003 + step, split="train")


def sft_train(
    training_client: tinker.TrainingClient,
    task: Task,
    steps: int = 20,
    batch_size: int = 16,
    learning_rate: float = 3e-3,
    seed: int = 0,
    target_loss: float | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Up to `steps` supervised steps on `task`'s reference answers; returns the per-step loss (per answer
    token). With `target_loss`, stops early once the mean loss of the last 3 steps is at or below it."""
    from tqdm.auto import tqdm

    tokenizer = training_client.get_tokenizer()
    rows = []
    bar = tqdm(range(1, steps + 1), desc=f"sft {task.name}", unit="step", disable=not progress)
    for step in bar:
        t0 = time.perf_counter()
        batch = [sft_datum(tokenizer, p) for p in sft_problems(task, batch_size, seed, step)]
        n_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
        fb = training_client.forward_backward(batch, "cross_entropy")
        opt = training_client.optim_step(types.AdamParams(learning_rate=learning_rate))
        loss = fb.result().metrics["loss:sum"] / n_tokens
        opt.result()
        rows.append({"step": step, "loss": loss, "seconds": time.perf_counter() - t0})
        bar.set_postfix(loss=f"{loss:.3f}")
        if target_loss is not None and len(rows) >= 3 and sum(r["loss"] for r in rows[-3:]) / 3 <= target_loss:
            break
    bar.close()
    return pd.DataFrame(rows, columns=["step", "loss", "seconds"])
