"""Resident training jobs on a shared base model: the compute behind Tinker's training primitives.

One `BaseModelHost` holds one base model. LoRA jobs share it through peft (one named adapter per job,
each with its own AdamW over only its adapter); a full fine-tuning job gets its own copy of the weights.
Sampler snapshots are plain dicts of tensors keyed like peft's saved adapters (adapter name removed)
or like the model's own state dict, so they can be saved, loaded and run without touching live weights.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import re
import secrets
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from openrl_lab.memory import STATE_COPIES
from openrl_lab.train.checkpoint import CheckpointError, read_checkpoint, read_meta, write_checkpoint
from openrl_lab.train.hparams import AdamSettings, LoraSettings, TrainedWeights  # re-exported: the trainer's API
from openrl_lab.train.loss_spec import LOSS_SPECS, DataError, check_datum, resolve_config  # DataError re-exported
from openrl_lab.train.losses import Mismatch, compute_loss
from openrl_lab.train.models import load_tokenizer, model_card

LORA_ALPHA = 32  # fixed alpha, so the LoRA scale (alpha / rank) depends on the rank alone
ATTN_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES: tuple[str, ...] = ("lm_head",)
# Mixture-of-experts projections that transformers fuses into one 3-D parameter per layer ([experts, out, in]:
# Qwen3-MoE, Mixtral, gpt-oss, ...). With train_mlp, LoRA targets them by name (PEFT's target_parameters): each
# expert gets its own rank-r adapter on each. The router (`mlp.gate`) is never a target. Stated here rather than
# left to PEFT's own mapping of `gate_proj`/`up_proj`/`down_proj`, which gives gate_up_proj rank 2r per expert.
FUSED_EXPERT_PARAMS: tuple[str, ...] = ("gate_up_proj", "down_proj")
EXPERTS = "experts"  # the target name a LoRA snapshot's fused-expert adapters go under (lora_signature)

# (input_ids [B, T], past_key_values or None, attention_mask=None, position_ids=None) -> (logits [B, T, V] float32,
# past_key_values); the two keywords only for a sampler batch whose rows are padded (sample/torch_sampler.Batch).
ModelCall = Callable[..., tuple[torch.Tensor, Any]]


@dataclass(eq=False)
class SamplerWeights:
    """A sampler's weights as a batch of rows through several adapters of one host takes them
    (`sample/adapter_batch.py`): the base model (`tensors` None), or a LoRA snapshot (`tensors` by saved name, on
    the host's device; `signature`: its rank and targets), which the live job adapter `own` holds as they are
    while `live()` says so."""

    tensors: dict[str, torch.Tensor] | None = None
    signature: tuple[int, tuple[str, ...]] | None = None
    own: str | None = None
    live: Callable[[], bool] = lambda: False


@dataclass
class Datum:
    tokens: np.ndarray  # int64 [N] model input
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # each [N]; target_tokens int64, others float32


@dataclass
class ForwardOutput:
    logprobs: list[np.ndarray]  # float32 [N_i] per datum
    metrics: dict[str, float]


def _microbatches(items: list, token_budget: int):
    """Consecutive groups whose padded size (count x longest) stays within the budget."""
    group, longest = [], 0
    for item in items:
        n = item[0].size
        if group and max(longest, n) * (len(group) + 1) > token_budget:
            yield group
            group, longest = [], 0
        group.append(item)
        longest = max(longest, n)
    if group:
        yield group


# ------------------------------------------------------------------------------------ lora helpers

_LORA_KEY = re.compile(r"\.(lora_[AB])\.")


def _lora_config(rank: int, targets: list[str], expert_params: Sequence[str] = ()):
    """`targets`: module names; EXPERTS among them stands for `expert_params` (fused expert parameters' names)."""
    from peft import LoraConfig

    if not targets:
        raise ValueError("a LoRA job must train at least one of mlp, attn, unembed")
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    modules = [t for t in targets if t != EXPERTS]
    params = list(expert_params) if EXPERTS in targets else []
    return LoraConfig(
        r=rank,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=modules,
        target_parameters=params or None,
        bias="none",
    )


def _lora_targets(lora: LoraSettings, mlp: Sequence[str] = MLP_MODULES) -> list[str]:
    """The target names of a job's LoRA; `mlp`: what train_mlp means on its model (`BaseModelHost.mlp_targets`)."""
    return (
        list(ATTN_MODULES) * lora.train_attn + list(mlp) * lora.train_mlp + list(UNEMBED_MODULES) * lora.train_unembed
    )


def fused_experts(model: torch.nn.Module) -> tuple[list[str], int]:
    """A model's fused expert parameters as PEFT's target_parameters name them ("mlp.experts.gate_up_proj"), and
    its experts per layer (0: no fused experts)."""
    found, experts = set(), 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if p.ndim == 3 and parts[-1] in FUSED_EXPERT_PARAMS and len(parts) >= 3:
            found.add(".".join(parts[-3:]))
            experts = max(experts, p.shape[0])
    return sorted(found), experts


def lora_signature(snapshot: dict[str, torch.Tensor], experts: int = 0) -> tuple[int, list[str]] | None:
    """(rank, target names) of a LoRA snapshot (EXPERTS for fused expert adapters); None for full weights.
    `experts`: the model's experts per layer, which gives the rank of a snapshot of fused expert adapters alone."""
    a_keys = [k for k in snapshot if ".lora_A." in k]
    if not a_keys:
        return None
    targets: set[str] = set()
    rank = None
    for k in a_keys:
        path = k.split(".lora_A.")[0].split(".")
        if EXPERTS in path:  # .experts.lora_A / .experts.base_layer.lora_A (nested wrappers): r per expert
            targets.add(EXPERTS)
        else:
            targets.add(path[-1])
            rank = int(snapshot[k].shape[0])
    if rank is None:  # fused experts alone: lora_A is [experts * r, in]
        if experts < 1:
            raise ValueError("a LoRA snapshot of fused experts alone: its rank needs the model's expert count")
        rank = int(snapshot[a_keys[0]].shape[0]) // experts
    return rank, sorted(targets)


def _snapshot_meta(snapshot: dict[str, torch.Tensor], base_model: str, experts: int = 0) -> dict:
    sig = lora_signature(snapshot, experts)
    targets = sig[1] if sig else []
    mlp = (*MLP_MODULES, EXPERTS)
    return {
        "base_model": base_model,
        "lora": None
        if sig is None
        else {
            "rank": sig[0],
            "seed": None,
            "train_mlp": any(t in mlp for t in targets),
            "train_attn": any(t in ATTN_MODULES for t in targets),
            "train_unembed": any(t in UNEMBED_MODULES for t in targets),
        },
        "is_lora": sig is not None,
        "lora_rank": sig[0] if sig else None,
        "lora_alpha": LORA_ALPHA if sig else None,
        "lora_target_modules": targets,
        "train_attn": sig is None or any(t in ATTN_MODULES for t in targets),
        "train_mlp": sig is None or any(t in mlp for t in targets),
        "train_unembed": sig is None or any(t in UNEMBED_MODULES for t in targets),
    }


def save_snapshot(
    snapshot: dict[str, torch.Tensor],
    directory: str | Path,
    base_model: str,
    overwrite: bool = False,
    experts: int = 0,
) -> int:
    """A sampler-only checkpoint: weights and meta, no optimizer state (`experts`: see lora_signature)."""
    meta = {**_snapshot_meta(snapshot, base_model, experts), "kind": "sampler", "optimizer_step": None}
    return write_checkpoint(directory, snapshot, meta, None, overwrite=overwrite)


def load_snapshot(directory: str | Path, base_model: str | None = None) -> dict[str, torch.Tensor]:
    """The snapshot dict from a sampler (or training) checkpoint, checked against base_model if given."""
    weights, meta, _ = read_checkpoint(directory, with_optimizer=False)
    if base_model is not None and meta.get("base_model") != base_model:
        raise CheckpointError(
            f"checkpoint {directory} is for base model {meta.get('base_model')!r}, not {base_model!r}"
        )
    return weights


# ------------------------------------------------------------------------------------------ host


class BaseModelHost:
    """One resident base model and the jobs placed on it."""

    def __init__(
        self,
        model_dir: str | Path,
        device="cpu",
        dtype=torch.float32,
        name: str | None = None,
        tokens_per_microbatch: int = 8192,
    ):
        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.dtype = dtype
        self.card = model_card(self.model_dir, name)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.tokens_per_microbatch = tokens_per_microbatch
        self.model = self._load_model()  # the shared base; peft injects adapters into it in place
        self.model.requires_grad_(False)
        # What LoRA's train_mlp targets on this model: the MLP projections, and on a mixture of experts with fused
        # expert parameters those parameters (FUSED_EXPERT_PARAMS) and whatever dense MLP layers it has.
        self.expert_params, self.experts = fused_experts(self.model)
        self.mlp_targets: list[str] = list(MLP_MODULES)
        if self.expert_params:
            dense = {n.rsplit(".", 1)[-1] for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)}
            self.mlp_targets = [m for m in MLP_MODULES if m in dense] + [EXPERTS]
        self.peft = None  # the PeftModel wrapping self.model, made by the first LoRA job
        self.jobs: dict[str, TrainJob] = {}
        self.lock = threading.RLock()  # one op at a time: adapters are switched per op
        self._adapter_ids = itertools.count(1)
        self.adapters_changed = 0  # bumped whenever an adapter is added or deleted (TrainJob._scope)
        self._sampler_slots: dict[tuple, str] = {}
        self._slot_holds: dict[str, weakref.ref] = {}  # sampler slot -> the SamplerWeights copied into it
        # transformers renamed the KV-cache argument and output field (past_key_values -> cache) in 5.2x.
        forward_args = inspect.signature(type(self.model).forward).parameters
        self.cache_arg = "cache" if "cache" in forward_args else "past_key_values"

    def _load_model(self):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).to(self.device)
        return model.eval()  # no dropout anywhere: steps are deterministic

    def _add_adapter(self, config, seed: int) -> str:
        from peft import get_peft_model

        name = f"j{next(self._adapter_ids)}"
        self.adapters_changed += 1
        # peft initialises adapters on the CPU from the global generator, then moves them. Seed only the CPU
        # generator (torch.manual_seed would reseed every CUDA device too) inside fork_rng, which restores it:
        # creating a job never changes anyone else's random stream.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers deprecations peft trips over
            torch.default_generator.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(self.model, config, adapter_name=name)
            else:
                self.peft.add_adapter(name, config)
        return name

    def create_job(self, job_id: str, lora: LoraSettings | None, seed: int | None = None) -> TrainJob:
        """A LoRA job on the shared base, or (lora=None) a full fine-tuning job on its own copy.

        The adapter's seed is lora.seed, else `seed`, else a fresh random one (the SDK documents None as
        random); the seed used is kept in job.lora, so the job's checkpoints record it."""
        with self.lock:
            if job_id in self.jobs:
                raise ValueError(f"job {job_id!r} already exists")
            if lora is None:
                model = self._load_model().requires_grad_(True)
                job = TrainJob(self, job_id, model, None, None)
            else:
                seed = lora.seed if lora.seed is not None else seed
                if seed is None:
                    seed = secrets.randbits(63)  # fits int64 (JSON readers, SQLite) and torch's seed range
                lora = replace(lora, seed=seed)
                config = _lora_config(lora.rank, _lora_targets(lora, self.mlp_targets), self.expert_params)
                adapter = self._add_adapter(config, lora.seed)
                job = TrainJob(self, job_id, self.peft, adapter, lora)
            self.jobs[job_id] = job
            return job

    def fork_job(self, job_id: str, new_id: str) -> TrainJob:
        """A new job that carries on from job `job_id` exactly: its trainable weights, pending gradients,
        AdamW state and step count, copied on this host's device (no checkpoint round trip). A LoRA job's copy
        is a new adapter of the same settings on the shared base; a full fine-tuning job's is a copy of its
        whole model."""
        with self.lock:
            src = self.jobs[job_id]
            if new_id in self.jobs:
                raise ValueError(f"job {new_id!r} already exists")
            if src.adapter is None:  # its own model: a deep copy (gradients too) beats loading the base again
                job = self.jobs[new_id] = TrainJob(self, new_id, copy.deepcopy(src.module), None, None)
            else:
                job = self.create_job(new_id, src.lora)  # the same seed: the copy below overwrites it anyway
                with torch.no_grad():
                    for name, p in job.params.items():
                        q = src.params[name]
                        p.copy_(q)
                        p.grad = None if q.grad is None else q.grad.detach().clone()
            # deep: load_state_dict keeps tensors that already fit, so the moments would be shared otherwise
            job.optimizer.load_state_dict(copy.deepcopy(src.optimizer.state_dict()))
            job.step = src.step
            return job

    def get_job(self, job_id: str) -> TrainJob:
        return self.jobs[job_id]

    def drop_job(self, job_id: str) -> None:
        with self.lock:
            job = self.jobs.pop(job_id)
            if job.adapter is not None:
                self.adapters_changed += 1
                assert self.peft is not None  # made by the first LoRA job, kept while one lives
                if list(self.peft.peft_config) == [job.adapter]:
                    # peft cannot run with zero adapters: take the LoRA layers out, back to the plain model.
                    self.model = self.peft.unload()
                    self.peft = None
                else:
                    with warnings.catch_warnings():  # "adapter was active, now deleted": we set one per op anyway
                        warnings.simplefilter("ignore")
                        self.peft.delete_adapter(job.adapter)
            job.optimizer.state.clear()

    @contextmanager
    def _base_scope(self):
        with self.peft.disable_adapter() if self.peft is not None else nullcontext():
            yield

    def _full_names(self) -> dict[str, str]:
        """Base parameter names as in the plain model -> names now (peft renames wrapped layers)."""
        return {n.replace(".base_layer.", "."): n for n, _ in self.model.named_parameters() if "lora_" not in n}

    def _sampler_slot(self, rank: int, targets: Sequence[str], index: int = 0) -> str:
        """An adapter used only to run LoRA snapshots (no job trains it); `index` tells apart slots of one
        signature (a batch of several snapshots gives each its own)."""
        key = (rank, tuple(targets), index)
        if key not in self._sampler_slots:
            config = _lora_config(rank, list(targets), self.expert_params)
            self._sampler_slots[key] = self._add_adapter(config, seed=0)
        return self._sampler_slots[key]

    def sampler_weights(self, snapshot: dict[str, torch.Tensor] | None = None) -> SamplerWeights | None:
        """A sampler on the base model or on a LoRA snapshot (its tensors on this host's device), for a batch of
        several adapters; None where peft cannot mix adapters in a batch (full weights; fused experts)."""
        if self.expert_params:
            return None
        if snapshot is None:
            return SamplerWeights()
        sig = lora_signature(snapshot, self.experts)
        if sig is None:
            return None
        return SamplerWeights({k: v.to(self.device) for k, v in snapshot.items()}, (sig[0], tuple(sig[1])))

    def free_slot(self, signature: tuple[int, tuple[str, ...]], taken: set[str]) -> str:
        """A sampler slot of `signature` not in `taken` (a new one when all are)."""
        with self.lock:
            for index in itertools.count():
                slot = self._sampler_slot(*signature, index)
                if slot not in taken:
                    return slot
        raise AssertionError("unreachable")

    def load_slot(self, slot: str, weights: SamplerWeights) -> None:
        """Copy a snapshot's tensors into a sampler slot (skipped when the slot still holds them)."""
        held = self._slot_holds.get(slot)
        if held is not None and held() is weights:
            return
        assert self.peft is not None and weights.tensors is not None  # a slot is an adapter of a LoRA snapshot
        tag = f".{slot}."
        params = {n.replace(tag, ".", 1): p for n, p in self.peft.named_parameters() if ".lora_" in n and tag in n}
        if set(params) != set(weights.tensors):
            raise ValueError(
                f"snapshot does not fit sampler slot {slot}: {sorted(set(weights.tensors) ^ set(params))[:5]}"
            )
        with self.lock, torch.no_grad():
            for name, tensor in weights.tensors.items():
                params[name].copy_(tensor)
        self._slot_holds[slot] = weakref.ref(weights)

    def model_call(self, snapshot: dict[str, torch.Tensor] | None = None) -> ModelCall:
        """The base model (adapters off), or a saved snapshot (LoRA or full weights) on top of it."""
        if snapshot is None:
            return _model_call(self, self.model, dict, self._base_scope)
        sig = lora_signature(snapshot, self.experts)
        if sig is None:
            unknown = sorted(set(snapshot) - set(self._full_names()))
            if unknown:
                raise ValueError(f"snapshot has weights the base model lacks: {unknown[:5]}")
            weights = {k: v.to(self.device) for k, v in snapshot.items()}

            def params():  # names are looked up per call: a later LoRA job renames wrapped layers
                names = self._full_names()
                return {names[k]: v for k, v in weights.items()}

            return _model_call(self, self.model, params, self._base_scope)
        with self.lock:
            slot = self._sampler_slot(*sig)
        return _lora_call(self, slot, snapshot)


