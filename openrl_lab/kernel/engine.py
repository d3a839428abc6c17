"""The kernel's engine: resident base models, jobs, sampler snapshots, and the primitives run on them.

Everything a kernel does for a job is one call here, wrapped in a phase (`PhaseGate`): that is the seam
where the time-slicing orchestrator acquires the group before the work and yields after it.

What can leave the device between phases: each job's own state (`evict_job`: its adapter + AdamW, or its
weights + AdamW) when another job waits, and each base model's weights (`evict_shared`) when the waiter
runs in another process; a base model is restored by the first phase that needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from openrl_lab import memory
from openrl_lab.kernel.api import (
    Completion,
    ExportedWeights,
    ForwardBackwardOutput,
    GangAddress,
    JobFromCheckpoint,
    JobSlicing,
    KernelApi,
    KernelMetrics,
    KernelStatus,
    ModelCard,
    SampleOutput,
    SampleTotals,
    SwapReport,
    SwapRow,
    SwapTotals,
    TopK,
)
from openrl_lab.kernel.rank_worker import GangLost, GangUserError, RankWorker
from openrl_lab.kernel.threads import NO_CHOICE, ThreadCounts, threads_for
from openrl_lab.sample import SAMPLERS
from openrl_lab.sample.base import (
    SampledSequence,
    SamplerBackend,
    SampleResult,
    SamplerGone,
    SamplingError,
    SamplingParams,
)
from openrl_lab.sample.torch_backend import TorchBackend
from openrl_lab.settings import settings
from openrl_lab.swap import SwapSet, global_counters
from openrl_lab.train import checkpoint as ckpt
from openrl_lab.train import export
from openrl_lab.train.hparams import AdamSettings, LoraSettings, TrainedWeights
from openrl_lab.train.models import model_card, resolve_model_dir
from openrl_lab.train.trainer import (
    BaseModelHost,
    Datum,
    TrainJob,
    load_snapshot,
)

log = logging.getLogger(__name__)

# Unnamed sampler snapshots kept per training job (an RL loop makes one per step; older ones are dropped).
SNAPSHOTS_PER_JOB = 16
# Samplers opened on a base model or a checkpoint kept per kernel (least recently used dropped first).
LOOSE_SAMPLERS = 64
SAMPLER_LEASE = "samplers"  # the lease of a user's samplers opened on a base model or a checkpoint
# What `tokenizer_files` hands out: the files AutoTokenizer may read (config.json too: it can pick the tokenizer
# class from the model type), never weights or anything else of the model directory.
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "tiktoken.model",
        "tekken.json",
        "chat_template.jinja",
        "chat_template.json",
        "generation_config.json",
        "config.json",
    }
)
MAX_TOKENIZER_BYTES = 64 << 20  # the largest tokenizers (tokenizer.json of 256k-token vocabularies) are ~35 MB


class UserError(ValueError):
    """A request the kernel refuses because of its content (reported to the caller as a 4xx / user error)."""


class NotFound(KeyError):
    """A job or sampler the kernel does not hold (e.g. lost in a restart)."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class Cancelled(UserError):
    """The call was abandoned because its job or sampler was cancelled (its run is being freed)."""


class PhaseGate(Protocol):
    """Runs a job's phases. A gate may also say which lease a job's phases run under (`lease_of(job_id)`, any
    hashable): sample calls of one lease may then share a batch across samplers. One that does not: each job its
    own."""

    def phase(
        self, job_id: str, kind: str, gang: tuple[str, int] | None = None
    ) -> contextlib.AbstractContextManager: ...


class OpenGate:
    """No arbitration: every phase runs at once. The orchestrator replaces this to time-slice jobs."""

    @contextlib.contextmanager
    def phase(self, job_id: str, kind: str, gang: tuple[str, int] | None = None) -> Iterator[None]:
        yield

    def lease_of(self, job_id: str) -> str:
        return ""  # no arbitration, so no shares to keep apart: one lease


