"""One training job sharded over a gang of processes with FSDP2: one rank of it per process.

A gang of N ranks is N processes whose default process group is the gang's world (`init_gang`: gloo on the CPU,
NCCL on CUDA, through a TCPStore). Each builds the same job (`ShardedJob`): the base model loaded into host
memory, the LoRA adapter added exactly as `BaseModelHost.create_job` adds it (same targets, rank and seed, so
the initial weights do not depend on N), then `fully_shard` over a 1-D DeviceMesh of the world (each decoder
layer, then the root), which leaves each rank 1/N of every parameter on its device. A `ShardedJob` is a
`TrainJob` whose parameters are DTensors: what TrainJob does per parameter (AdamW, clipping, checkpoint
names and meta, the optimizer's state dict by name) runs unchanged; what touches whole tensors or a batch is
overridden here.

Data-parallel: every rank receives the whole batch and takes its own contiguous share (`share`: the last
ranks one datum more when N does not divide the batch). Tinker's losses are sums over tokens, so FSDP's
gradient reduction sums (`set_gradient_divide_factor(1.0)`) instead of averaging: a step on N ranks is the
step on one device, up to the order of float additions. Every rank runs the same number of forward/backward
passes (FSDP's all-gathers and reduce-scatters are collectives): a rank whose share has fewer micro-batches
runs zero-weighted passes on one token. Per-datum logprobs and metrics are all-gathered in rank order (the
original datum order): every rank returns the same, whole answer.

Checkpoints are the single-device format (`train/checkpoint.py`): every rank gathers the full tensors, rank 0
writes them atomically with the meta a `TrainJob` writes, and its outcome (size or error) is broadcast, so all
ranks answer alike; a checkpoint from N ranks loads on one device and on M ranks. `load` reads the whole
checkpoint on every rank and keeps each rank's shard.

`evict`/`restore` move a rank's state (parameter shards, gradients, AdamW moments) to host memory and back,
bit-exact, at the storage level: `openrl_lab.swap` rebinds `tensor.data`, which would detach a DTensor's local
shard from the flat buffer FSDP2 all-gathers from (`FSDPParam._sharded_param_data`), and train may not import
swap anyway (they are one layer). Emptying a storage (`resize_(0)`) frees it under every view, FSDP's included,
and refilling it brings back the same bytes under the same tensor objects.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from openrl_lab.memory import STATE_COPIES
from openrl_lab.train.checkpoint import CheckpointError, write_checkpoint
from openrl_lab.train.hparams import LoraSettings
from openrl_lab.train.loss_spec import LOSS_SPECS, DataError, check_datum, resolve_config
from openrl_lab.train.losses import Mismatch, compute_loss
from openrl_lab.train.trainer import (
    BaseModelHost,
    Datum,
    ForwardOutput,
    TrainJob,
    WeightsSnapshot,
    _lora_config,
    _lora_targets,
    _microbatches,
)

DEFAULT_TIMEOUT_S = 60.0  # a collective that waits longer than this for a peer fails (gloo, NCCL)


class GangError(RuntimeError):
    """A collective of the gang failed: a peer is gone or did not answer in time. The process group is broken
    and the rank must be given up (its job lives on only in its last checkpoint)."""


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_gang(
    store: dist.Store,  # pyright: ignore[reportPrivateImportUsage]
    rank: int,
    world_size: int,
    device: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
):
    """This process's default process group: rank `rank` of `world_size`, met through `store` (a TCPStore whose
    server rank 0 holds). Returns once every rank has joined (or raises after `timeout_s`)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=torch.device(device) if device.startswith("cuda") else None,
    )


