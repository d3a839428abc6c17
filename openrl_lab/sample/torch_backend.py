"""The torch sampler backend as a kernel holds it (the default, and the fallback of `--sampler vllm`): a sampler is
a model call on one of the kernel's resident base models (`train.trainer.BaseModelHost`), with a snapshot's
adapter or weights on top, and `torch_sampler` draws from it.

Concurrent sample calls are one batch (`run`, called on each caller's thread): the first call leads and runs a
`torch_sampler.Batch` inside one phase; between its decoding steps it takes in the calls that arrived meanwhile
(an RL step's requests, which the gateway sends at once), up to `OPENRL_KERNEL_SAMPLE_BATCH_TOKENS`. Which calls
join: those on the same sampler under the same phase key; and on a base model whose LoRA adapters peft can mix in
a batch (all but fused experts), those on any sampler of that base model (LoRA snapshots, the base model itself)
whose phases run under the same lease, each row through its own sampler's weights (`sample/adapter_batch.py`;
`OPENRL_KERNEL_SAMPLE_MIX=0` turns it off). Calls of other leases wait for their own phase: a batch never lets one
lease's work run in another's slice, which the scheduler accounts, shares and caps. A call's rows leave the batch
when they are done, or when its cancel point raises (the others go on).

The base models are the kernel's (it loads them, swaps them out and back): the kernel passes in how to find one
(`host_of`) and how to make one resident (`ready`), and this module calls them; it knows nothing of jobs, leases or
the gate beyond that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from openrl_lab.sample import invariant, torch_sampler
from openrl_lab.sample.adapter_batch import AdapterBatch
from openrl_lab.sample.base import (
    InPhase,
    SamplerBackend,
    SampleRequest,
    SampleResult,
    SamplingParams,
    Ticket,
    validate,
)
from openrl_lab.sample.torch_sampler import Batch, Rows
from openrl_lab.settings import settings
from openrl_lab.train.trainer import BaseModelHost, ModelCall, SamplerWeights, TrainJob

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TorchHandle:
    host: BaseModelHost  # the resident base model it computes on
    call: ModelCall  # the model fixed to the sampler's weights
    needs_base: bool  # it runs on the host's base weights (all but a full fine-tuning job's snapshots)
    weights: SamplerWeights | None = None  # for a batch of several samplers' adapters; None: it batches alone


class TorchBackend:
    """`host_of(base_model)`: the kernel's resident host for a base model name; `ready(host)`: that host's weights
    on the device (after an eviction); `lease_of(key)`: the lease a phase key runs under (calls of one lease may
    share a batch across samplers)."""

    name = "torch"
    concurrent = True  # concurrent calls meet in `run` and decode as one batch

    def __init__(
        self,
        device: str,
        host_of: Callable[[str], BaseModelHost],
        ready: Callable[[BaseModelHost], None],
        lease_of: Callable[[str], Hashable] = lambda key: key,
    ):
        self.device, self._host_of, self._ready, self._lease_of = device, host_of, ready, lease_of
        self.batch_tokens = settings().kernel_sample_batch_tokens
        self.mix = settings().kernel_sample_mix
        self._mergeable: dict[BaseModelHost, bool] = {}  # caches of its model merge into a batch (sliding windows: no)
        self._cv = threading.Condition()
        self._queue: list[_Ticket] = []
        self._leading = False  # a call is running a batch (one at a time: a batch holds the kernel's lock)
        self._inexact: set[str] = set()  # models whose batched rows are not computed as alone (warned once)
        self.batches = 0  # phases run so far, the calls they served, and the batches of several samplers
        self.calls = 0
        self.mixed = 0

    def open(
        self, base_model: str, snapshot: Mapping[str, Any] | None, run: str, job: TrainJob | None = None
    ) -> TorchHandle:
        if job is not None:  # a live job's snapshot: on its own module (its adapter slot, or its full weights)
            self._exact(job.module if job.adapter is None else job.host.model, base_model)
            mixed = job.sampler_weights(snapshot) if self.mix else None
            return TorchHandle(job.host, job.model_call(snapshot), job.adapter is not None, mixed)
        host = self._host_of(base_model)
        self._ready(host)
        self._exact(host.model, base_model)
        weights = {k: v.to(host.device) for k, v in snapshot.items()} if snapshot is not None else None
        mixed = host.sampler_weights(weights) if self.mix else None
        return TorchHandle(host, host.model_call(weights), needs_base=True, weights=mixed)

    def _exact(self, model, name: str) -> None:
        """A batched request computes what it computes alone (`invariant`); said once when a model cannot."""
        if not invariant.install(model) and name not in self._inexact:
            self._inexact.add(name)
            log.warning(
                "%s: its attention is not transformers' AttentionInterface, so a request batched with others may "
                "differ from the same request alone in the last bits (sample/invariant.py)",
                name,
            )

    def request(
        self,
        h: TorchHandle,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        want_prompt_logprobs: bool,
        topk_prompt: int = 0,
        topk_sample: int = 0,
    ) -> SampleRequest:
        card = h.host.card
        stop = validate(prompt, num_samples, params, card.max_context_length, card.vocab_size, h.host.tokenizer.decode)
        return SampleRequest(
            [int(t) for t in prompt], num_samples, params, stop, None, want_prompt_logprobs, topk_prompt, topk_sample
        )

    def run(
        self,
        key: str,
        h: TorchHandle,
        request: SampleRequest,
        cancel_point: Callable[[], None],
        in_phase: InPhase,
        tag: Any = None,
    ) -> SampleResult:
        mine = _Ticket(key, h, request, cancel_point, tag)
        with self._cv:
            self._queue.append(mine)
            while self._leading and not mine.done:
                self._cv.wait()
            if mine.done:
                return mine.result()
            self._leading = True
            joins = self._joins(key, h)
            first = self._take(joins, room=None)
        served = list(first)
        try:
            in_phase([t.tag for t in first], lambda: self._decode(key, h, joins, first, served))
        except BaseException as e:  # noqa: BLE001 - the batch failed (the gate, a model): each call still in it gets it
            for t in served:
                if t.value is None and t.error is None:
                    t.error = e
        finally:
            with self._cv:
                for t in served:
                    t.done = True
                self._leading = False
                self.batches += 1
                self.calls += len(served)
                self._cv.notify_all()
        return mine.result()

    def _joins(self, key: str, h: TorchHandle) -> Callable[[_Ticket], bool]:
        """Which calls may share a batch led by a call on `h` under `key` (see the module's docstring)."""
        if h.weights is None:
            return lambda t: t.key == key and t.handle is h
        lease = self._lease_of(key)
        return lambda t: (
            (t.key == key and t.handle is h)
            or (t.handle.weights is not None and t.handle.host is h.host and self._lease_of(t.key) == lease)
        )

    def _take(self, joins: Callable[[_Ticket], bool], room: int | None) -> list[_Ticket]:
        """Queued calls that may join (under the condition's lock), in arrival order, up to `room` tokens (None: all
        of them)."""
        taken, left = [], []
        for t in self._queue:
            if joins(t) and (room is None or t.tokens <= room):
                taken.append(t)
                if room is not None:
                    room -= t.tokens
            else:
                left.append(t)
        self._queue = left
        return taken

    def _decode(
        self, key: str, h: TorchHandle, joins: Callable[[_Ticket], bool], first: list[_Ticket], served: list[_Ticket]
    ) -> None:
        """Inside the phase: decode `first` as one batch, taking in calls that arrive while it runs, until no call
        that may join is left."""
        if h.needs_base:
            self._ready(h.host)
        card = h.host.card
        batch = Batch(h.call, vocab_size=card.vocab_size, decode=h.host.tokenizer.decode, device=self.device)
        run = _Run(self, key, h, batch)
        pending, used = list(first), 0
        while True:
            # The first call always starts (even one larger than the budget); others join while they fit. A model
            # whose caches cannot merge (sliding windows) runs its calls one after another, in this phase.
            if pending and not batch and h.host not in self._mergeable:  # the first call alone: then we know
                t = pending.pop(0)
                rows = run.admit(t)
                if rows is not None:
                    batch.add(rows)
                    used += t.tokens
                    self._mergeable[h.host] = torch_sampler.mergeable(batch.cache)
            mergeable = self._mergeable.get(h.host, False)
            joining = []
            while pending and (not (batch or joining) or (mergeable and used + pending[0].tokens <= self.batch_tokens)):
                t = pending.pop(0)
                rows = run.admit(t)
                if rows is not None:
                    joining.append(rows)
                    used += t.tokens
            if joining:
                batch.add(*joining)  # prompts of one length prefilled together, then all decode together
            if not batch:
                if not pending:
                    with self._cv:  # calls that arrived as the last one ended
                        pending = self._take(joins, room=None)
                        served.extend(pending)
                    if not pending:
                        return
                continue
            for rows in batch.step():
                t = rows.owner
                used -= t.tokens
                run.left(rows)
                if rows.error is not None:
                    t.error = rows.error
                else:
                    t.value = SampleResult(rows.out, t.prompt_logprobs, t.topk_prompt)
            if mergeable and not pending:
                with self._cv:
                    pending = self._take(joins, room=self.batch_tokens - used)
                    served.extend(pending)

    def release(self, h: TorchHandle) -> None:
        """Nothing beyond the handle: its adapter slot on the host is reused by the next snapshot."""

    def sleep(self) -> None:
        """Nothing of its own on the device: the base weights are the kernel's, which evicts them itself."""


class _Run:
    """One batch's phase: the key and sampler of the call that leads it, its `Batch`, and the adapters of its
    samplers (`AdapterBatch`) where rows name theirs: from the start for a sampler that can (a LoRA snapshot
    copied into a sampler slot once runs faster than through functional_call, which walks every module at every
    step; the base model's rows skip peft's disable_adapter, which does too), or once a call on another sampler
    joins. A job's live snapshot in its own phase runs on its adapter as it is, through the leader's own call."""

    def __init__(self, backend: TorchBackend, key: str, h: TorchHandle, batch: Batch):
        self.backend, self.key, self.h, self.batch = backend, key, h, batch
        self.mix: AdapterBatch | None = None
        self.rows: list[Rows] = []  # admitted and not ended
        self.samplers: set[TorchHandle] = set()  # the samplers of its calls so far
        if h.weights is not None and not h.weights.live():
            self._mixing()

    def admit(self, t: _Ticket) -> Rows | None:
        """A call's rows for the batch (its prompt scored first when asked); None when it ended instead."""
        r, card = t.request, t.handle.host.card
        rows = Rows(r.prompt, r.num_samples, r.params, r.stop, card.eos_token_ids, r.topk_sample, t.cancel_point, t)
        try:
            t.cancel_point()
            rows.adapter = self._adapter(t)
            if r.prompt_logprobs or r.topk_prompt:
                call = t.handle.call if self.mix is None else partial(self.mix.call, adapter_names=[rows.adapter])
                scores = torch_sampler.prompt_scores(
                    call, r.prompt, topk=r.topk_prompt, vocab_size=card.vocab_size, device=self.backend.device
                )
                t.prompt_logprobs = scores.logprobs if r.prompt_logprobs else None
                if r.topk_prompt:
                    t.topk_prompt = {"token_ids": scores.topk_ids, "logprobs": scores.topk_logprobs}
        except Exception as e:  # noqa: BLE001 - cancelled before it started: that call's error, the others go on
            t.error = e
            self.left(rows)
            return None
        self.rows.append(rows)
        return rows

    def _adapter(self, t: _Ticket) -> str | None:
        """The adapter a call's rows run through: None while the leader's own call runs them."""
        self.samplers.add(t.handle)
        if len(self.samplers) == 2:
            self.backend.mixed += 1
        if self.mix is None:
            if t.handle is self.h:
                return None
            self._mixing()  # a second sampler: every row names its adapter from now on
        return self._join(t)

    def _mixing(self) -> None:
        self.mix = AdapterBatch(self.h.host)
        for rows in self.rows:
            rows.adapter = self._join(rows.owner)
        self.batch.call = self.mix.call

    def _join(self, t: _Ticket) -> str:
        assert self.mix is not None and t.handle.weights is not None  # only such calls join another's batch
        return self.mix.join(t.handle.weights, resident=t.key == self.key)

    def left(self, rows: Rows) -> None:
        """A call's rows left the batch (or never entered it): its adapter is free once no call of its uses it."""
        if rows in self.rows:
            self.rows.remove(rows)
        if self.mix is not None and rows.adapter is not None:
            self.mix.leave(rows.owner.handle.weights)
            rows.adapter = None


@dataclass(eq=False)
class _Ticket(Ticket):
    handle: TorchHandle
    prompt_logprobs: list[float] | None = None  # scored when it joined its batch
    topk_prompt: dict | None = None

    @property
    def tokens(self) -> int:
        """What it takes of a batch: rows x (prompt + new tokens)."""
        r = self.request
        return r.num_samples * (len(r.prompt) + r.params.max_tokens)


def _is_a_sampler_backend(backend: TorchBackend) -> SamplerBackend:
    return backend  # checked by pyright: TorchBackend has every method of base.SamplerBackend, with its types
