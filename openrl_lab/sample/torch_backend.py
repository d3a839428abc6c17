"""The torch sampler backend as a kernel holds it (the default, and the fallback of `--sampler vllm`): a sampler is
a model call on one of the kernel's resident base models (`train.trainer.BaseModelHost`), with a snapshot's
adapter or weights on top, and `torch_sampler` draws from it.

Concurrent sample calls are one batch (`run`, called on each caller's thread): the first call leads and runs a
`torch_sampler.Batch` inside one phase; between its decoding steps it takes in the calls that arrived meanwhile on
the same sampler under the same phase key (an RL step's requests, which the gateway sends at once), up to
`OPENRL_KERNEL_SAMPLE_BATCH_TOKENS`. Calls on other samplers or keys wait for the next phase. A call's rows leave
the batch when they are done, or when its cancel point raises (the others go on).

The base models are the kernel's (it loads them, swaps them out and back): the kernel passes in how to find one
(`host_of`) and how to make one resident (`ready`), and this module calls them; it knows nothing of jobs, leases or
the gate beyond that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from openrl_lab.sample import invariant, torch_sampler
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
from openrl_lab.train.models import ModelCard
from openrl_lab.train.trainer import BaseModelHost, ModelCall, TrainJob

log = logging.getLogger(__name__)


@dataclass(eq=False)
class TorchHandle:
    host: BaseModelHost  # the resident base model it computes on
    call: ModelCall  # the model fixed to the sampler's weights
    needs_base: bool  # it runs on the host's base weights (all but a full fine-tuning job's snapshots)
    mergeable: bool | None = None  # its caches merge into a batch (torch_sampler.mergeable); None: not seen yet


class TorchBackend:
    """`host_of(base_model)`: the kernel's resident host for a base model name; `ready(host)`: that host's weights
    on the device (after an eviction)."""

    name = "torch"
    concurrent = True  # concurrent calls meet in `run` and decode as one batch

    def __init__(self, device: str, host_of: Callable[[str], BaseModelHost], ready: Callable[[BaseModelHost], None]):
        self.device, self._host_of, self._ready = device, host_of, ready
        self.batch_tokens = settings().kernel_sample_batch_tokens
        self._cv = threading.Condition()
        self._queue: list[_Ticket] = []
        self._leading = False  # a call is running a batch (one at a time: a batch holds the kernel's lock)
        self._inexact: set[str] = set()  # models whose batched rows are not computed as alone (warned once)
        self.batches = 0  # phases run so far, and the calls they served
        self.calls = 0

    def open(
        self, base_model: str, snapshot: Mapping[str, Any] | None, run: str, job: TrainJob | None = None
    ) -> TorchHandle:
        if job is not None:  # a live job's snapshot: on its own module (its adapter slot, or its full weights)
            self._exact(job.module if job.adapter is None else job.host.model, base_model)
            return TorchHandle(job.host, job.model_call(snapshot), needs_base=job.adapter is not None)
        weights = dict(snapshot) if snapshot is not None else None
        host = self._host_of(base_model)
        self._ready(host)
        self._exact(host.model, base_model)
        return TorchHandle(host, host.model_call(weights), needs_base=True)

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
            first = self._take(key, h, room=None)
        served = list(first)
        try:
            in_phase([t.tag for t in first], lambda: self._decode(key, h, first, served))
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

    def _take(self, key: str, h: TorchHandle, room: int | None) -> list[_Ticket]:
        """Queued calls on this sampler under this key (under the condition's lock), in arrival order, up to `room`
        tokens (None: all of them)."""
        taken, left = [], []
        for t in self._queue:
            if t.key == key and t.handle is h and (room is None or t.tokens <= room):
                taken.append(t)
                if room is not None:
                    room -= t.tokens
            else:
                left.append(t)
        self._queue = left
        return taken

    def _decode(self, key: str, h: TorchHandle, first: list[_Ticket], served: list[_Ticket]) -> None:
        """Inside the phase: decode `first` as one batch, taking in calls that arrive while it runs, until no call on
        this sampler and key is left."""
        if h.needs_base:
            self._ready(h.host)
        card = h.host.card
        batch = Batch(h.call, vocab_size=card.vocab_size, decode=h.host.tokenizer.decode, device=self.device)
        pending, used = list(first), 0
        while True:
            # The first call always starts (even one larger than the budget); others join while they fit. A model
            # whose caches cannot merge (sliding windows) runs its calls one after another, in this phase.
            if pending and not batch and h.mergeable is None:  # the first call alone: then we know
                t = pending.pop(0)
                rows = self._admit(t, card)
                if rows is not None:
                    batch.add(rows)
                    used += t.tokens
                    h.mergeable = torch_sampler.mergeable(batch.cache)
            joining = []
            while pending and (
                not (batch or joining) or (h.mergeable and used + pending[0].tokens <= self.batch_tokens)
            ):
                t = pending.pop(0)
                rows = self._admit(t, card)
                if rows is not None:
                    joining.append(rows)
                    used += t.tokens
            if joining:
                batch.add(*joining)  # prompts of one length prefilled together, then all decode together
            if not batch:
                if not pending:
                    with self._cv:  # calls that arrived as the last one ended
                        pending = self._take(key, h, room=None)
                        served.extend(pending)
                    if not pending:
                        return
                continue
            for rows in batch.step():
                t = rows.owner
                used -= t.tokens
                if rows.error is not None:
                    t.error = rows.error
                else:
                    t.value = SampleResult(rows.out, t.prompt_logprobs, t.topk_prompt)
            if h.mergeable and not pending:
                with self._cv:
                    pending = self._take(key, h, room=self.batch_tokens - used)
                    served.extend(pending)

    def _admit(self, t: _Ticket, card: ModelCard) -> Rows | None:
        """A call's rows for the batch (its prompt scored first when asked); None when it ended instead."""
        r = t.request
        try:
            t.cancel_point()
            if r.prompt_logprobs or r.topk_prompt:
                scores = torch_sampler.prompt_scores(
                    t.handle.call, r.prompt, topk=r.topk_prompt, vocab_size=card.vocab_size, device=self.device
                )
                t.prompt_logprobs = scores.logprobs if r.prompt_logprobs else None
                if r.topk_prompt:
                    t.topk_prompt = {"token_ids": scores.topk_ids, "logprobs": scores.topk_logprobs}
        except Exception as e:  # noqa: BLE001 - cancelled before it started: that call's error, the others go on
            t.error = e
            return None
        return Rows(r.prompt, r.num_samples, r.params, r.stop, card.eos_token_ids, r.topk_sample, t.cancel_point, t)

    def release(self, h: TorchHandle) -> None:
        """Nothing beyond the handle: its adapter slot on the host is reused by the next snapshot."""

    def sleep(self) -> None:
        """Nothing of its own on the device: the base weights are the kernel's, which evicts them itself."""


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
