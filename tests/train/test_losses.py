"""Each loss against a direct computation written out here, value and gradient."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from openrl_lab.train.loss_spec import LOSS_SPECS, LossInputError
from openrl_lab.train.losses import compute_loss

N = 64


def _case(seed: int, with_weights: bool):
    rng = np.random.default_rng(seed)
    logp = -rng.uniform(0.05, 4.0, N)
    # sampler logprobs within +-0.5 of the current ones: ratios from ~0.6 to ~1.6, both clip sides hit
    logq = logp + rng.uniform(-0.5, 0.5, N)
    inputs = {
        "target_tokens": rng.integers(0, 100, N),
        "logprobs": logq.astype(np.float32),
        "advantages": rng.normal(size=N).astype(np.float32),
    }
    if with_weights:
        inputs["weights"] = rng.uniform(0, 2, N).astype(np.float32)
    return torch.tensor(logp, dtype=torch.float32, requires_grad=True), inputs


def _direct(loss_fn, logp, inputs, cfg):
    """The Tinker formulas, spelled out independently of openrl_lab.train.losses."""
    w = torch.tensor(inputs["weights"]) if "weights" in inputs else torch.ones(N)
    if loss_fn == "cross_entropy":
        return -(w * logp).sum()
    q = torch.tensor(inputs["logprobs"])
    a = torch.tensor(inputs["advantages"])
    r = (logp - q).exp()
    if loss_fn == "importance_sampling":
        return -(w * r * a).sum()
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    if loss_fn == "ppo":
        # pessimistic bound by sign of the advantage: A>=0 caps the ratio above, A<0 below
        obj = torch.where(
            a >= 0, a * torch.minimum(r, torch.full_like(r, hi)), a * torch.maximum(r, torch.full_like(r, lo))
        )
        return -(w * obj).sum()
    if loss_fn == "cispo":
        weight = torch.tensor(np.clip((logp.detach() - q).exp().numpy(), lo, hi))
        return -(w * weight * logp * a).sum()
    if loss_fn == "dro":
        beta = cfg.get("beta", 0.1)
        return -(w * (logp * a - 0.5 * beta * (logp - q) ** 2)).sum()
    raise AssertionError(loss_fn)


CONFIGS = {
    "cross_entropy": [None],
    "importance_sampling": [None],
    "ppo": [None, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}],
    "cispo": [None, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.05}],
    "dro": [None, {"beta": 0.7}],
}
CASES = [(fn, cfg, w) for fn, cfgs in CONFIGS.items() for cfg in cfgs for w in (False, True)]


@pytest.mark.parametrize("loss_fn,config,with_weights", CASES)
def test_loss_value_and_gradient_match_direct_computation(loss_fn, config, with_weights):
    logp, inputs = _case(seed=len(loss_fn) + with_weights, with_weights=with_weights)
    if loss_fn == "cross_entropy":
        inputs = {k: v for k, v in inputs.items() if k in ("target_tokens", "weights")}
    loss, metrics = compute_loss(loss_fn, logp, inputs, config)
    (grad,) = torch.autograd.grad(loss, logp)

    ref_logp = logp.detach().clone().requires_grad_(True)
    ref = _direct(loss_fn, ref_logp, inputs, config or {})
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)

    assert loss.shape == ()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert metrics["loss:sum"] == pytest.approx(float(ref.detach()), rel=1e-5, abs=1e-5)
    assert all(k.count(":") == 1 for k in metrics)


def test_clipping_really_happens_in_the_cases():
    logp, inputs = _case(seed=3, with_weights=False)
    ratio = np.exp(logp.detach().numpy() - inputs["logprobs"])
    assert (ratio > 1.2).any() and (ratio < 0.8).any()


def test_cispo_and_ppo_gradients_analytically():
    logp, inputs = _case(seed=5, with_weights=False)
    q, a = torch.tensor(inputs["logprobs"]), torch.tensor(inputs["advantages"])
    r = (logp.detach() - q).exp()
    (g,) = torch.autograd.grad(compute_loss("cispo", logp, inputs)[0], logp)
    torch.testing.assert_close(g, -r.clamp(0.8, 1.2) * a)
    # ppo: the gradient is -r*A where the unclipped term is the minimum, 0 where the clipped one is
    (g,) = torch.autograd.grad(compute_loss("ppo", logp, inputs)[0], logp)
    active = (r * a) <= (r.clamp(0.8, 1.2) * a)
    torch.testing.assert_close(g, torch.where(active, -r * a, torch.zeros_like(r)))


def test_bad_loss_name_config_or_inputs():
    logp, inputs = _case(seed=0, with_weights=False)
    with pytest.raises(LossInputError, match="unknown loss_fn"):
        compute_loss("nope", logp, inputs)
    with pytest.raises(LossInputError, match="beta"):
        compute_loss("ppo", logp, inputs, {"beta": 1.0})
    with pytest.raises(LossInputError, match="advantages"):
        compute_loss("dro", logp, {"target_tokens": inputs["target_tokens"], "logprobs": inputs["logprobs"]})


def test_every_spec_has_a_loss():
    logp, inputs = _case(seed=1, with_weights=False)
    for name in LOSS_SPECS:
        loss, metrics = compute_loss(name, logp, inputs)
        assert torch.isfinite(loss) and "loss:sum" in metrics
