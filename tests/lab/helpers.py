"""Small shared pieces of the notebook-layer tests."""

from __future__ import annotations

import tinker


def datum(tokenizer, text: str) -> tinker.Datum:
    """One next-token cross-entropy example."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def train_steps(run, data, steps: int, start: int = 0, lr: float = 1e-2) -> list[float]:
    """`steps` SFT steps on `run`, each logged as `loss`; the losses."""
    losses = []
    for step in range(start, start + steps):
        fb = run.training.forward_backward(data, "cross_entropy").result()
        run.training.optim_step(tinker.AdamParams(learning_rate=lr)).result()
        losses.append(fb.metrics["loss:sum"])
        run.log(step, loss=losses[-1])
    return losses


def eval_loss(run, data) -> float:
    return run.training.forward(data, "cross_entropy").result().metrics["loss:sum"]
