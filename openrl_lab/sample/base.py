"""What every sampler backend shares, torch-free: the interface a kernel holds a backend by (`SamplerBackend`),
the request (`SamplingParams`, `SampleRequest`) and result (`SampledSequence`, `SampleResult`) types, the one check
of a request (`validate`), and the constants of the Tinker protocol they follow. The kernel protocol
(`openrl_lab/kernel/api.py`) carries these types as they are."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

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


@dataclass
class SampleRequest:
    """One Tinker `sample` call, checked (`SamplerBackend.request`). `stop`: the stop list normalised by
    `validate`; `lora_id`: the adapter version it samples on a backend that batches several (vLLM; None: the
    handle's own weights)."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    stop: list[int] | list[str] | None
    lora_id: int | None = None
    prompt_logprobs: bool = False
    topk_prompt: int = 0  # > 0: the top-k of each prompt position's next-token distribution
    topk_sample: int = 0  # > 0: the top-k of the distribution each sampled token was drawn from


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float] | None
    topk_prompt: dict | None = None  # {"token_ids": int32 (N, k), "logprobs": float32 (N, k)}, row 0 empty


@dataclass(eq=False)
class Ticket:
    """One sample call waiting in a backend's batcher: what it asks (`request`, on `handle` under the phase
    `key`), and once its batch has run, its result or its error."""

    key: str
    handle: Any
    request: SampleRequest
    cancel_point: Callable[[], None]
    tag: Any
    value: SampleResult | None = None
    error: BaseException | None = None
    done: bool = False

    def result(self) -> SampleResult:
        if self.error is not None:
            raise self.error
        assert self.value is not None  # a call whose batch ran has one or the other
        return self.value


Handle = TypeVar("Handle")
# `in_phase(tags, work)`: the kernel runs `work` inside one phase (its lock and the time-slicing gate); `tags` are
# the tags of the calls the work serves (sampler ids: the kernel marks them used).
InPhase = Callable[[list[Any], Callable[[], None]], None]


class SamplerBackend(Protocol[Handle]):
    """A way of sampling that a kernel holds (`torch_backend.TorchBackend`, `vllm_backend.VllmBackend`). The kernel
    keeps samplers as handles of their backend and knows nothing else of it: a new backend is a module here and its
    name in `SAMPLERS`. Errors: `SamplingError` for a request or model the backend refuses (the caller's fault),
    `SamplerGone` for a handle whose weights are no longer held."""

    name: str
    # True: `run` is called on each caller's own thread, at once, so that concurrent calls can meet in one batch;
    # False: the kernel runs one `run` at a time.
    concurrent: bool

    def open(self, base_model: str, snapshot: Mapping[str, Any] | None, run: str, job: Any = None) -> Handle | None:
        """A sampler on `base_model`'s weights, or on a snapshot of trained weights (a LoRA adapter or full
        weights); `run` names the run the snapshot comes from ("" for none), `job` the kernel's live training job
        when it is one. None: this backend does not serve it, and the next backend is asked."""
        ...

    def request(
        self,
        h: Handle,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        want_prompt_logprobs: bool,
        topk_prompt: int = 0,
        topk_sample: int = 0,
    ) -> SampleRequest:
        """One sample call, checked before any phase."""
        ...

    def run(
        self,
        key: str,
        h: Handle,
        request: SampleRequest,
        cancel_point: Callable[[], None],
        in_phase: InPhase,
        tag: Any = None,
    ) -> SampleResult:
        """The request's result, computed inside `in_phase` under the phase (lease) `key`. `cancel_point` may raise
        to abandon the call; `tag` is passed to `in_phase`."""
        ...

    def release(self, h: Handle) -> None:
        """What a dropped sampler held beyond the handle (an adapter version in an engine)."""
        ...

    def sleep(self) -> None:
        """Another job waits for the device: give up what the backend holds there beyond the kernel's own weights."""
        ...


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