def _model_call(host: BaseModelHost, module, params: Callable[[], dict], scope) -> ModelCall:
    def call(input_ids: torch.Tensor, past_key_values=None, attention_mask=None, position_ids=None):
        kwargs = {"input_ids": input_ids.to(host.device), host.cache_arg: past_key_values, "use_cache": True}
        if attention_mask is not None:  # a batch of rows with padding (sample/torch_sampler.Batch)
            kwargs.update(attention_mask=attention_mask, position_ids=position_ids)
        with host.lock, torch.no_grad(), scope():
            weights = params()
            # functional_call swaps in the snapshot's tensors for this call only: no copy into live weights.
            out = functional_call(module, weights, (), kwargs, strict=False) if weights else module(**kwargs)
        return out.logits.float(), out[host.cache_arg]

    return call


def _lora_call(
    host: BaseModelHost, adapter: str, snapshot: dict | None, live: Callable[[], bool] = lambda: False
) -> ModelCall:
    """Calls through `adapter` with a snapshot's weights swapped in (functional_call), or with the adapter's own
    weights while `live()` says they equal the snapshot's."""
    peft = host.peft
    if peft is None:  # the last LoRA job was dropped, and the PeftModel with it
        raise RuntimeError(f"LoRA adapter {adapter} is gone: its job was dropped")
    params = {}
    if snapshot is not None:
        params = {_LORA_KEY.sub(rf".\1.{adapter}.", k, count=1): v.to(host.device) for k, v in snapshot.items()}
        names = {n for n, _ in peft.named_parameters()}
        unknown = sorted(set(params) - names)
        if unknown:
            raise ValueError(f"snapshot does not fit LoRA adapter {adapter}: {unknown[:5]}")

    @contextmanager
    def scope():
        if host.peft is not peft or adapter not in peft.peft_config:
            raise RuntimeError(f"LoRA adapter {adapter} is gone: its job was dropped")
        # set_adapter walks every module (~6 ms a call on the 1M model, a third of a decoding step): skipped when
        # the adapter is the active one, which leaves the model exactly as it is.
        if peft.active_adapter != adapter:
            peft.set_adapter(adapter)
        yield

    return _model_call(host, peft, lambda: {} if live() else params, scope)