class Engine:
    def __init__(
        self,
        home: Path,
        device: str = "cpu",
        gate: PhaseGate | None = None,
        sampler: str = "torch",
        sampler_fallback: bool = False,
        sampler_models: tuple[str, ...] = (),
        threads: ThreadCounts = NO_CHOICE,
    ):
        """`sampler`: the backend samplers run on; with "vllm", `sampler_fallback` samples a model vLLM cannot
        serve with the torch sampler instead of refusing it, and `sampler_models` start their vLLM engines now
        (a model vLLM cannot serve is then a UserError at once: the kernel does not start). `threads`: a large
        forward/backward pass runs with `threads.large` torch threads (the caller's thread keeps its own count
        for everything else)."""
        if sampler not in SAMPLERS:
            raise UserError(f"unknown sampler {sampler!r} (one of {', '.join(SAMPLERS)})")
        self.home = home
        self.device = device
        self.threads = threads
        self.gate = gate or OpenGate()
        self._hosts: dict[str, BaseModelHost] = {}  # by model directory
        self._jobs: dict[str, TrainJob] = {}
        # sampler_id -> its backend's handle on the weights it was made from; LRU within each source job
        self._samplers: OrderedDict[str, _Sampler] = OrderedDict()
        self._lock = threading.RLock()  # one primitive at a time: a kernel drives one group of devices
        self._swapsets: dict[str, SwapSet] = {}
        self._base_swapsets: dict[str, SwapSet] = {}  # model directory -> the host's base weights
        self._swap_lock = threading.Lock()  # guards the two dicts above against the gate's event thread
        # Jobs and samplers whose running call stops at its next cancel point (between micro-batches or
        # decoding steps) and whose later calls are refused: set without the engine lock, which that call holds.
        self._cancelled: set[str] = set()
        self.sampler, self.sampler_fallback = sampler, sampler_fallback
        try:
            self.memory_budget = memory.budget_from_env() or _device_total_bytes(device)
        except ValueError as e:
            raise UserError(str(e)) from None
        # The sampler backends asked in turn to open a sampler (sample/base.py's SamplerBackend): the chosen one,
        # then the torch backend, which serves every model (a vLLM kernel's fallback).
        self.sampler_backends: list[SamplerBackend] = [
            TorchBackend(device, self._host, self._base_ready, self._lease_of)
        ]
        if sampler == "vllm":
            from openrl_lab.sample.vllm_backend import VllmBackend

            try:
                vllm = VllmBackend(home, device, self._model_dir, sampler_fallback, sampler_models)
            except SamplingError as e:
                raise UserError(str(e)) from None
            self.sampler_backends.insert(0, vllm)
        # Operations the kernel runs on the caller's own thread rather than one at a time: with a backend that
        # batches, concurrent sample calls meet in it and run as one batch.
        self.concurrent_ops = frozenset({"sample"}) if self.sampler_backends[0].concurrent else frozenset()
        # Gang jobs: this kernel's rank of each, in a worker process of its own (kernel/rank_worker.py). Their
        # calls never take the engine lock: a rank's call waits for the other ranks (at the gate, in collectives),
        # which must not stop this kernel's other jobs, nor another gang's rank here that those ranks wait for.
        self.gang_host = "127.0.0.1"  # the address other kernels reach this one's gang rendezvous at
        self.gang_timeout_s = settings().kernel_gang_timeout_s  # a collective waits this long for a peer at most
        self._gangs: dict[str, _Gang] = {}
        self._gang_lanes: dict[str, ThreadPoolExecutor] = {}  # job id -> the thread its calls run on, in order
        self._gang_lock = threading.Lock()  # guards the two dicts above

    # --- models -----------------------------------------------------------------------------------
    def _model_dir(self, base_model: str) -> Path:
        try:
            return resolve_model_dir(base_model, self.home)
        except ValueError as e:
            raise UserError(str(e)) from None

    def _host(self, base_model: str) -> BaseModelHost:
        key = str(self._model_dir(base_model))
        if key not in self._hosts:
            self._hosts[key] = BaseModelHost(key, device=self.device, name=base_model)
        return self._hosts[key]

    def model_info(self, base_model: str) -> ModelCard:
        try:
            return model_card(self._model_dir(base_model), name=base_model)
        except (OSError, ValueError) as e:  # a directory that is not a model: the same answer as a missing one
            raise UserError(
                f"base_model {base_model!r} is not a model this kernel can load: {type(e).__name__}"
            ) from None

    def tokenizer_files(self, base_model: str) -> dict[str, np.ndarray]:
        """The model's tokenizer files ({name: bytes as uint8}), for clients that share no filesystem with this
        kernel (the gateway's /hf mirror). Only names in TOKENIZER_FILES, only regular files that stay inside the
        model's directory (or, for a Hugging Face cache snapshot, inside its repository's cache folder, where
        the snapshot's links point), at most MAX_TOKENIZER_BYTES in all."""
        model_dir = self._model_dir(base_model)
        try:
            root = model_dir.resolve(strict=True)
            inside = root.parent.parent if root.parent.name == "snapshots" else root  # HF cache: links to ../../blobs
            found = {}
            for name in sorted(TOKENIZER_FILES):
                path = (root / name).resolve()
                if path.is_relative_to(inside) and path.is_file():
                    found[name] = path
        except (OSError, ValueError) as e:  # the same answer as model_info for a directory it cannot use
            raise UserError(
                f"base_model {base_model!r} is not a model this kernel can load: {type(e).__name__}"
            ) from None
        if "config.json" not in found or not found.keys() - {"config.json", "generation_config.json"}:
            raise UserError(f"base_model {base_model!r} is not a model this kernel can load: it has no tokenizer")
        sizes = {name: path.stat().st_size for name, path in found.items()}
        if sum(sizes.values()) > MAX_TOKENIZER_BYTES:
            raise UserError(
                f"the tokenizer files of {base_model!r} are {sum(sizes.values()) / 2**20:.1f} MiB "
                f"({', '.join(f'{n} {s / 2**20:.1f} MiB' for n, s in sorted(sizes.items()))}): at "
                f"most {MAX_TOKENIZER_BYTES >> 20} MiB are served"
            )
        return {name: np.frombuffer(path.read_bytes(), dtype=np.uint8) for name, path in found.items()}

    def cancel(self, ids: list[str]) -> None:
        """Abandons the running and later calls of these jobs and samplers (before the control plane drops
        them): a dead client's long forward_backward does not keep the group busy."""
        self._cancelled.update(ids)

    def _cancel_point(self, *ids: str | None) -> Callable[[], None]:
        def check() -> None:
            if any(i in self._cancelled for i in ids if i):
                raise Cancelled(f"{' / '.join(i for i in ids if i)}: cancelled, its run is being freed")

        return check

    def _job(self, job_id: str) -> TrainJob:
        self._cancel_point(job_id)()
        job = self._jobs.get(job_id)
        if job is None and job_id in self._gangs:
            raise UserError(
                f"model {job_id} is sharded over {self._gangs[job_id].world_size} devices: this operation is not "
                "supported for it (sample through save_weights_for_sampler)"
            )
        if job is None:
            raise NotFound(
                f"model {job_id} is not resident on its kernel (the kernel restarted since it was "
                "created); load it from your last checkpoint (create_training_client_from_state)"
            )
        return job

    # --- training ---------------------------------------------------------------------------------
    def create_job(
        self,
        job_id: str,
        base_model: str,
        lora: LoraSettings | None,
        seed: int | None = None,
        slicing: JobSlicing | None = None,
    ) -> ModelCard:
        """A training job, time-sliced as `slicing` says (`JobSlicing`); samplers made from the job's weights run
        under the same lease."""
        with self._lock:
            if job_id in self._jobs:
                self.drop_job(job_id)
            self._bind(job_id, slicing)
            try:
                with self.gate.phase(job_id, "create_model"):
                    host = self._host(base_model)
                    self._base_ready(host)
                    if lora is None:  # refused before its copy is made, not by an out-of-memory error later
                        self._check_room(
                            f"a full fine-tuning job on {base_model}",
                            memory.full_finetune_bytes(host.card.num_parameters),
                        )
                    self._jobs[job_id] = host.create_job(job_id, lora, seed=seed)
            except BaseException:
                if job_id not in self._jobs and hasattr(self.gate, "forget"):
                    self.gate.forget(job_id)
                raise
            return self.model_info(base_model)

    def create_job_from_checkpoint(
        self,
        job_id: str,
        path: str,
        with_optimizer: bool,
        slicing: JobSlicing | None = None,
    ) -> JobFromCheckpoint:
        meta = read_meta(path)
        lora = LoraSettings(**meta["lora"]) if meta.get("lora") else None
        info = self.create_job(job_id, meta["base_model"], lora, slicing=slicing)
        self.load_state(job_id, path, with_optimizer)
        return JobFromCheckpoint(info, lora)

    def fork_job(
        self,
        job_id: str,
        new_job_id: str,
        slicing: JobSlicing | None = None,
    ) -> ModelCard:
        """A new job `new_job_id` that carries on from `job_id` (`TrainJob` state copied on the device, in a
        phase of the source job), time-sliced as `slicing` says. A full fine-tuning job's copy is refused with
        the sizes when the device has no room for it."""
        with self._lock:
            src = self._job(job_id)
            if new_job_id in self._jobs:
                raise UserError(f"model {new_job_id} already exists on this kernel")
            self._bind(new_job_id, slicing)
            try:
                with self.gate.phase(job_id, "fork"):
                    self._job_ready(src)
                    if src.adapter is None:
                        self._check_room(f"a copy of full fine-tuning job {job_id}", src.state_bytes)
                    self._jobs[new_job_id] = src.host.fork_job(job_id, new_job_id)
                    if hasattr(self.gate, "adopt"):  # its lease now; its state leaves the device with the source's
                        self.gate.adopt(new_job_id, job_id)
            except BaseException:
                if new_job_id not in self._jobs and hasattr(self.gate, "forget"):
                    self.gate.forget(new_job_id)
                raise
            return self.model_info(src.host.card.name)

    def _bind(self, job_id: str, slicing: JobSlicing | None) -> None:
        if hasattr(self.gate, "bind"):  # the orchestrator's gate; a plain PhaseGate slices nothing
            self.gate.bind(job_id, **dataclasses.asdict(slicing or JobSlicing()))

    def trained_weights(self, job_id: str) -> TrainedWeights:
        """What the job trains (counted when it was made): read without the engine lock, never behind a phase.
        A gang job's: the whole job's (the same on every rank)."""
        gang = self._gangs.get(job_id)
        if gang is not None and gang.trained is not None:
            return gang.trained
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"model {job_id} is not resident on its kernel (the kernel restarted since it was created)")
        return job.trained

    def drop_job(self, job_id: str, gang_phase: str = "") -> None:
        """A gang job's rank is dropped at once, in no phase: stopping its worker is local (the other ranks'
        next collective fails), and a gang that lost a rank must still be droppable."""
        if job_id in self._gangs:
            self._drop_gang(job_id)
            return
        with self._lock:
            job = self._jobs.pop(job_id, None)
            swap = self._swapsets.pop(job_id, None)
            if swap is not None:
                if not swap.resident:
                    swap.restore()  # give the tensors back before peft drops the adapter
                swap.close()
            if job is not None:
                job.host.drop_job(job_id)
            if hasattr(self.gate, "forget"):
                self.gate.forget(job_id)
            for sid in [s for s, v in self._samplers.items() if v.job_id == job_id]:
                self._release(self._samplers.pop(sid))
                self._cancelled.discard(sid)
            self._cancelled.discard(job_id)

    def forward_backward(
        self,
        job_id: str,
        data: list[tuple[np.ndarray, dict[str, np.ndarray]]],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        backward: bool,
        gang_phase: str = "",
    ) -> ForwardBackwardOutput:
        if job_id in self._gangs:
            logprobs, metrics = self._gang_call(
                job_id,
                "forward_backward" if backward else "forward",
                gang_phase,
                "forward_backward",
                data=data,
                loss_fn=loss_fn,
                loss_fn_config=loss_fn_config,
                backward=backward,
            )
            return ForwardBackwardOutput(logprobs, metrics)
        with self._lock:
            job = self._job(job_id)
            tokens = sum(t.size for t, _ in data)
            with self.gate.phase(job_id, "forward_backward" if backward else "forward"):
                self._job_ready(job)
                with threads_for(self.threads.for_pass(tokens)):
                    out = job.forward_backward(
                        [Datum(tokens=t, inputs=i) for t, i in data],
                        loss_fn,
                        loss_fn_config,
                        backward=backward,
                        cancel_point=self._cancel_point(job_id),
                    )
            return ForwardBackwardOutput(out.logprobs, out.metrics)

    def optim_step(self, job_id: str, adam: AdamSettings, gang_phase: str = "") -> dict[str, float]:
        if job_id in self._gangs:
            return self._gang_call(job_id, "optim_step", gang_phase, "optim_step", adam=adam)
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "optim_step"):
                self._job_ready(job)
                return job.optim_step(adam)

    def save_state(
        self,
        job_id: str,
        path: str,
        include_optimizer: bool,
        meta: dict[str, Any],
        overwrite: bool = False,
        gang_phase: str = "",
    ) -> int:
        if job_id in self._gangs:  # rank 0 writes the single-device format; every rank answers its size
            return self._gang_call(
                job_id,
                "save_state",
                gang_phase,
                "save",
                path=path,
                include_optimizer=include_optimizer,
                overwrite=overwrite,
                meta=meta,
            )
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "save_state"):
                self._job_ready(job)
                return job.save(Path(path), include_optimizer=include_optimizer, overwrite=overwrite, extra_meta=meta)

    def load_state(self, job_id: str, path: str, include_optimizer: bool, gang_phase: str = "") -> None:
        if job_id in self._gangs:
            self._gang_call(job_id, "load_state", gang_phase, "load", path=path, include_optimizer=include_optimizer)
            return
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "load_state"):
                self._job_ready(job)
                try:
                    job.load(Path(path), include_optimizer=include_optimizer)
                except ckpt.CheckpointError as e:
                    raise UserError(str(e)) from None

    def export_weights(self, path: str, fmt: str | None = None) -> ExportedWeights:
        """The checkpoint at `path` as files other tools load (train/export.py: a PEFT adapter, a merged or a full
        fine-tuned Hugging Face model), written once next to it: its format and {file name: size}. Runs on the
        CPU from the files, in no phase: it never touches the device or a resident job."""
        try:
            base_model = read_meta(path)["base_model"]
            fmt, files = export.export_checkpoint(path, self._model_dir(base_model), fmt)
        except ckpt.CheckpointError as e:
            raise UserError(str(e)) from None
        return ExportedWeights(fmt, files)

    def memory(self) -> dict[str, int]:
        """The device memory this kernel admits jobs against (`budget_bytes`: $OPENRL_KERNEL_MEMORY_BYTES, else the
        device's), what its resident base models and jobs hold by its own count (`used_bytes`: base weights, and
        each job's weights, gradients and AdamW moments; an evicted job's state is in host memory and not counted)
        and what is left (`available_bytes`; on CUDA at most what the device has free, which also sees other
        processes). Read without the engine lock (metrics() calls it while a primitive runs)."""
        used = 0
        for key, host in list(self._hosts.items()):
            base = self._base_swapsets.get(key)
            if base is None or base.resident:
                used += memory.TRAIN_DTYPE_BYTES * host.card.num_parameters
        for job_id, job in list(self._jobs.items()):
            swap = self._swapsets.get(job_id)
            if swap is None or swap.resident:
                used += job.state_bytes
        used += sum(g.state_bytes for g in list(self._gangs.values()) if g.resident)  # each rank's share
        available = self.memory_budget - used
        free = _device_free_bytes(self.device)
        if free is not None:
            available = min(available, free)
        return {"budget_bytes": self.memory_budget, "used_bytes": used, "available_bytes": available}

    def _check_room(self, what: str, needed: int) -> None:
        m = self.memory()
        if needed > m["available_bytes"]:
            raise UserError(
                memory.no_room(
                    what,
                    needed,
                    m["available_bytes"],
                    f"its kernel ({self.device}, budget {memory.fmt_bytes(m['budget_bytes'])}, "
                    f"{memory.fmt_bytes(m['used_bytes'])} held by base models and resident jobs)",
                )
            )

    # --- gang jobs: this kernel's rank of a job sharded over several kernels ------------------------------
    def open_gang(self, job_id: str, world_size: int) -> GangAddress:
        """Rank 0's kernel, first: starts rank 0's worker and the gang's rendezvous (a TCPStore it serves); the
        other ranks' kernels meet it at the address returned. `create_gang_job` follows on every rank."""
        if world_size < 1:
            raise UserError(f"a gang has at least one rank, not {world_size}")
        self._retire(job_id)
        worker = self._start_worker(job_id, 0, world_size)
        try:
            port = worker.call("open", host=self.gang_host)
        except BaseException:
            worker.stop()
            raise
        with self._gang_lock:
            self._gangs[job_id] = _Gang(worker, 0, world_size)
        return GangAddress(self.gang_host, int(port))

    def create_gang_job(
        self,
        job_id: str,
        base_model: str,
        lora: LoraSettings | None,
        seed: int | None,
        slicing: JobSlicing | None,
        rank: int,
        world_size: int,
        master: str,
        gang_phase: str,
    ) -> ModelCard:
        """This kernel's rank of a gang job; returns once every rank has joined the gang's process group and the
        model is sharded (rank 0 reuses the worker `open_gang` started). A full fine-tuning job is admitted
        against its per-rank share of the state; nothing checks the whole gang beyond that."""
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is not one of a gang of {world_size}")
        model_dir = self._model_dir(base_model)
        if rank == 0:
            gang = self._gangs.get(job_id)
            if gang is None or gang.trained is not None or gang.world_size != world_size:
                raise UserError(f"gang job {job_id}: open_gang(world_size={world_size}) on rank 0's kernel first")
        else:
            self._retire(job_id)
            with self._gang_lock:
                gang = self._gangs[job_id] = _Gang(self._start_worker(job_id, rank, world_size), rank, world_size)
        self._bind(job_id, slicing)
        try:
            with self.gate.phase(job_id, "create_model", **_gang_kw(gang_phase, world_size)):
                if lora is None:
                    card = model_card(model_dir, name=base_model)
                    self._check_room(
                        f"rank {rank} of a full fine-tuning job on {base_model} over {world_size} devices",
                        memory.full_finetune_bytes(card.num_parameters) // world_size,
                    )
                created = self._worker_call(
                    gang,
                    "create",
                    model_dir=str(model_dir),
                    name=base_model,
                    job_id=job_id,
                    lora=lora,
                    seed=seed,
                    master=master,
                    tokens_per_microbatch=8192,
                )
        except BaseException:
            self._drop_gang(job_id)
            raise
        gang.trained, gang.state_bytes = created.trained, created.state_bytes
        return self.model_info(base_model)

    def _start_worker(self, job_id: str, rank: int, world_size: int) -> RankWorker:
        return RankWorker(
            job_id, rank, world_size, self.device, self.gang_timeout_s, self.threads.large, host=self.gang_host
        )

    def _retire(self, job_id: str) -> None:
        """A job of this id made again: the old one (single-device or gang) goes first."""
        if job_id in self._gangs:
            self._drop_gang(job_id)
        elif job_id in self._jobs:
            self.drop_job(job_id)

    def _worker_call(self, gang: _Gang, op: str, **kwargs) -> Any:
        try:
            return gang.worker.call(op, **kwargs)
        except GangUserError as e:
            raise UserError(str(e)) from None

    def _gang_call(self, job_id: str, kind: str, gang_phase: str, op: str, **kwargs) -> Any:
        """One primitive of a gang job on this kernel's rank, in the gang's phase (the gate grants every rank's
        slice together), without the engine lock."""
        self._cancel_point(job_id)()
        gang = self._gangs.get(job_id)
        if gang is None:
            raise NotFound(f"model {job_id} is not resident on its kernel")
        with self.gate.phase(job_id, kind, **_gang_kw(gang_phase, gang.world_size)):
            return self._worker_call(gang, op, **kwargs)

    def _drop_gang(self, job_id: str) -> None:
        with self._gang_lock:
            gang = self._gangs.pop(job_id, None)
            lane = self._gang_lanes.pop(job_id, None)
        if gang is not None:
            gang.worker.stop()
        if lane is not None:
            lane.shutdown(wait=False)  # this call may run on it
        if hasattr(self.gate, "forget"):
            self.gate.forget(job_id)
        self._cancelled.discard(job_id)

    def runs_inline(self, op: str, kwargs: dict[str, Any]) -> bool:
        """Whether the kernel runs a call at once on the call's own thread (`KernelServicer`): dropping a gang job,
        since its lane may hold a call that waits for a rank that is gone (for its gang's other slices), and the
        drop is what ends that wait (its lease closes, which fails the waiting acquire)."""
        return op == "drop_job" and kwargs.get("job_id") in self._gangs

    def executor_for(self, op: str, kwargs: dict[str, Any]) -> ThreadPoolExecutor | None:
        """Where the kernel runs a call (`KernelServicer`): a gang job's calls on a thread of their own, in the
        order they came (None: the kernel's one compute thread). A rank's call waits for the other ranks; on the
        compute thread it would stop every other call of this kernel, among them another gang's rank that those
        ranks' kernels may be waiting for (a deadlock between two gangs)."""
        job_id = kwargs.get("job_id")
        if not isinstance(job_id, str) or (op not in ("open_gang", "create_gang_job") and job_id not in self._gangs):
            return None
        with self._gang_lock:
            lane = self._gang_lanes.get(job_id)
            if lane is None:
                lane = self._gang_lanes[job_id] = ThreadPoolExecutor(1, thread_name_prefix=f"gang-{job_id[:24]}")
            return lane

    # --- time-slicing: the gate calls these when another job needs the device --------------------------
    def _swapset(self, job_id: str) -> SwapSet | None:
        """The job's own device state: its adapter + AdamW (LoRA), or its weights + AdamW (full fine-tuning)."""
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if job_id not in self._swapsets:
            swap = SwapSet(job_id, job.host.device)
            if job.adapter is not None:
                tag = f".{job.adapter}."
                swap.add_module(job.host.peft, params_only_matching=lambda name: tag in name)
            else:
                swap.add_module(job.module)
            swap.add_optimizer(lambda: job.optimizer)  # load() replaces the optimizer object
            self._swapsets[job_id] = swap
        return self._swapsets[job_id]

    def evict_job(self, job_id: str) -> None:
        """Moves the job's state to host memory. Called while another job's phase waits for the device, so
        it must not take the engine lock (that phase holds it); the job itself is between phases."""
        gang = self._gangs.get(job_id)
        if gang is not None:
            gang.evict()
            return
        with self._swap_lock:
            swap = self._swapset(job_id)
        if swap is not None and swap.resident:
            swap.evict()

    def restore_job(self, job_id: str) -> None:
        gang = self._gangs.get(job_id)
        if gang is not None:
            gang.restore()
            return
        swap = self._swapsets.get(job_id)
        if swap is not None and not swap.resident:
            swap.restore()

    def evict_shared(self) -> None:
        """Moves every base model's weights to host memory: a job of another process (another kernel on
        this accelerator) waits for the device. Like `evict_job`, it must not take the engine lock. Adapters
        of LoRA jobs stay registered with their own sets; each base model comes back before the next phase
        that runs on it (`_base_ready`)."""
        with self._swap_lock:
            swaps = [self._base_swapset(key) for key in list(self._hosts)]
        for swap in swaps:
            if swap.resident:
                swap.evict()
        for backend in self.sampler_backends:
            backend.sleep()

    def _base_swapset(self, key: str) -> SwapSet:
        """The base weights (parameters and buffers, not the adapters peft added) of one host."""
        swap = self._base_swapsets.get(key)
        if swap is None:
            host = self._hosts[key]
            swap = SwapSet(f"base:{host.card.name}", host.device)
            swap.add_module(host.model, params_only_matching=lambda name: "lora_" not in name)
            self._base_swapsets[key] = swap
        return swap

    def _base_ready(self, host: BaseModelHost) -> None:
        """Inside a phase: the host's base weights are on the device (restored if another kernel's job had
        them evicted)."""
        swap = self._base_swapsets.get(str(host.model_dir))
        if swap is not None and not swap.resident:
            swap.restore()

    def _job_ready(self, job: TrainJob) -> None:
        if job.adapter is not None:  # a full fine-tuning job runs on its own copy, not on the base
            self._base_ready(job.host)

    def swap_counters(self) -> SwapReport:
        """What moved so far: per base model ("base") and per job ("jobs"), evictions, restores and bytes."""

        def row(swap: SwapSet) -> SwapRow:
            c = swap.counters
            return SwapRow(
                c.evictions, c.restores, c.bytes_evicted, c.bytes_restored, c.bytes_retained, swap.resident, swap.nbytes
            )

        with self._swap_lock:
            base = {self._hosts[k].card.name: row(s) for k, s in self._base_swapsets.items()}
            jobs = {j: row(s) for j, s in self._swapsets.items()}
        for j, g in list(self._gangs.items()):
            jobs[j] = SwapRow(g.evictions, g.restores, g.bytes_evicted, g.bytes_restored, 0, g.resident, g.state_bytes)
        return SwapReport(base, jobs)

    # --- sampling ---------------------------------------------------------------------------------
    def snapshot_sampler(self, job_id: str, sampler_id: str) -> None:
        """A sampler fixed to the job's weights as they are now, whatever training does next."""
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "save_weights_for_sampler"):
                self._job_ready(job)
                self._samplers[sampler_id] = self._open(job.host.card.name, job.snapshot(), run=job_id, job=job)
            mine = [s for s, v in self._samplers.items() if v.job_id == job_id]
            for old in mine[:-SNAPSHOTS_PER_JOB]:
                self._release(self._samplers.pop(old))

    def save_sampler_weights(
        self, job_id: str, path: str, meta: dict[str, Any], overwrite: bool = True, gang_phase: str = ""
    ) -> int:
        if job_id in self._gangs:  # the whole weights, gathered: rank 0 writes them
            return self._gang_call(
                job_id, "save_weights_for_sampler", gang_phase, "save_sampler", path=path, overwrite=overwrite
            )
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "save_weights_for_sampler"):
                self._job_ready(job)
                return job.save_snapshot(job.snapshot(), Path(path), overwrite=overwrite)

    def open_sampler(
        self, sampler_id: str, base_model: str | None, path: str | None, owner: str | None = None
    ) -> ModelCard:
        """A sampler on the base model, or on the weights of a saved (sampler or training) checkpoint. Its phases
        run under its owner's one `samplers` lease (not a lease per sampler: an RL loop opens many)."""
        with self._lock:
            if path is not None:
                base_model = read_meta(path)["base_model"]
            self._model_dir(base_model)  # an unknown model is a user error before any phase
            if hasattr(self.gate, "bind"):
                self.gate.bind(sampler_id, owner=owner, lease=SAMPLER_LEASE)
            with self.gate.phase(sampler_id, "open_sampler"):
                try:
                    snapshot = load_snapshot(Path(path)) if path else None
                except ckpt.CheckpointError as e:
                    raise UserError(str(e)) from None
                made = self._open(base_model, snapshot, run=path or "")
            if sampler_id in self._samplers:
                self._release(self._samplers.pop(sampler_id))
            self._samplers[sampler_id] = made
            for old in [s for s, v in self._samplers.items() if v.job_id is None][:-LOOSE_SAMPLERS]:
                self.drop_sampler(old)
            return self.model_info(base_model)

    def sample(
        self,
        sampler_id: str,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        want_prompt_logprobs: bool,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
    ) -> SampleOutput:
        """`topk_prompt_logprobs` > 0: also the top-k (token, logprob) of every prompt position's next-token
        distribution (row 0: empty cells). `topk_sample_logprobs` > 0: each completion's `topk`, the same for its
        sampled tokens."""
        # Looked up without the engine lock: on a batching backend a sample must reach its batcher while a batch
        # (which holds the lock) runs, to join the next one.
        s = self._samplers.get(sampler_id)
        if s is None:
            raise NotFound(
                f"sampler {sampler_id} is not resident on this kernel "
                f"(only the last {SNAPSHOTS_PER_JOB} snapshots of a model are kept)"
            )
        cancel_point = self._cancel_point(sampler_id, s.job_id)
        cancel_point()
        key = s.job_id or sampler_id
        try:
            request = s.backend.request(
                s.handle, prompt, num_samples, params, want_prompt_logprobs, topk_prompt_logprobs, topk_sample_logprobs
            )
            out = s.backend.run(key, s.handle, request, cancel_point, partial(self._sample_phase, key), sampler_id)
        except SamplingError as e:
            raise UserError(str(e)) from None
        except SamplerGone as e:
            raise NotFound(str(e)) from None
        return _sample_output(out, want_prompt_logprobs, topk_sample_logprobs > 0)

    def _touch(self, sampler_id: str) -> None:
        """Most recently used (under the engine lock): the least recently used loose samplers are dropped first."""
        if sampler_id in self._samplers:
            self._samplers.move_to_end(sampler_id)

    def drop_sampler(self, sampler_id: str) -> None:
        with self._lock:
            s = self._samplers.pop(sampler_id, None)
            self._cancelled.discard(sampler_id)
            if s is not None:
                self._release(s)
            if s is not None and s.job_id is None and hasattr(self.gate, "forget"):
                self.gate.forget(sampler_id)  # its binding; the shared lease closes with the last one

    def _release(self, s: _Sampler) -> None:
        """What a dropped sampler held outside the dict (its adapter version in a vLLM engine)."""
        s.backend.release(s.handle)

    def _open(self, base_model: str, snapshot: dict | None, run: str, job: TrainJob | None = None) -> _Sampler:
        """A sampler from the first backend that serves this model and snapshot."""
        try:
            for backend in self.sampler_backends:
                handle = backend.open(base_model, snapshot, run, job)
                if handle is not None:
                    return _Sampler(backend, handle, job.job_id if job is not None else None)
        except SamplingError as e:
            raise UserError(str(e)) from None
        raise AssertionError("the torch backend serves every model")

    def _lease_of(self, key: str) -> Hashable:
        """The lease a phase key runs under, as the gate says (a gate that does not: the key itself)."""
        lease_of = getattr(self.gate, "lease_of", None)
        return lease_of(key) if lease_of is not None else key

    def _sample_phase(self, key: str, sampler_ids: list[str], work: Callable[[], None]) -> None:
        """A sample batch's phase (a backend's `in_phase`): the engine lock and the gate, as every primitive runs."""
        with self._lock, self.gate.phase(key, "sample"):
            for sampler_id in sampler_ids:
                self._touch(sampler_id)
            work()

    def metrics(self) -> KernelMetrics:
        """What /metrics shows of this kernel; read without the engine lock (a running call holds it)."""
        c = global_counters()
        jobs = list(self._jobs) + list(self._gangs)
        mem = self.memory()
        return KernelMetrics(
            jobs=len(jobs),
            job_ids=jobs,
            samplers=len(self._samplers),
            sampler=self.sampler,
            rss_bytes=_rss_bytes(),
            base_models=[h.card.name for h in list(self._hosts.values())],
            device_bytes=_device_bytes(self.device),
            device_free_bytes=_device_free_bytes(self.device),
            device_budget_bytes=mem["budget_bytes"],
            device_available_bytes=mem["available_bytes"],
            job_bytes={j: job.state_bytes for j, job in list(self._jobs.items())}
            | {j: g.state_bytes for j, g in list(self._gangs.items())},
            swap=SwapTotals(c.evictions, c.restores, c.bytes_evicted, c.bytes_restored, c.bytes_retained, c.seconds),
            sampling=self._sample_totals(),
        )

    def _sample_totals(self) -> SampleTotals:
        """The torch backend's batch counts (the vLLM backend's batches are vLLM's own)."""
        torch_backend = next(b for b in self.sampler_backends if isinstance(b, TorchBackend))
        return SampleTotals(torch_backend.batches, torch_backend.calls, torch_backend.mixed)

    def status(self) -> KernelStatus:
        with self._lock:
            return KernelStatus(
                device=self.device,
                jobs=sorted([*self._jobs, *self._gangs]),
                samplers=len(self._samplers),
                base_models=sorted(self._hosts),
                base_resident={self._hosts[k].card.name: s.resident for k, s in self._base_swapsets.items()},
            )


