"""Small shared pieces of the notebook-layer tests."""

from __future__ import annotations

import tinker


def datum(tokenizer, text: str) -> tinker.Datum:
    """One next-token cross-entropy example."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def train_steps(run, data, steps: int, start: int = 0, lr: float = 1e-2) -> list[float]:
    """`steps` SFT steps on `run`, each logged as `loss`; the losses."""
    losses = []
    for step in range(start, start + steps):
        fb = run.training.forward_backward(data, "cross_entropy").result()
        run.training.optim_step(tinker.AdamParams(learning_rate=lr)).result()
        losses.append(fb.metrics["loss:sum"])
        run.log(step, loss=losses[-1])
    return losses


def run_in_kernel(kc, code: str, timeout: float = 120) -> str:
    """Runs `code` in a Jupyter kernel (a jupyter_client BlockingKernelClient): its printed output; the
    kernel's traceback as the assertion message if the code failed."""
    out: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    assert reply["content"]["status"] == "ok", "".join(out)
    return "".join(out)


def eval_loss(run, data) -> float:
    return run.training.forward(data, "cross_entropy").result().metrics["loss:sum"]
