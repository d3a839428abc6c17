"""The kernel's operations, typed (torch-free): one protocol, `KernelApi`, that the engine implements and the
control plane calls through `KernelClient.api()`. Every operation is a method with keyword arguments and a
typed result; the wire table (`OPERATIONS`) is derived from the protocol, so an operation is added in one
place: a method here, its implementation in `engine.py`, and pyright checks both and every caller.

On the wire (`kernel.proto`, `codec.py`) a call is still {op, JSON arguments, raw array blobs}: the kernel
validates the arguments against the method's signature (pydantic: unknown, missing or mistyped arguments are
refused, named), and the client validates the answer against the method's result type, so neither side ever
reads a payload by string key. Results are dataclasses; the request and result types that other layers
own (a job's hyperparameters, sampling's types) travel as they are.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, TypeVar

import numpy as np
import pydantic

from openrl_lab.sample.base import SamplingParams
from openrl_lab.train.hparams import AdamSettings, LoraSettings, TrainedWeights
from openrl_lab.train.models import ModelCard  # a base model's card (torch-free), as the kernel reads it

__all__ = [
    "OPERATIONS",
    "AdamSettings",
    "Array",
    "Completion",
    "ExportedWeights",
    "ForwardBackwardOutput",
    "GangAddress",
    "JobFromCheckpoint",
    "KernelApi",
    "KernelMetrics",
    "KernelStatus",
    "LoraSettings",
    "ModelCard",
    "Operation",
    "SampleOutput",
    "SamplingParams",
    "SwapReport",
    "SwapRow",
    "SwapTotals",
    "TopK",
    "TrainedWeights",
    "operations_of",
]


def _array(value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise ValueError(f"expected an array, got {type(value).__name__}")
    return value


# A numpy array: raw bytes on the wire (codec.py), checked for being an array and passed through uncopied.
Array = Annotated[np.ndarray, pydantic.PlainValidator(_array)]


# --- results ------------------------------------------------------------------------------------------
@dataclass
class JobFromCheckpoint:
    """A job made from a checkpoint: its base model and its LoRA settings (None: full fine-tuning), from the file."""

    model: ModelCard
    lora: LoraSettings | None


@dataclass
class ForwardBackwardOutput:
    logprobs: list[Array]  # float32 [N_i] per datum: the targets' logprobs
    metrics: dict[str, float]


@dataclass
class GangAddress:
    """Where a gang's ranks meet (`open_gang`): the TCPStore rank 0's worker serves, at an address the other
    ranks' kernels can reach."""

    host: str
    port: int


@dataclass
class TopK:
    """The k most likely tokens at each of N positions, most likely first: int32 and float32 (N, k)."""

    token_ids: Array
    logprobs: Array


