"""Rows of one batch through different LoRA adapters of one base model (peft's mixed-adapter batches): the torch
sampler decodes calls on several samplers of a base model (snapshots of several runs or checkpoints, the base model
beside them) as one batch, each row through its own sampler's weights.

For as long as a sampler's calls are in the batch its weights (`trainer.SamplerWeights`) hold one adapter of the
host: the live job adapter that holds them as they are (read in place; only inside that job's own phase, where its
state is on the device), or one of the host's sampler slots with the snapshot copied in (adapters no job trains; a
copy is skipped while the slot still holds that snapshot). Each row names its adapter (`BASE`: none), and a model
call passes the names to every LoRA layer through a forward pre-hook that reads them from a context variable. The
hook is put on each layer once: peft's own `adapter_names` argument walks every module on every call (~4 ms of a
~10 ms decoding step on the 1M model). Outside such a call the hook does nothing.

A row computes what it computes alone, bit for bit (`tests/kernel/test_sample_batching.py`): the base layer runs
on all rows, each adapter's product on its own rows, added elementwise, as peft adds one adapter's.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar

import torch

from openrl_lab.train.trainer import BaseModelHost, SamplerWeights

BASE = "__base__"  # peft's name for rows that take no adapter

_NAMES: ContextVar[list[str] | None] = ContextVar("openrl_lab_adapter_names", default=None)
_HOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host -> (its model, adapters_changed) last hooked


def _pass_names(module, args, kwargs):
    names = _NAMES.get()
    if names is not None:
        kwargs["adapter_names"] = names
    return args, kwargs


def _hook(host: BaseModelHost) -> None:
    """Every LoRA layer of the host's model has the hook (new layers come with new adapters)."""
    mark = (id(host.model), host.adapters_changed)
    if _HOOKED.get(host) == mark:
        return
    from peft.tuners.lora import LoraLayer

    for module in host.model.modules():
        if isinstance(module, LoraLayer) and not getattr(module, "_openrl_adapter_names", False):
            module.register_forward_pre_hook(_pass_names, with_kwargs=True)
            module._openrl_adapter_names = True
    _HOOKED[host] = mark


class AdapterBatch:
    """The adapters of one batch's samplers on `host`, and the model call that runs each row through its own."""

    def __init__(self, host: BaseModelHost):
        self.host = host
        self._held: dict[SamplerWeights, list] = {}  # weights -> [adapter, calls of it in the batch]

    def join(self, weights: SamplerWeights, resident: bool) -> str:
        """The adapter a call's rows run through. `resident`: the call runs in its own job's phase (its live
        adapter may then be read in place)."""
        held = self._held.get(weights)
        if held is not None:
            held[1] += 1
            return held[0]
        if weights.tensors is None:
            name = BASE
        else:
            taken = {a for a, _ in self._held.values()}
            if resident and self._in_place(weights, taken):
                assert weights.own is not None
                name = weights.own
            else:
                assert weights.signature is not None  # a LoRA snapshot's
                name = self.host.free_slot(weights.signature, taken)
                self.host.load_slot(name, weights)
        self._held[weights] = [name, 1]
        return name

    def _in_place(self, weights: SamplerWeights, taken: set[str]) -> bool:
        """Its job's adapter holds the snapshot as it is, and no other sampler of the batch runs through it."""
        own, peft = weights.own, self.host.peft
        return own is not None and own not in taken and peft is not None and own in peft.peft_config and weights.live()

    def leave(self, weights: SamplerWeights) -> None:
        held = self._held[weights]
        held[1] -= 1
        if not held[1]:
            del self._held[weights]

    def call(
        self,
        input_ids: torch.Tensor,
        past_key_values=None,
        attention_mask=None,
        position_ids=None,
        *,
        adapter_names: list[str],
    ):
        """A `trainer.ModelCall` whose rows each run through the adapter named for it."""
        host = self.host
        kwargs = {"input_ids": input_ids.to(host.device), host.cache_arg: past_key_values, "use_cache": True}
        if attention_mask is not None:
            kwargs.update(attention_mask=attention_mask, position_ids=position_ids)
        with host.lock, torch.no_grad():
            _hook(host)
            token = _NAMES.set(list(adapter_names))
            try:
                out = host.model(**kwargs)
            finally:
                _NAMES.reset(token)
        return out.logits.float(), out[host.cache_arg]