def share(n: int, rank: int, world_size: int) -> range:
    """The data of rank `rank`: a contiguous slice, the first ranks one longer when n does not divide."""
    return range(rank * n // world_size, (rank + 1) * n // world_size)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded one by one: the model's repeated blocks (transformers' `_no_split_modules`)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank must call it in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class ShardedJob(TrainJob):
    """One rank of a job sharded over the default process group (see the module's docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        job_id: str,
        lora: LoraSettings | None,
        seed: int | None = None,
        device: str = "cpu",
        name: str | None = None,
        tokens_per_microbatch: int = 8192,
    ):
        if not dist.is_initialized():
            raise RuntimeError("a ShardedJob needs the gang's process group (init_gang) first")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.mesh: DeviceMesh = init_device_mesh(torch.device(device).type, (self.world_size,))
        # Loaded into host memory; fully_shard moves each rank's shard alone to the device.
        host = BaseModelHost(model_dir, device="cpu", name=name, tokens_per_microbatch=tokens_per_microbatch)
        adapter = None
        if lora is None:  # the job's own weights: the host's model itself (the worker holds this job alone)
            module = host.model.requires_grad_(True)
        else:
            seed = lora.seed if lora.seed is not None else seed
            if seed is None:  # random (the SDK's None), drawn once: every rank must initialise the same adapter
                drawn: list[Any] = [secrets.randbits(63) if self.rank == 0 else None]
                dist.broadcast_object_list(drawn, src=0)
                seed = drawn[0]
            lora = replace(lora, seed=seed)
            assert lora.seed is not None
            config = _lora_config(lora.rank, _lora_targets(lora, host.mlp_targets), host.expert_params)
            adapter = host._add_adapter(config, lora.seed)  # as BaseModelHost.create_job: the same initial adapter
            module = host.peft
        assert module is not None  # a LoRA job's adapter lives in host.peft
        for layer in _decoder_layers(module):
            fully_shard(layer, mesh=self.mesh)
        fully_shard(module, mesh=self.mesh)
        self._fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for m in self._fsdp:
            m.set_gradient_divide_factor(1.0)  # sums: Tinker's losses are sums over tokens
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM; 1.0 needs no scaling)
        host.device = torch.device(device)
        super().__init__(host, job_id, module, adapter, lora)
        host.jobs[job_id] = self
        # This rank's share of the state (weights, gradients, AdamW's moments), not the whole job's.
        self.state_bytes = STATE_COPIES * sum(_local(p).numel() * p.element_size() for p in self.params.values())
        self._evicted: list[tuple[torch.UntypedStorage, torch.Tensor]] | None = None

    # ---- training primitives

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict | None = None,
        backward: bool = True,
        cancel_point=None,
    ) -> ForwardOutput:
        """TrainJob.forward_backward over this rank's share of `data`; the whole answer on every rank."""
        config = resolve_config(loss_fn, loss_fn_config)
        if not data:
            raise DataError("data is empty: forward_backward needs at least one datum")
        card = self.host.card
        # Every rank checks the whole batch before any collective: a bad datum fails all ranks alike.
        batch = [
            check_datum(i, d.tokens, d.inputs, loss_fn, card.vocab_size, card.max_context_length)
            for i, d in enumerate(data)
        ]
        groups = [
            list(
                _microbatches(
                    [batch[i] for i in share(len(batch), r, self.world_size)], self.host.tokens_per_microbatch
                )
            )
            for r in range(self.world_size)
        ]
        passes = max(len(g) for g in groups)  # every rank runs as many (FSDP's collectives pair up)
        mine = groups[self.rank]
        logprobs: list[np.ndarray] = []
        loss_sum = 0.0
        mismatch = Mismatch() if "logprobs" in LOSS_SPECS[loss_fn].required else None
        dummy = (np.zeros(1, np.int64), {"target_tokens": np.zeros(1, np.int64)})
        with self.host.lock:
            self._scope()
            for k in range(passes):
                group = mine[k] if k < len(mine) else None
                with torch.set_grad_enabled(backward):
                    if group is None:  # nothing of ours left: a pass that adds zero to every gradient
                        loss = self._logprobs([dummy])[0].sum() * 0.0
                    else:
                        per_datum = self._logprobs(group)
                        loss = sum(
                            compute_loss(loss_fn, lp, inputs, config)[0] for lp, (_, inputs) in zip(per_datum, group)
                        )
                    if backward:
                        loss.backward()
                if group is None:
                    continue
                loss_sum += float(loss.detach())
                logprobs += [lp.detach().to("cpu", torch.float32).numpy() for lp in per_datum]
                if mismatch is not None:
                    for lp, (_, inputs) in zip(per_datum, group):
                        mismatch.add(lp, inputs)
        self._reshard()
        mine_out = (
            logprobs,
            loss_sum,
            None if mismatch is None else (mismatch.kl_sum, mismatch.tokens, mismatch.max_abs),
        )
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine_out)
        metrics = {"loss:sum": float(sum(o[1] for o in every))}
        if mismatch is not None:
            total = Mismatch()
            for _, _, (kl, tokens, max_abs) in every:
                total.kl_sum += kl
                total.tokens += tokens
                total.max_abs = max(total.max_abs, max_abs)
            metrics.update(total.metrics())
        return ForwardOutput(logprobs=[lp for o in every for lp in o[0]], metrics=metrics)

    def _reshard(self) -> None:
        """Every module back to its shards. FSDP2 keeps the root's parameters gathered after a forward (for the
        backward that usually follows): after a forward alone they would stay whole, take device memory between
        phases and go stale when a load or an eviction changes the shards under them."""
        for m in self._fsdp:
            m.reshard()

    # optim_step: TrainJob's, unchanged. AdamW, get_total_norm and clip_grads_with_norm_ run on the DTensor
    # shards; the norm is a replicated DTensor (its square sums all-reduced), the same on every rank.

    # ---- whole tensors (collectives: every rank calls these in the same order)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The trainable weights, whole, on the CPU (every rank gets them)."""
        with self.host.lock:
            return {k: _full(p.detach()).cpu() for k, p in self.params.items()}

    def snapshot(self) -> WeightsSnapshot:
        return WeightsSnapshot(self.full_weights(), self, self.weights_version)

    def _optimizer_tensors(self) -> dict[str, torch.Tensor]:
        return {k: _full(v).cpu() for k, v in super()._optimizer_tensors().items()}

    def _on_rank0(self, write) -> int:
        """`write()` on rank 0 alone; its size, or its error raised on every rank."""
        outcome: list[Any] = [None]
        if self.rank == 0:
            try:
                outcome[0] = ("ok", int(write()))
            except (OSError, ValueError) as e:  # CheckpointError is a ValueError
                outcome[0] = ("error", type(e).__name__, str(e))
        dist.broadcast_object_list(outcome, src=0)
        result: Any = outcome[0]
        if result[0] == "ok":
            return result[1]
        if result[1] in ("CheckpointError", "CheckpointExistsError"):
            raise CheckpointError(result[2])
        raise OSError(f"rank 0 could not write: {result[1]}: {result[2]}")

    def save(
        self,
        directory: str | Path,
        include_optimizer: bool = True,
        overwrite: bool = False,
        extra_meta: dict | None = None,
    ) -> int:
        """TrainJob.save's checkpoint, written by rank 0 from the gathered tensors."""
        meta = {"kind": "training", **(extra_meta or {}), **self._meta()}
        with self.host.lock:
            weights = self.full_weights()
            opt = None
            if include_optimizer:
                opt, meta["optimizer_param_groups"] = self._optimizer_tensors(), self._optimizer_groups()
        return self._on_rank0(lambda: write_checkpoint(directory, weights, meta, opt, overwrite=overwrite))

    def save_snapshot(self, snapshot: dict[str, torch.Tensor], directory: str | Path, overwrite: bool = False) -> int:
        """The sampler checkpoint of a gathered snapshot (`snapshot()`), written by rank 0."""
        return self._on_rank0(lambda: TrainJob.save_snapshot(self, snapshot, directory, overwrite=overwrite))

    def load(self, directory: str | Path, include_optimizer: bool) -> None:
        """The whole checkpoint read on every rank, each keeping its shard. Every rank checks it first and they
        agree before any state changes, so a checkpoint one rank cannot read fails them all alike."""
        problem = None
        try:
            weights, meta, opt_state = self._read_fitting(directory, include_optimizer)
        except CheckpointError as e:
            problem = str(e)
        problems: list[Any] = [None] * self.world_size
        dist.all_gather_object(problems, problem)
        found = [p for p in problems if p is not None]
        if found:
            raise CheckpointError(found[0])
        by_index = list(self.params.values())
        self._reshard()
        with self.host.lock, torch.no_grad():
            for k, p in self.params.items():
                _local(p).copy_(self._shard_of(weights[k], p))
                p.grad = None
            self.optimizer = self._new_optimizer()
            self.step = 0
            self.weights_version += 1
            if opt_state is not None:
                for i, state in opt_state["state"].items():
                    p = by_index[i]
                    for key, value in state.items():
                        if key != "step" and isinstance(p, DTensor):  # the moments are sharded as their parameter
                            state[key] = self._shard_of(value, p, dtensor=True)
                self.optimizer.load_state_dict(opt_state)
                self.step = int(meta.get("optimizer_step") or 0)

    def _shard_of(self, full: torch.Tensor, like: torch.Tensor, dtensor: bool = False) -> torch.Tensor:
        """This rank's piece of a whole tensor, placed as `like` is (no communication: every rank has it all)."""
        if not isinstance(like, DTensor):
            return full.to(like.device)
        d = distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)
        return d if dtensor else d.to_local()

    # ---- what the gang does not do here

    def model_call(self, snapshot=None):
        raise NotImplementedError("a sharded job does not sample: save its weights for a sampler instead")

    def sampler_weights(self, snapshot):
        return None

    # ---- eviction

    def _storages(self) -> list[torch.UntypedStorage]:
        """Every storage of this rank's state: parameter shards (frozen ones too), gradients, AdamW state."""
        tensors: list[torch.Tensor] = []
        for p in self.module.parameters():
            tensors.append(_local(p))
            if p.grad is not None:
                tensors.append(_local(p.grad))
        for state in self.optimizer.state.values():
            tensors += [_local(v) for v in state.values() if isinstance(v, torch.Tensor)]
        seen, out = set(), []
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                out.append(s)
        return out

    @property
    def resident(self) -> bool:
        return self._evicted is None

    def evict(self) -> int:
        """This rank's state to host memory (pinned on CUDA), its device storages emptied; the bytes moved."""
        if self._evicted is not None:
            return 0
        self._reshard()
        moved = []
        pin = self.host.device.type == "cuda"
        for s in self._storages():
            view = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s)
            saved = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
            saved.copy_(view)
            moved.append((s, saved))
        if pin:
            torch.cuda.synchronize(self.host.device)
        for s, _ in moved:
            s.resize_(0)
        self._evicted = moved
        return sum(saved.numel() for _, saved in moved)

    def restore(self) -> int:
        """The evicted state back into the same storages, bit for bit; the bytes moved."""
        if self._evicted is None:
            return 0
        for s, saved in self._evicted:
            s.resize_(saved.numel())
            torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).copy_(saved)
        if self.host.device.type == "cuda":
            torch.cuda.synchronize(self.host.device)
        moved, self._evicted = self._evicted, None
        return sum(saved.numel() for _, saved in moved)


__all__ = ["DEFAULT_TIMEOUT_S", "GangError", "ShardedJob", "backend_for", "init_gang", "share"]
