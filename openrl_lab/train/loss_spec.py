"""What each loss function takes (torch-free, so the gateway can validate requests before they reach a kernel).

Semantics follow Tinker: every input is a per-position array as long as the datum's model input,
position i scoring the token that follows it; losses are sums over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
        raise LossInputError(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(sorted(LOSS_SPECS))}")
    merged = dict(spec.config_defaults)
    for key, value in (config or {}).items():
        if key not in spec.config_defaults:
            allowed = ", ".join(sorted(spec.config_defaults)) or "none"
            raise LossInputError(f"loss_fn_config key {key!r} is not used by {loss_fn} (accepted: {allowed})")
        merged[key] = float(value)
    return merged


class DataError(ValueError):
    """A datum that cannot be trained on; the message names the datum index and the problem."""


# ------------------------------------------------------------------------------------ validation


def check_datum(
    i: int, tokens, inputs: dict, loss_fn: str, vocab_size: int, max_context: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Checks datum i against the loss function and the model; returns (tokens int64, inputs with dtypes fixed).

    The gateway runs this before a request is accepted, and the kernel again before it trains."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0:
        raise DataError(f"datum {i}: tokens must be a non-empty 1-D array, got shape {tokens.shape}")
    n = tokens.size
    if n > max_context:
        raise DataError(f"datum {i}: {n} tokens is longer than the model's max context length {max_context}")
    tokens = _token_ids(i, "tokens", tokens, vocab_size)
    spec = LOSS_SPECS.get(loss_fn)
    if spec is None:
        raise LossInputError(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(sorted(LOSS_SPECS))}")
    missing = [k for k in spec.required if k not in inputs]
    if missing:
        raise DataError(f"datum {i}: loss_fn {loss_fn} needs loss_fn_inputs {', '.join(missing)}")
    unknown = sorted(set(inputs) - set(spec.required) - set(spec.optional))
    if unknown:
        raise DataError(f"datum {i}: loss_fn {loss_fn} does not take loss_fn_inputs {', '.join(unknown)}")
    checked = {}
    for key, value in inputs.items():
        arr = np.asarray(value)
        if arr.shape != (n,):
            raise DataError(
                f"datum {i}: loss_fn_inputs[{key!r}] has shape {arr.shape}, but the model input has {n} "
                "tokens; they must be the same length"
            )
        if key in INT_INPUTS:
            checked[key] = _token_ids(i, key, arr, vocab_size)
        else:
            if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
                raise DataError(f"datum {i}: loss_fn_inputs[{key!r}] must be numbers, got dtype {arr.dtype}")
            arr = arr.astype(np.float32)
            if not np.isfinite(arr).all():
                raise DataError(f"datum {i}: loss_fn_inputs[{key!r}] contains NaN or infinity")
            checked[key] = arr
    return tokens, checked


def _token_ids(i: int, key: str, arr: np.ndarray, vocab: int) -> np.ndarray:
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"datum {i}: {key} must be integer token ids, got dtype {arr.dtype}")
    bad = arr[(arr < 0) | (arr >= vocab)]
    if bad.size:
        raise DataError(f"datum {i}: {key} has token id {int(bad[0])}, outside the vocabulary [0, {vocab})")
    return arr.astype(np.int64)
