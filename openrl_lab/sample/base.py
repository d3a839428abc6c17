"""What every sampler backend shares, torch-free: the request (`SamplingParams`) and result (`SampledSequence`)
types, the one check of a request (`validate`), and the constants of the Tinker protocol they follow. The kernel
protocol (`openrl_lab/kernel/api.py`) carries these types as they are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

MAX_NUM_SAMPLES = 128
# Temperatures below this are treated as greedy: dividing by them would overflow the logits (vLLM does the same).
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1  # -1 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | list[int] | None = None  # None = stop at EOS; [] = never stop early (not even EOS)


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    # With `topk_logprobs` > 0: at each sampled position, the k most likely tokens and their logprobs, most
    # likely first (the model's own distribution, like `logprobs`).
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)


class SamplingError(ValueError):
    """Bad sampling request; the message names the parameter and the limit."""


class SamplerGone(LookupError):
    """The sampler's weights are no longer held (replaced by a newer snapshot, or dropped while it waited)."""


def validate(
    prompt: list[int],
    num_samples: int,
    p: SamplingParams,
    max_context: int,
    vocab_size: int,
    decode: Callable[[list[int]], str] | None,
) -> list[int] | list[str] | None:
    """Check a request (for every sampler backend); return the stop list normalised (a bare string becomes a
    one-item list)."""
    if not prompt:
        raise SamplingError("prompt is empty: it needs at least 1 token")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise SamplingError(f"prompt token {bad} is outside the vocabulary [0, {vocab_size})")
    if not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise SamplingError(f"num_samples={num_samples} must be between 1 and {MAX_NUM_SAMPLES}")
    if p.max_tokens < 1:
        raise SamplingError(f"max_tokens={p.max_tokens} must be at least 1")
    if len(prompt) + p.max_tokens > max_context:
        raise SamplingError(
            f"max_tokens={p.max_tokens} with a prompt of {len(prompt)} tokens runs past the context of "
            f"{max_context} tokens (at most {max(max_context - len(prompt), 0)} new tokens fit)"
        )
    if not p.temperature >= 0:  # also rejects NaN
        raise SamplingError(f"temperature={p.temperature} must be >= 0")
    if not 0 < p.top_p <= 1:
        raise SamplingError(f"top_p={p.top_p} must be in (0, 1]")
    if p.top_k == 0 or p.top_k < -1:
        raise SamplingError(f"top_k={p.top_k} must be -1 (off) or >= 1")
    stop: list[str] | list[int] | None = [p.stop] if isinstance(p.stop, str) else p.stop
    if stop:
        if all(isinstance(s, str) for s in stop):
            if decode is None:
                raise SamplingError("stop strings need a decode function (none was given for this model)")
            if any(s == "" for s in stop):
                raise SamplingError("stop strings must not be empty")
        elif not all(isinstance(s, int) for s in stop):
            raise SamplingError("stop must be all strings or all token ids, not a mix")
    return stop


TOPK_EMPTY_LOGPROB = -99999.0  # the Tinker protocol's filler for a top-k cell with no token