# ------------------------------------------------------------------------------------------- job


class WeightsSnapshot(dict):
    """A job's trainable weights, copied (`TrainJob.snapshot`), marked with the job (weakly: a sampler may
    outlive it) and the weights version they were copied at."""

    def __init__(self, tensors: dict[str, torch.Tensor], job: TrainJob, version: int):
        super().__init__(tensors)
        self._job, self.version = weakref.ref(job), version

    def live_in(self, job: TrainJob) -> Callable[[], bool]:
        """A check that `job`'s live weights are still these (no optim_step or load since), so that calls may read
        them in place; always False for another job's snapshot. Calls run in the job's phase, so its state is on
        the device."""
        if self._job() is not job:
            return lambda: False
        return lambda: job.weights_version == self.version


class TrainJob:
    """One job's trainable state (adapter or full weights) and AdamW optimizer."""

    def __init__(self, host: BaseModelHost, job_id: str, module, adapter: str | None, lora: LoraSettings | None):
        self.host, self.job_id, self.module, self.adapter, self.lora = host, job_id, module, adapter, lora
        self.is_lora = lora is not None
        self.lora_rank = lora.rank if lora else None
        if adapter is None:
            self.params = dict(module.named_parameters())
        else:  # key = peft's saved-adapter name (adapter name removed); value = the live parameter
            tag = f".{adapter}."
            self.params = {
                n.replace(tag, ".", 1): p for n, p in module.named_parameters() if ".lora_" in n and tag in n
            }
        self.trained = self._trained()
        self.optimizer = self._new_optimizer()
        self.step = 0  # optim_step calls so far
        self.weights_version = 0  # bumped whenever the trainable weights change (optim_step, load)
        self._scoped: tuple[int, int] | None = None  # (the PeftModel, host.adapters_changed) when _scope last set it
        # What it holds on the device once it has stepped (weights, gradients, AdamW's two moments): counted
        # now, since an evicted job's tensors are empty placeholders.
        self.state_bytes = STATE_COPIES * sum(p.numel() * p.element_size() for p in self.params.values())

    def _trained(self) -> TrainedWeights:
        """What this job trains, counted from its trainable parameters (the router of a mixture of experts is
        never a LoRA target: it shows as not trained)."""
        host = self.host
        moe = host.experts > 0
        total = sum(p.numel() for p in self.params.values())
        if self.adapter is None:
            return TrainedWeights("full", total, host.card.num_parameters, {}, [], host.experts, True if moe else None)
        targets: dict[str, int] = {}
        for name, p in self.params.items():
            path = name.split(".lora_")[0].split(".")
            target = EXPERTS if EXPERTS in path else path[-1]  # fused experts' adapters may nest (base_layer)
            targets[target] = targets.get(target, 0) + p.numel()
        fused = sorted({n.rsplit(".", 1)[-1] for n in host.expert_params}) if EXPERTS in targets else []
        return TrainedWeights(
            "lora", total, host.card.num_parameters, targets, fused, host.experts, False if moe else None
        )

    def _new_optimizer(self):
        d = AdamSettings()
        return torch.optim.AdamW(
            list(self.params.values()),
            lr=d.learning_rate,
            betas=(d.beta1, d.beta2),
            eps=d.eps,
            weight_decay=d.weight_decay,
        )

    def _scope(self):
        if self.adapter is not None:
            peft = self.host.peft
            assert peft is not None  # a LoRA job's adapter lives in it
            # set_adapter also makes only this adapter require grad. It walks every module (~6 ms on the 1M
            # model, a quarter of a small step), so it is skipped while nothing can have changed that: the
            # adapter is still the active one and no adapter was added or deleted since this job last set it
            # (another adapter's set_adapter, a sampler's included, changes the active one).
            mark = (id(peft), self.host.adapters_changed)
            if peft.active_adapter != self.adapter or self._scoped != mark:
                peft.set_adapter(self.adapter)
                self._scoped = mark

    # ---- training primitives

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict | None = None,
        backward: bool = True,
        cancel_point: Callable[[], None] | None = None,
    ) -> ForwardOutput:
        """Per-datum logprobs of target_tokens and the summed loss; grads accumulate until optim_step.
        `cancel_point` runs before each micro-batch and may raise to abandon the call (its grads are then
        partial: only a run that is being freed is cancelled)."""
        config = resolve_config(loss_fn, loss_fn_config)
        if not data:
            raise DataError("data is empty: forward_backward needs at least one datum")
        batch = [
            check_datum(i, d.tokens, d.inputs, loss_fn, self.host.card.vocab_size, self.host.card.max_context_length)
            for i, d in enumerate(data)
        ]
        logprobs, loss_sum = [], 0.0
        # losses that weigh by the sampler's logprobs report how far the trainer's are from them
        mismatch = Mismatch() if "logprobs" in LOSS_SPECS[loss_fn].required else None
        with self.host.lock:
            self._scope()
            for group in _microbatches(batch, self.host.tokens_per_microbatch):
                if cancel_point is not None:
                    cancel_point()
                with torch.set_grad_enabled(backward):
                    per_datum = self._logprobs(group)
                    loss = sum(
                        compute_loss(loss_fn, lp, inputs, config)[0] for lp, (_, inputs) in zip(per_datum, group)
                    )
                    if backward:
                        loss.backward()
                loss_sum += float(loss.detach())
                logprobs += [lp.detach().to("cpu", torch.float32).numpy() for lp in per_datum]
                if mismatch is not None:
                    for lp, (_, inputs) in zip(per_datum, group):
                        mismatch.add(lp, inputs)
        return ForwardOutput(
            logprobs=logprobs, metrics={"loss:sum": loss_sum, **(mismatch.metrics() if mismatch else {})}
        )

    def _logprobs(self, group: list[tuple[np.ndarray, dict]]) -> list[torch.Tensor]:
        """log p(target_tokens[i] | tokens[:i+1]) per datum, from one right-padded batch."""
        longest = max(t.size for t, _ in group)
        pad = self.host.card.pad_token_id or 0
        ids = torch.full((len(group), longest), pad, dtype=torch.long)
        targets = torch.zeros((len(group), longest), dtype=torch.long)
        for row, (tokens, inputs) in enumerate(group):
            ids[row, : tokens.size] = torch.from_numpy(tokens)
            targets[row, : tokens.size] = torch.from_numpy(inputs["target_tokens"])
        # Right padding needs no attention mask: causal attention never looks ahead into the padding.
        logits = self.module(input_ids=ids.to(self.host.device), use_cache=False).logits.float()
        lp = logits.log_softmax(-1).gather(-1, targets.to(logits.device).unsqueeze(-1)).squeeze(-1)
        return [lp[row, : tokens.size] for row, (tokens, _) in enumerate(group)]

    def optim_step(self, adam: AdamSettings) -> dict[str, float]:
        """One AdamW step (decoupled weight decay) with optional global-norm clipping; zeroes grads."""
        if adam.learning_rate < 0 or adam.eps < 0 or adam.weight_decay < 0 or adam.grad_clip_norm < 0:
            raise ValueError(f"learning_rate, eps, weight_decay and grad_clip_norm must be >= 0: {adam}")
        if not (0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1): {adam}")
        with self.host.lock:
            params = [p for p in self.params.values() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.tensor(0.0)
            if adam.grad_clip_norm > 0 and params:
                torch.nn.utils.clip_grads_with_norm_(params, adam.grad_clip_norm, norm)
            for group in self.optimizer.param_groups:
                group.update(
                    lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
                )
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.weights_version += 1
        return {"grad_norm:mean": float(norm), "learning_rate:mean": float(adam.learning_rate)}

    # ---- snapshots for sampling

    def snapshot(self) -> WeightsSnapshot:
        """Detached clones of the trainable weights (what a sampler snapshot needs), marked with their version."""
        with self.host.lock:
            return WeightsSnapshot({k: p.detach().clone() for k, p in self.params.items()}, self, self.weights_version)

    def model_call(self, snapshot: dict[str, torch.Tensor] | None = None) -> ModelCall:
        """This job's model with live weights (None) or with a snapshot's weights. A snapshot of this job's own
        (`snapshot()`) runs on the live weights while they are still the ones it copied: the same numbers, without
        functional_call swapping the snapshot's tensors in on every call (it walks every module: ~40% of a
        decoding step on the 1M model)."""
        live = snapshot.live_in(self) if isinstance(snapshot, WeightsSnapshot) else lambda: False
        if self.adapter is not None:
            return _lora_call(self.host, self.adapter, snapshot, live)
        params = {}
        if snapshot is not None:
            unknown = sorted(set(snapshot) - set(self.params))
            if unknown:
                raise ValueError(f"snapshot does not fit job {self.job_id}: {unknown[:5]}")
            params = {k: v.to(self.host.device) for k, v in snapshot.items()}
        return _model_call(self.host, self.module, lambda: {} if live() else params, nullcontext)

    def sampler_weights(self, snapshot: dict[str, torch.Tensor] | None) -> SamplerWeights | None:
        """A snapshot of this LoRA job for a batch of several adapters (`BaseModelHost.sampler_weights`); the job's
        adapter holds it while the job has not stepped since."""
        if self.adapter is None or snapshot is None or self.host.expert_params:
            return None
        sig = lora_signature(snapshot, self.host.experts)
        assert sig is not None  # a LoRA job's snapshot holds its adapter's tensors
        live = snapshot.live_in(self) if isinstance(snapshot, WeightsSnapshot) else lambda: False
        tensors = {k: v.to(self.host.device) for k, v in snapshot.items()}
        return SamplerWeights(tensors, (sig[0], tuple(sig[1])), own=self.adapter, live=live)

    # ---- checkpoints

    def _meta(self) -> dict:
        lora = self.lora
        return {
            "base_model": self.host.card.name,
            "lora": asdict(lora) if lora else None,  # LoraSettings fields, to recreate a job from the file
            "is_lora": self.is_lora,
            "lora_rank": self.lora_rank,
            "lora_alpha": LORA_ALPHA if lora else None,
            "lora_target_modules": _lora_targets(lora, self.host.mlp_targets) if lora else [],
            "train_mlp": lora.train_mlp if lora else True,
            "train_attn": lora.train_attn if lora else True,
            "train_unembed": lora.train_unembed if lora else True,
            "optimizer_step": self.step,
        }

    # AdamW's state_dict numbers parameters by position; checkpoints name them instead (the names in
    # self.params, adapter name removed), so the state loads into any job of the same shape, whatever its
    # adapter slot or process. Tensors go to optimizer.safetensors as '<parameter name>/<state key>', the
    # param groups (plain numbers) to meta.json.

    def _optimizer_tensors(self) -> dict[str, torch.Tensor]:
        names = list(self.params)
        return {
            f"{names[i]}/{key}": value
            for i, state in self.optimizer.state_dict()["state"].items()
            for key, value in state.items()
        }

    def _optimizer_groups(self) -> list[dict]:
        names = list(self.params)
        return [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in self.optimizer.state_dict()["param_groups"]
        ]

    def _optimizer_state_dict(self, tensors: dict[str, torch.Tensor], meta: dict, directory) -> dict:
        """A state_dict for this job's optimizer from a checkpoint's tensors and meta."""
        groups = meta.get("optimizer_param_groups")
        if groups is None:  # an older checkpoint: the live optimizer's groups, the tensors renamed
            tensors, groups = _legacy_optimizer_tensors(tensors), self._optimizer_groups()
        index = {name: i for i, name in enumerate(self.params)}
        named = {key.rpartition("/")[0] for key in tensors} | {name for g in groups for name in g["params"]}
        if named - set(index):
            raise CheckpointError(
                f"checkpoint {directory}: optimizer state for parameters this job lacks: "
                f"{sorted(named - set(index))[:5]}"
            )
        state: dict[int, dict] = {}
        for key, value in tensors.items():
            name, _, state_key = key.rpartition("/")
            state.setdefault(index[name], {})[state_key] = value
        return {"state": state, "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups]}

    def save(
        self,
        directory: str | Path,
        include_optimizer: bool = True,
        overwrite: bool = False,
        extra_meta: dict | None = None,
    ) -> int:
        """A training checkpoint; extra_meta (JSON) is stored in meta.json beside what load() checks."""
        meta = {"kind": "training", **(extra_meta or {}), **self._meta()}
        with self.host.lock:
            opt = None
            if include_optimizer:
                opt, meta["optimizer_param_groups"] = self._optimizer_tensors(), self._optimizer_groups()
            return write_checkpoint(directory, self.snapshot(), meta, opt, overwrite=overwrite)

    def save_snapshot(self, snapshot: dict[str, torch.Tensor], directory: str | Path, overwrite: bool = False) -> int:
        return save_snapshot(snapshot, directory, self.host.card.name, overwrite=overwrite, experts=self.host.experts)

    def _check_fits(self, meta: dict, directory) -> None:
        mine = self._meta()
        for key in ("base_model", "is_lora", "lora_rank", "train_mlp", "train_attn", "train_unembed"):
            if meta.get(key) != mine[key]:
                raise CheckpointError(
                    f"checkpoint {directory} does not fit job {self.job_id}: "
                    f"{key} is {meta.get(key)!r} there and {mine[key]!r} here"
                )

    def _read_fitting(self, directory: str | Path, include_optimizer: bool) -> tuple[dict, dict, dict | None]:
        """A checkpoint's (weights, meta, optimizer state_dict or None), checked to fit this job; CheckpointError
        naming what does not."""
        weights, meta, opt = read_checkpoint(directory, with_optimizer=include_optimizer)
        self._check_fits(meta, directory)
        if include_optimizer and opt is None:
            raise CheckpointError(f"checkpoint {directory} has no optimizer state")
        if set(weights) != set(self.params):
            diff = sorted(set(weights) ^ set(self.params))
            raise CheckpointError(f"checkpoint {directory} weights do not match job {self.job_id}: {diff[:5]}")
        for k, p in self.params.items():
            if weights[k].shape != p.shape:
                raise CheckpointError(
                    f"checkpoint {directory}: {k} has shape {tuple(weights[k].shape)}, expected {tuple(p.shape)}"
                )
        return weights, meta, self._optimizer_state_dict(opt, meta, directory) if opt is not None else None

    def load(self, directory: str | Path, include_optimizer: bool) -> None:
        """Weights (and optionally AdamW state) from a checkpoint; without it the optimizer starts fresh."""
        weights, meta, opt_state = self._read_fitting(directory, include_optimizer)
        with self.host.lock, torch.no_grad():
            for k, p in self.params.items():
                p.copy_(weights[k])
                p.grad = None
            self.optimizer = self._new_optimizer()
            self.step = 0
            self.weights_version += 1
            if opt_state is not None:
                # load_state_dict moves each tensor to its parameter's device (step stays on the CPU)
                self.optimizer.load_state_dict(opt_state)
                self.step = int(meta.get("optimizer_step") or 0)


def _legacy_optimizer_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoints written before optimizer state_dicts were saved name AdamW's tensors
    '<state key>/<parameter name>' and store no param groups: renamed to today's '<parameter name>/<state key>'."""
    renamed = {}
    for key, value in tensors.items():
        state_key, _, name = key.partition("/")
        renamed[f"{name}/{state_key}"] = value
    return renamed


__all__ = [
    "AdamSettings",
    "BaseModelHost",
    "DataError",
    "Datum",
    "ForwardOutput",
    "LoraSettings",
    "ModelCall",
    "TrainJob",
    "TrainedWeights",
    "load_snapshot",
    "lora_signature",
    "read_meta",
    "save_snapshot",
]
