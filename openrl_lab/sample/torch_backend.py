"""The torch sampler backend as a kernel holds it (the default, and the fallback of `--sampler vllm`): a sampler is
a model call on one of the kernel's resident base models (`train.trainer.BaseModelHost`), with a snapshot's
adapter or weights on top, and `torch_sampler` draws from it.

The base models are the kernel's (it loads them, swaps them out and back): the kernel passes in how to find one
(`host_of`) and how to make one resident (`ready`), and this module calls them; it knows nothing of jobs, leases or
the gate beyond that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from openrl_lab.sample import torch_sampler
from openrl_lab.sample.base import InPhase, SampleRequest, SampleResult, SamplingParams, validate
from openrl_lab.train.trainer import BaseModelHost, ModelCall, TrainJob


@dataclass
class TorchHandle:
    host: BaseModelHost  # the resident base model it computes on
    call: ModelCall  # the model fixed to the sampler's weights
    needs_base: bool  # it runs on the host's base weights (all but a full fine-tuning job's snapshots)


class TorchBackend:
    """`host_of(base_model)`: the kernel's resident host for a base model name; `ready(host)`: that host's weights
    on the device (after an eviction)."""

    name = "torch"
    concurrent = False  # one sample call at a time, under the kernel's lock

    def __init__(self, device: str, host_of: Callable[[str], BaseModelHost], ready: Callable[[BaseModelHost], None]):
        self.device, self._host_of, self._ready = device, host_of, ready

    def open(
        self, base_model: str, snapshot: Mapping[str, Any] | None, run: str, job: TrainJob | None = None
    ) -> TorchHandle:
        weights = dict(snapshot) if snapshot is not None else None
        if job is not None:  # a live job's snapshot: on its own module (its adapter slot, or its full weights)
            return TorchHandle(job.host, job.model_call(weights), needs_base=job.adapter is not None)
        host = self._host_of(base_model)
        self._ready(host)
        return TorchHandle(host, host.model_call(weights), needs_base=True)

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
            list(prompt), num_samples, params, stop, None, want_prompt_logprobs, topk_prompt, topk_sample
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
        out: list[SampleResult] = []
        in_phase([tag], lambda: out.append(self._generate(h, request, cancel_point)))
        return out[0]

    def _generate(self, h: TorchHandle, r: SampleRequest, cancel_point: Callable[[], None]) -> SampleResult:
        if h.needs_base:
            self._ready(h.host)
        card = h.host.card
        seqs = torch_sampler.sample(
            h.call,
            r.prompt,
            r.num_samples,
            r.params,
            eos_token_ids=card.eos_token_ids,
            max_context=card.max_context_length,
            vocab_size=card.vocab_size,
            decode=h.host.tokenizer.decode,
            device=self.device,
            cancel_point=cancel_point,
            topk_logprobs=r.topk_sample,
        )
        if not (r.prompt_logprobs or r.topk_prompt):
            return SampleResult(seqs, None)
        scores = torch_sampler.prompt_scores(
            h.call, r.prompt, topk=r.topk_prompt, vocab_size=card.vocab_size, device=self.device
        )
        topk = None
        if r.topk_prompt:
            topk = {"token_ids": scores.topk_ids, "logprobs": scores.topk_logprobs}
        return SampleResult(seqs, scores.logprobs if r.prompt_logprobs else None, topk)

    def release(self, h: TorchHandle) -> None:
        """Nothing beyond the handle: its adapter slot on the host is reused by the next snapshot."""

    def sleep(self) -> None:
        """Nothing of its own on the device: the base weights are the kernel's, which evicts them itself."""
