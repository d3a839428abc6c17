"""Tinker's loss functions for one datum: per-token terms, optionally weighted, summed over tokens.

`logprobs` is log p(target_tokens) under the current model (with grad); `logq` below is the sampler's
`logprobs` input and `A` the `advantages` input.
"""

from __future__ import annotations

import torch

from openrl_lab.train.loss_spec import LOSS_SPECS, LossInputError, resolve_config


def _per_token(loss_fn: str, logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict[str, float]) -> torch.Tensor:
    if loss_fn == "cross_entropy":
        return -logp
    logq, adv = x["logprobs"], x["advantages"]
    ratio = torch.exp(logp - logq)
    if loss_fn == "importance_sampling":
        return -ratio * adv
    if loss_fn == "ppo":
        clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -torch.minimum(ratio * adv, clipped * adv)
    if loss_fn == "cispo":
        # The clipped ratio only weights the policy gradient; no gradient flows through it.
        clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
        return -clipped * logp * adv
    if loss_fn == "dro":
        return -(logp * adv - 0.5 * cfg["beta"] * (logp - logq) ** 2)
    raise LossInputError(f"unknown loss_fn {loss_fn!r}")  # resolve_config rejects these first


# The metrics every forward_backward of a loss that takes the sampler's logprobs reports (Tinker's name:reduction)
MISMATCH_KL, MISMATCH_MAX = "sampler_kl:mean", "sampler_logprob_diff:max"


class Mismatch:
    """Sampler-vs-trainer mismatch over the sampled tokens of a call: KL(sampler || trainer) by the k3
    estimator (mean over tokens of r - 1 - log r, r = p_trainer / p_sampler: >= 0, unbiased for tokens drawn
    from the sampler) and the largest |log p_trainer - log p_sampler|. A sampled token is a position whose
    sampler logprob or advantage is nonzero (prompt positions carry zeros in both) and, when the datum has
    `weights`, whose weight is positive. Both are 0 when the two agree, as they must when the sampler
    samples the weights being trained; a sampler on other weights shows here first."""

    def __init__(self) -> None:
        self.kl_sum, self.tokens, self.max_abs = 0.0, 0, 0.0

    def add(self, logp: torch.Tensor, inputs: dict) -> None:
        logq = torch.as_tensor(inputs["logprobs"], dtype=torch.float64)
        mask = (logq != 0) | (torch.as_tensor(inputs["advantages"]) != 0)
        if "weights" in inputs:
            mask &= torch.as_tensor(inputs["weights"]) > 0
        d = (logp.detach().to("cpu", torch.float64) - logq)[mask]
        if d.numel():
            self.kl_sum += float((torch.expm1(d) - d).sum())
            self.tokens += d.numel()
            self.max_abs = max(self.max_abs, float(d.abs().max()))

    def metrics(self) -> dict[str, float]:
        return {MISMATCH_KL: self.kl_sum / self.tokens if self.tokens else 0.0, MISMATCH_MAX: self.max_abs}


def compute_loss(
    loss_fn: str, logprobs: torch.Tensor, inputs: dict, config: dict | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """The datum's scalar loss and its metrics (keys are `name:reduction`)."""
    cfg = resolve_config(loss_fn, config)
    spec = LOSS_SPECS[loss_fn]
    missing = [k for k in spec.required if k not in inputs]
    if missing:
        raise LossInputError(f"{loss_fn} needs loss_fn_inputs {', '.join(missing)}")
    x = {k: torch.as_tensor(v, device=logprobs.device) for k, v in inputs.items()}
    x = {k: (v if k == "target_tokens" else v.to(logprobs.dtype)) for k, v in x.items()}
    terms = _per_token(loss_fn, logprobs, x, cfg)
    if "weights" in x:
        terms = terms * x["weights"]
    loss = terms.sum()
    return loss, {"loss:sum": float(loss.detach())}
