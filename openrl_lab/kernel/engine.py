"""The kernel's engine: resident base models, jobs, sampler snapshots, and the primitives run on them.

Everything a kernel does for a job is one call here, wrapped in a phase (`PhaseGate`): that is the seam
where the time-slicing orchestrator acquires the group before the work and yields after it.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from openrl_lab.sample import torch_sampler
from openrl_lab.swap import SwapSet
from openrl_lab.train import checkpoint as ckpt
from openrl_lab.train.models import model_card, resolve_model_dir
from openrl_lab.train.trainer import (AdamSettings, BaseModelHost, Datum, LoraSettings, TrainJob, load_snapshot,
                                      save_snapshot)

# Unnamed sampler snapshots kept per training job (an RL loop makes one per step; older ones are dropped).
SNAPSHOTS_PER_JOB = 16


class UserError(ValueError):
    """A request the kernel refuses because of its content (reported to the caller as a 4xx / user error)."""


class NotFound(KeyError):
    """A job or sampler the kernel does not hold (e.g. lost in a restart)."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0])


class PhaseGate(Protocol):
    def phase(self, job_id: str, kind: str) -> contextlib.AbstractContextManager: ...


class OpenGate:
    """No arbitration: every phase runs at once. The orchestrator replaces this to time-slice jobs."""

    @contextlib.contextmanager
    def phase(self, job_id: str, kind: str) -> Iterator[None]:
        yield