@dataclass
class Completion:
    """One sampled sequence."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    topk: TopK | None = None  # asked for with topk_sample_logprobs: at each sampled position


@dataclass
class SampleOutput:
    sequences: list[Completion]
    prompt_logprobs: list[float] | None  # asked for with want_prompt_logprobs; position 0 is NaN
    topk_prompt_logprobs: TopK | None = None  # asked for with topk_prompt_logprobs; row 0 is empty cells


@dataclass
class ExportedWeights:
    format: str  # peft | merged | full (train/export.py)
    files: dict[str, int]  # file name -> size in bytes, written next to the checkpoint


@dataclass
class SwapTotals:
    """What moved between the device and host memory since the kernel started (all its jobs and base models)."""

    evictions: int
    restores: int
    bytes_evicted: int
    bytes_restored: int
    bytes_retained: int  # evicted bytes that stayed allocated: referenced from outside the state
    seconds: float


@dataclass
class SampleTotals:
    """The torch sampler's batches since the kernel started: the phases they ran in, the sample calls they served,
    and how many ran calls on several samplers (their adapters mixed in one batch)."""

    batches: int = 0
    calls: int = 0
    mixed: int = 0


@dataclass
class KernelMetrics:
    """What the fleet and /metrics read each second; answered at once, while a primitive runs."""

    jobs: int
    job_ids: list[str]
    samplers: int
    sampler: str  # the sampler backend: torch | vllm
    rss_bytes: int
    base_models: list[str]
    device_bytes: int  # accelerator memory allocated (0 on CPU)
    device_free_bytes: int | None  # free on a CUDA device (None on CPU)
    device_budget_bytes: int  # what jobs are admitted against
    device_available_bytes: int
    job_bytes: dict[str, int]  # job id -> its state's bytes (weights/adapter, gradients, AdamW moments)
    swap: SwapTotals
    sampling: SampleTotals = field(default_factory=SampleTotals)


@dataclass
class KernelStatus:
    device: str
    jobs: list[str]
    samplers: int
    base_models: list[str]  # model directories
    base_resident: dict[str, bool]  # base model name -> its weights are on the device (not evicted)


@dataclass
class SwapRow:
    evictions: int
    restores: int
    bytes_evicted: int
    bytes_restored: int
    bytes_retained: int
    resident: bool
    nbytes: int


@dataclass
class SwapReport:
    base: dict[str, SwapRow]  # per base model
    jobs: dict[str, SwapRow]  # per job


# --- the protocol ---------------------------------------------------------------------------------------
F = TypeVar("F", bound=Callable[..., Any])


def inline(method: F) -> F:
    """Answered on the call's own thread at once, never behind the running primitive (cancel, metrics)."""
    method.__kernel_inline__ = True  # type: ignore[attr-defined]
    return method


@dataclass(frozen=True)
class JobSlicing:
    """How a training job's phases are time-sliced (the gate's `bind`): under a lease owned by `owner` (the user
    the job is for; None: the kernel's own identity), named `lease` (default: the job id), on `group`
    (default: the kernel's), with the lease's `weight`, `quota_s` and `priority` where given."""

    owner: str | None = None
    lease: str | None = None
    group: str | None = None
    weight: float | None = None
    quota_s: float | None = None
    priority: Literal["interactive", "batch"] | None = None