def _implements_the_kernel_api(engine: Engine) -> KernelApi:
    return engine  # checked by pyright: the engine has every operation of api.KernelApi, with its types


def _gang_kw(gang_phase: str, world_size: int) -> dict[str, Any]:
    """The gate's `gang` argument of a gang job's phase (passed only then: single-device phases call the gate as
    they always did)."""
    return {"gang": (gang_phase, world_size)}


@dataclass
class _Gang:
    """This kernel's rank of a gang job: its worker and what it reported."""

    worker: RankWorker
    rank: int
    world_size: int
    trained: TrainedWeights | None = None  # None until create_gang_job has made the rank
    state_bytes: int = 0  # this rank's share
    resident: bool = True
    evictions: int = 0
    restores: int = 0
    bytes_evicted: int = 0
    bytes_restored: int = 0

    def evict(self) -> None:
        """Called by the gate between phases (never under the engine lock); a lost rank has nothing to move."""
        if not self.resident or self.trained is None:
            return
        try:
            moved = self.worker.call("evict")
        except GangLost:
            return
        self.resident, self.evictions, self.bytes_evicted = False, self.evictions + 1, self.bytes_evicted + moved

    def restore(self) -> None:
        if self.resident:
            return
        try:
            moved = self.worker.call("restore")
        except GangLost:
            return
        self.resident, self.restores, self.bytes_restored = True, self.restores + 1, self.bytes_restored + moved


