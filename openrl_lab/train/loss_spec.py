"""What each loss function takes (torch-free, so the gateway can validate requests before they reach a kernel).

Semantics follow Tinker: every input is a per-position array as long as the datum's model input,
position i scoring the token that follows it; losses are sums over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LossSpec:
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config_defaults: dict[str, float] = field(default_factory=dict)


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

LOSS_SPECS: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(required=("target_tokens",), optional=("weights",)),
    "importance_sampling": LossSpec(required=_RL_INPUTS, optional=("weights",)),
    "ppo": LossSpec(required=_RL_INPUTS, optional=("weights",), config_defaults=dict(_CLIP)),
    "cispo": LossSpec(required=_RL_INPUTS, optional=("weights",), config_defaults=dict(_CLIP)),
    "dro": LossSpec(required=_RL_INPUTS, optional=("weights",), config_defaults={"beta": 0.1}),
}

# Keys whose values must be integer token ids; every other input is float32.
INT_INPUTS = frozenset({"target_tokens"})


class LossInputError(ValueError):
    """A forward_backward request whose loss name, inputs or config do not fit the loss function."""


def resolve_config(loss_fn: str, config: dict[str, float] | None) -> dict[str, float]:
    """Defaults merged with the caller's config; unknown loss names or keys raise LossInputError."""
    spec = LOSS_SPECS.get(loss_fn)
    if spec is None:
        raise LossInputError(
            f"unknown loss_fn {loss_fn!r}; supported: {', '.join(sorted(LOSS_SPECS))}"
        )
    merged = dict(spec.config_defaults)
    for key, value in (config or {}).items():
        if key not in spec.config_defaults:
            allowed = ", ".join(sorted(spec.config_defaults)) or "none"
            raise LossInputError(f"loss_fn_config key {key!r} is not used by {loss_fn} (accepted: {allowed})")
        merged[key] = float(value)
    return merged
