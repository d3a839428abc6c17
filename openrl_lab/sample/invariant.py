"""A batched row computes what it computes alone: the two things a `torch_sampler.Batch` does so that a request's
tokens and logprobs do not depend on who else is in its batch (and so a seeded RL run repeats exactly, whatever the
timing of its requests).

1. **Attention per run of rows.** Rows of different requests have caches of different lengths; in a batch they sit
   left-padded under a mask, and a masked softmax over a longer row sums in another order than the row alone. The
   attention function `install` puts on a model runs, while a `Layout` is active, each run of rows that share a
   cache length through the model's own attention on exactly their cache columns (no mask), as a request alone
   would: attention computes each row on its own, so neighbours of the same length may share the call.
2. **Enough rows for every matrix product.** The CPU BLAS (MKL) computes a row of `x @ W.T` alike for any number of
   rows from some minimum on, but by another path below it (below 4 rows at one thread, 12 at two: measured in
   `tests/sample/test_invariant.py`). While a `Layout` is active, `F.linear` on fewer than `MIN_ROWS` rows runs
   on rows padded with zeros up to it. From `MIN_ROWS` on it holds only with MKL in its strict reproducible mode,
   which kernels run in (`kernel/threads.py`, `reproducible_blas`): without it, an AVX-512 Xeon at 2 threads
   computed 16-96 rows of a product with 896 inputs by another path than 128 rows or more.

Everything else in a decoder (norms, activations, rotary embeddings, the logits' softmax) computes each row on its
own. Prefill runs prompts of one length together (no padding) under a `Layout` too. What is exact is checked on
the CPU: `tests/sample/test_invariant.py`, and a seeded RL loop through the kernel gives the same figures batched
and one call at a time (`tests/kernel/test_sample_batching.py`). On CUDA nothing is claimed (cuBLAS picks kernels
by shape).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch.nn import functional
from torch.overrides import TorchFunctionMode

NAME = "openrl_per_request"  # the attention implementation `install` registers and sets
MIN_ROWS = 16  # every matrix product in a layout's model call gets at least this many rows


@dataclass
class Layout:
    """The batch's runs of rows for one decoding step: (first row, end row, cache length after this step's token)
    each, in row order; empty during a prefill. `used` turns True once the model's attention read it (a model
    `install` could not reach never does)."""

    groups: Sequence[tuple[int, int, int]]
    used: bool = False


_LAYOUT: ContextVar[Layout | None] = ContextVar("openrl_lab_sample_layout", default=None)


_ATTENTION: dict = {}  # the attention functions `install` wrapped, by name (transformers is imported only there)


def _inner(module) -> Callable:
    """The attention `install` wrapped: a registered one (sdpa), or the model file's own `eager_attention_forward`."""
    name = getattr(module.config, "_openrl_inner_attention", "sdpa")
    if name != "eager":
        return _ATTENTION[name]
    return sys.modules[type(module).__module__].eager_attention_forward


def _per_request_attention(module, query, key, value, attention_mask, **kwargs):
    inner = _inner(module)
    layout = _LAYOUT.get()
    if layout is None or not layout.groups:  # training, prefill and uncached scoring: the model's own attention
        return inner(module, query, key, value, attention_mask, **kwargs)
    layout.used = True
    outputs = []
    for start, stop, length in layout.groups:
        k = key[start:stop, :, -length:].contiguous()
        v = value[start:stop, :, -length:].contiguous()
        out, _ = inner(module, query[start:stop], k, v, None, **kwargs)
        outputs.append(out)
    return torch.cat(outputs), None


def install(model) -> bool:
    """Give an HF model the per-request attention (wrapping the one it had). False when the model does not use
    transformers' attention interface (its batches then compute padded rows in other shapes)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        return True
    if current not in ("sdpa", "eager") or not hasattr(model, "set_attn_implementation"):
        return False
    if current == "sdpa":
        _ATTENTION[current] = ALL_ATTENTION_FUNCTIONS[current]
    elif not all(  # eager: each modeling file has its own function
        hasattr(sys.modules[type(m).__module__], "eager_attention_forward")
        for m in model.modules()
        if type(m).__name__.endswith("Attention")
    ):
        return False
    AttentionInterface.register(NAME, _per_request_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(NAME)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        return False
    for sub in model.modules():  # every (sub-)config that now names us remembers what it wraps
        c = getattr(sub, "config", None)
        if c is not None and getattr(c, "_attn_implementation", None) == NAME:
            c._openrl_inner_attention = current
    return True


class _PaddedLinear(TorchFunctionMode):
    """`functional.linear` on fewer than `MIN_ROWS` rows runs on zero-padded rows (see the module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is functional.linear:
            x = args[0]
            rows = x.numel() // x.shape[-1] if x.dim() > 1 and x.shape[-1] else MIN_ROWS
            if rows < MIN_ROWS:
                flat = x.reshape(rows, x.shape[-1])
                padded = torch.cat([flat, flat.new_zeros(MIN_ROWS - rows, flat.shape[-1])])
                out = func(padded, *args[1:], **kwargs)
                return out[:rows].reshape(*x.shape[:-1], out.shape[-1])
        return func(*args, **kwargs)


def padded_linears() -> contextlib.AbstractContextManager:
    """Within, inside a layout's model call: every `functional.linear` on fewer than `MIN_ROWS` rows runs on
    zero-padded rows, as a call of that few rows would alone (for a product on some rows of a larger call, which
    the layout does not pad: sample/adapter_batch.py's adapters). Outside a layout: nothing."""
    return _PaddedLinear() if _LAYOUT.get() is not None else contextlib.nullcontext()


@contextmanager
def layout(groups: Sequence[tuple[int, int, int]], rows: int) -> Iterator[Layout]:
    """Within: model calls compute each row as alone (`groups`: see `Layout`; `rows`: how many the call has)."""
    active = Layout(groups)
    token = _LAYOUT.set(active)
    try:
        if rows < MIN_ROWS:
            with _PaddedLinear():
                yield active
        else:
            yield active
    finally:
        _LAYOUT.reset(token)