@dataclass
class _Sampler:
    backend: SamplerBackend
    handle: Any  # the backend's
    job_id: str | None  # the training job it was snapshotted from, if any


def _sample_output(out: SampleResult, want_prompt_logprobs: bool, topk: bool) -> SampleOutput:
    """A backend's result as the kernel protocol sends it (with `topk`: each completion's top-k as
    (num_tokens, k) matrices)."""
    return SampleOutput(
        [_completion(q, topk) for q in out.sequences],
        out.prompt_logprobs if want_prompt_logprobs else None,
        TopK(**out.topk_prompt) if out.topk_prompt is not None else None,
    )


def _completion(seq: SampledSequence, topk: bool) -> Completion:
    return Completion(
        seq.tokens,
        seq.logprobs,
        seq.stop_reason,
        TopK(np.asarray(seq.topk_ids, dtype=np.int32), np.asarray(seq.topk_logprobs, dtype=np.float32))
        if topk
        else None,
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:  # Linux: pages (size, resident, ...)
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _device_free_bytes(device: str) -> int | None:
    """Free memory on a CUDA device (None on CPU: the host's memory is not what placement weighs)."""
    if not device.startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def _device_total_bytes(device: str) -> int:
    """The whole device: a CUDA device's memory, or on CPU the machine's physical memory."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[1])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_bytes(device: str) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if device.startswith("cuda") else 0


def read_meta(path: str) -> dict:
    try:
        return ckpt.read_meta(Path(path))
    except ckpt.CheckpointError as e:
        raise UserError(str(e)) from None
