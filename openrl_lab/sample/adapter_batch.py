"""Rows of one batch through different LoRA adapters of one base model (peft's mixed-adapter batches): the torch
sampler decodes calls on several samplers of a base model (snapshots of several runs or checkpoints, the base model
beside them) as one batch, each row through its own sampler's weights.

For as long as a sampler's calls are in the batch its weights (`trainer.SamplerWeights`) hold one adapter of the
host: the live job adapter that holds them as they are (read in place; only inside that job's own phase, where its
state is on the device), or one of the host's sampler slots with the snapshot copied in (adapters no job trains; a
copy is skipped while the slot still holds that snapshot). Each row names its adapter (`BASE`: none).

A mixed model call (`AdapterBatch.call`) puts, for its duration only, a forward pre-hook on every LoRA layer
that passes the names as peft's `adapter_names`, and its own mixed forward (`_by_spans`) on each LoRA linear: a
call's rows sit together in the batch, so each adapter's rows are a few runs, found once per model call, and its
product runs on slices of them (views). peft's own `adapter_names` argument walks every module on every call
(~4 ms of a ~10 ms decoding step on the 1M model), and its mixed forward gathers each adapter's rows by a Python
list of indices and scatters them back in every layer (16 samplers' batch ran 2.8x slower than one sampler's).
Nothing stays on the layers after the call: hooks left in place slowed every later forward, training's too
(16 sample calls alone, one after another: 3.5 -> 5.0 s).

A row computes what it computes alone, bit for bit (`tests/kernel/test_sample_mixing.py`): the base layer runs
on all rows, each adapter's product on its own rows, added elementwise, as peft adds one adapter's.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from functools import partial

import torch
from peft.tuners.lora.layer import VARIANT_KWARG_KEYS, LoraLayer
from peft.tuners.lora.layer import Linear as LoraLinear

from openrl_lab.sample import invariant
from openrl_lab.train.trainer import BaseModelHost, SamplerWeights

BASE = "__base__"  # peft's name for rows that take no adapter


class _Names:
    """A model call's adapter per row, and the same as runs: (adapter, first row, row after the last)."""

    def __init__(self, names: list[str]):
        self.names = names
        self.spans: list[tuple[str, int, int]] = []
        for row, name in enumerate(names):
            if self.spans and self.spans[-1][0] == name:
                self.spans[-1] = (name, self.spans[-1][1], row + 1)
            else:
                self.spans.append((name, row, row + 1))


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host -> (model, adapters_changed, LoRA layers)


def _by_spans(layer, names: _Names, x: torch.Tensor, *args, adapter_names: list[str], **kwargs) -> torch.Tensor:
    """A LoRA linear's forward on rows of several adapters, each adapter's product on slices of its own rows."""
    if layer.lora_variant:  # DoRA & co: peft's own
        return type(layer)._mixed_batch_forward(layer, x, *args, adapter_names=adapter_names, **kwargs)
    for key in VARIANT_KWARG_KEYS:
        kwargs.pop(key, None)
    result = layer.base_layer(x, *args, **kwargs)
    for name, start, stop in names.spans:
        if name == BASE or name not in layer.lora_A:
            continue
        lora_a = layer.lora_A[name]
        rows = layer.lora_dropout[name](x[start:stop].to(lora_a.weight.dtype))
        # a few rows of a larger call: padded as a call of these rows would be alone (invariant.MIN_ROWS)
        with invariant.padded_linears():
            product = layer.lora_B[name](lora_a(rows)) * layer.scaling[name]
        result[start:stop] += product.to(result.dtype)
    return result


def _lora_layers(host: BaseModelHost) -> list[LoraLayer]:
    """The host model's LoRA layers (found again when adapters come or go)."""
    mark = (id(host.model), host.adapters_changed)
    cached = _LAYERS.get(host)
    if cached is None or cached[0] != mark:
        cached = _LAYERS[host] = (mark, [m for m in host.model.modules() if isinstance(m, LoraLayer)])
    return cached[1]


@contextlib.contextmanager
def _names_passed(host: BaseModelHost, names: _Names) -> Iterator[None]:
    """While inside: every LoRA layer takes `names` as its rows' adapters."""

    def pass_names(module, args, kwargs):
        return args, {**kwargs, "adapter_names": names.names}

    layers = _lora_layers(host)
    handles = [m.register_forward_pre_hook(pass_names, with_kwargs=True) for m in layers]
    ours = [m for m in layers if type(m) is LoraLinear]  # embeddings, convolutions, quantized layers: peft's own
    for m in ours:
        m._mixed_batch_forward = partial(_by_spans, m, names)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for m in ours:
            del m._mixed_batch_forward


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
        with host.lock, torch.no_grad(), _names_passed(host, _Names(list(adapter_names))):
            out = host.model(**kwargs)
        return out.logits.float(), out[host.cache_arg]