class KernelApi(Protocol):
    """Everything a kernel does for the control plane. The engine implements it (`kernel/engine.py`), the
    client exposes it (`KernelClient.api()`); the arguments are keyword-only on the wire."""

    # models
    def model_info(self, *, base_model: str) -> ModelCard: ...
    def tokenizer_files(self, *, base_model: str) -> dict[str, Array]: ...

    # training jobs: `slicing` says how its phases are time-sliced (None: under a lease of the kernel's own)
    def create_job(
        self,
        *,
        job_id: str,
        base_model: str,
        lora: LoraSettings | None,
        seed: int | None = None,
        slicing: JobSlicing | None = None,
    ) -> ModelCard: ...
    def create_job_from_checkpoint(
        self,
        *,
        job_id: str,
        path: str,
        with_optimizer: bool,
        slicing: JobSlicing | None = None,
    ) -> JobFromCheckpoint: ...
    def fork_job(
        self,
        *,
        job_id: str,
        new_job_id: str,
        slicing: JobSlicing | None = None,
    ) -> ModelCard: ...
    # `gang_phase` (below): for a rank of a gang job, the phase key every rank's call of one primitive shares
    # (the gate grants the N ranks' slices together); ignored for a single-device job.
    def drop_job(self, *, job_id: str, gang_phase: str = "") -> None: ...
    @inline
    def trained_weights(self, *, job_id: str) -> TrainedWeights: ...
    def forward_backward(
        self,
        *,
        job_id: str,
        data: list[tuple[Array, dict[str, Array]]],  # (input tokens, loss inputs) per datum
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        backward: bool,
        gang_phase: str = "",
    ) -> ForwardBackwardOutput: ...
    def optim_step(self, *, job_id: str, adam: AdamSettings, gang_phase: str = "") -> dict[str, float]: ...

    # gang jobs: one job sharded over `world_size` kernels, one rank on each (train/distributed.py). Rank 0's
    # kernel opens the gang (its worker serves the rendezvous), then every rank's kernel creates its rank.
    def open_gang(self, *, job_id: str, world_size: int) -> GangAddress: ...
    def create_gang_job(
        self,
        *,
        job_id: str,
        base_model: str,
        lora: LoraSettings | None,
        seed: int | None,
        slicing: JobSlicing | None,
        rank: int,
        world_size: int,
        master: str,  # rank 0's GangAddress as "host:port" (rank 0 itself: ignored)
        gang_phase: str,
    ) -> ModelCard: ...

    # checkpoints: `meta` is written into the checkpoint as given (the control plane's record of the run)
    def save_state(
        self,
        *,
        job_id: str,
        path: str,
        include_optimizer: bool,
        meta: dict[str, Any],
        overwrite: bool = False,
        gang_phase: str = "",
    ) -> int: ...
    def load_state(self, *, job_id: str, path: str, include_optimizer: bool, gang_phase: str = "") -> None: ...
    def export_weights(self, *, path: str, fmt: str | None = None) -> ExportedWeights: ...

    # samplers
    def snapshot_sampler(self, *, job_id: str, sampler_id: str) -> None: ...
    def save_sampler_weights(
        self, *, job_id: str, path: str, meta: dict[str, Any], overwrite: bool = True, gang_phase: str = ""
    ) -> int: ...
    def open_sampler(
        self, *, sampler_id: str, base_model: str | None, path: str | None, owner: str | None = None
    ) -> ModelCard: ...
    def sample(
        self,
        *,
        sampler_id: str,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        want_prompt_logprobs: bool,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> SampleOutput: ...
    def drop_sampler(self, *, sampler_id: str) -> None: ...

    # the kernel itself
    @inline
    def cancel(self, *, ids: list[str]) -> None: ...
    @inline
    def metrics(self) -> KernelMetrics: ...
    def status(self) -> KernelStatus: ...
    def swap_counters(self) -> SwapReport: ...


# --- the wire table, derived from the protocol ------------------------------------------------------------
class BadArguments(ValueError):
    """A call whose arguments do not fit the operation's signature (one line that names each problem)."""


_SAID = {"extra_forbidden": "not an argument of this operation", "missing": "a required argument is missing"}


def _one_line(e: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or 'arguments'}: {_SAID.get(err['type'], err['msg'])}" for err in e.errors()
    )


@dataclass(frozen=True)
class Operation:
    name: str
    inline: bool
    _args: type[pydantic.BaseModel]
    _result: pydantic.TypeAdapter

    def parse_args(self, kwargs: Any) -> dict[str, Any]:
        """The decoded arguments, validated and converted (dicts to their dataclasses); BadArguments if not."""
        if not isinstance(kwargs, dict):
            raise BadArguments("the arguments must be a JSON object")
        try:
            parsed = self._args.model_validate(kwargs)
        except pydantic.ValidationError as e:
            raise BadArguments(_one_line(e)) from None
        return {name: getattr(parsed, name) for name in type(parsed).model_fields}

    def parse_result(self, value: Any) -> Any:
        """The decoded answer as the method's result type; ValueError naming what does not fit."""
        try:
            return self._result.validate_python(value)
        except pydantic.ValidationError as e:
            raise ValueError(_one_line(e)) from None


_CONFIG = pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=True)


def _operation(name: str, method: Callable) -> Operation:
    hints = typing.get_type_hints(method, include_extras=True)
    fields: dict[str, Any] = {}
    for p in inspect.signature(method).parameters.values():
        if p.name == "self":
            continue
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(f"{name}: the arguments of a kernel operation are keyword-only ({p.name})")
        fields[p.name] = (hints[p.name], ... if p.default is inspect.Parameter.empty else p.default)
    return Operation(
        name,
        getattr(method, "__kernel_inline__", False),
        pydantic.create_model(f"{name}_arguments", __config__=_CONFIG, **fields),
        pydantic.TypeAdapter(hints["return"]),
    )


def operations_of(protocol: type) -> dict[str, Operation]:
    """The wire table of a protocol of operations: its public methods, by name."""
    return {
        name: _operation(name, member)
        for name, member in vars(protocol).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


OPERATIONS: dict[str, Operation] = operations_of(KernelApi)