class Engine:
    def __init__(self, home: Path, device: str = "cpu", gate: PhaseGate | None = None):
        self.home = home
        self.device = device
        self.gate = gate or OpenGate()
        self._hosts: dict[str, BaseModelHost] = {}  # by model directory
        self._jobs: dict[str, TrainJob] = {}
        # sampler_id -> a model call fixed to the weights it was made from; LRU within each source job
        self._samplers: OrderedDict[str, _Sampler] = OrderedDict()
        self._lock = threading.RLock()  # one primitive at a time: a kernel drives one group of devices
        self._swapsets: dict[str, SwapSet] = {}

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

    def model_info(self, base_model: str) -> dict:
        card = asdict(model_card(self._model_dir(base_model), name=base_model))
        return card | {"path": str(card["path"])}

    def _job(self, job_id: str) -> TrainJob:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"model {job_id} is not resident on its kernel (the kernel restarted since it was "
                           "created); load it from your last checkpoint (create_training_client_from_state)")
        return job

    # --- training ---------------------------------------------------------------------------------
    def create_job(self, job_id: str, base_model: str, lora: dict | None, seed: int | None = None) -> dict:
        with self._lock, self.gate.phase(job_id, "create_model"):
            host = self._host(base_model)
            if job_id in self._jobs:
                self.drop_job(job_id)
            self._jobs[job_id] = host.create_job(job_id, LoraSettings(**lora) if lora else None, seed=seed)
            return self.model_info(base_model)

    def create_job_from_checkpoint(self, job_id: str, path: str, with_optimizer: bool) -> dict:
        meta = read_meta(path)
        info = self.create_job(job_id, meta["base_model"], meta.get("lora"))
        self.load_state(job_id, path, with_optimizer)
        return info | {"base_model": meta["base_model"], "lora": meta.get("lora")}

    def drop_job(self, job_id: str) -> None:
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
                del self._samplers[sid]

    def forward_backward(self, job_id: str, data: list[tuple[np.ndarray, dict[str, np.ndarray]]], loss_fn: str,
                         loss_fn_config: dict | None, backward: bool) -> dict:
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "forward_backward" if backward else "forward"):
                out = job.forward_backward([Datum(tokens=t, inputs=i) for t, i in data], loss_fn, loss_fn_config,
                                           backward=backward)
            return {"logprobs": out.logprobs, "metrics": out.metrics}

    def optim_step(self, job_id: str, adam: dict) -> dict:
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "optim_step"):
                return job.optim_step(AdamSettings(**adam))

    def save_state(self, job_id: str, path: str, include_optimizer: bool, meta: dict, overwrite: bool = False) -> int:
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "save_state"):
                return job.save(Path(path), include_optimizer=include_optimizer, overwrite=overwrite,
                                extra_meta=meta)

    def load_state(self, job_id: str, path: str, include_optimizer: bool) -> None:
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "load_state"):
                try:
                    job.load(Path(path), include_optimizer=include_optimizer)
                except ckpt.CheckpointError as e:
                    raise UserError(str(e)) from None

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
        swap = self._swapset(job_id)
        if swap is not None and swap.resident:
            swap.evict()

    def restore_job(self, job_id: str) -> None:
        swap = self._swapsets.get(job_id)
        if swap is not None and not swap.resident:
            swap.restore()

    # --- sampling ---------------------------------------------------------------------------------
    def snapshot_sampler(self, job_id: str, sampler_id: str) -> None:
        """A sampler fixed to the job's weights as they are now, whatever training does next."""
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "save_weights_for_sampler"):
                self._samplers[sampler_id] = _Sampler(job.host, job.model_call(job.snapshot()), job_id)
            mine = [s for s, v in self._samplers.items() if v.job_id == job_id]
            for old in mine[:-SNAPSHOTS_PER_JOB]:
                del self._samplers[old]

    def save_sampler_weights(self, job_id: str, path: str, meta: dict, overwrite: bool = True) -> int:
        with self._lock:
            job = self._job(job_id)
            with self.gate.phase(job_id, "save_weights_for_sampler"):
                return save_snapshot(job.snapshot(), Path(path), base_model=job.host.card.name, overwrite=overwrite)

    def open_sampler(self, sampler_id: str, base_model: str | None, path: str | None) -> dict:
        """A sampler on the base model, or on the weights of a saved (sampler or training) checkpoint."""
        with self._lock:
            if path is not None:
                base_model = read_meta(path)["base_model"]
            host = self._host(base_model)
            with self.gate.phase(sampler_id, "open_sampler"):
                try:
                    call = host.model_call(load_snapshot(Path(path)) if path else None)
                except ckpt.CheckpointError as e:
                    raise UserError(str(e)) from None
            self._samplers[sampler_id] = _Sampler(host, call, None)
            return self.model_info(base_model) | {"base_model": base_model}

    def sample(self, sampler_id: str, prompt: list[int], num_samples: int, params: dict,
               want_prompt_logprobs: bool) -> dict:
        with self._lock:
            s = self._samplers.get(sampler_id)
            if s is None:
                raise NotFound(f"sampler {sampler_id} is not resident on this kernel "
                               f"(only the last {SNAPSHOTS_PER_JOB} snapshots of a model are kept)")
            self._samplers.move_to_end(sampler_id)
            card = s.host.card
            with self.gate.phase(s.job_id or sampler_id, "sample"):
                try:
                    seqs = torch_sampler.sample(
                        s.call, prompt, num_samples, torch_sampler.SamplingParams(**params),
                        eos_token_ids=card.eos_token_ids, max_context=card.max_context_length,
                        vocab_size=card.vocab_size, decode=s.host.tokenizer.decode, device=self.device)
                    plp = torch_sampler.prompt_logprobs(s.call, prompt, device=self.device) if want_prompt_logprobs else None
                except torch_sampler.SamplingError as e:
                    raise UserError(str(e)) from None
            return {"sequences": [(q.tokens, q.logprobs, q.stop_reason) for q in seqs], "prompt_logprobs": plp}

    def drop_sampler(self, sampler_id: str) -> None:
        with self._lock:
            self._samplers.pop(sampler_id, None)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"device": self.device, "jobs": sorted(self._jobs), "samplers": len(self._samplers),
                    "base_models": sorted(self._hosts)}


@dataclass
class _Sampler:
    host: BaseModelHost
    call: Callable
    job_id: str | None  # the training job it was snapshotted from, if any


def read_meta(path: str) -> dict:
    try:
        return ckpt.read_meta(Path(path))
    except ckpt.CheckpointError as e:
        raise UserError(str(e)) from None
