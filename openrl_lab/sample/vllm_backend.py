"""The vLLM sampler backend as a kernel holds it (`kernel --sampler vllm`): which vLLM engine serves what, the
fallback to the torch sampler, and the batcher that makes concurrent sample calls one vLLM batch.

- One engine per base model; each LoRA snapshot is a new adapter version on it. A full fine-tuning run's
  snapshots load into an engine of its own (at most VLLM_FULL_ENGINES per model, least recently used reused).
- A model or adapter vLLM cannot serve is refused (`SamplingError`), or with `fallback` left to the torch
  sampler (`open` answers None).
- `run` is the batcher: calls that arrive while a batch runs wait for it, then run together as the next one.

The kernel's engine (`kernel/engine.py`) holds one `VllmBackend` and calls it; this module knows nothing of
jobs, leases or the gate: the engine passes the phase in (`in_phase`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrl_lab.sample.base import (
    InPhase,
    SamplerBackend,
    SampleRequest,
    SampleResult,
    SamplerGone,
    SamplingError,
    SamplingParams,
    Ticket,
)
from openrl_lab.sample.vllm_sampler import (
    NotServable,
    VllmSampler,
    VllmUnavailable,
    vllm_version,
)
from openrl_lab.train.models import load_tokenizer, model_card
from openrl_lab.train.trainer import EXPERTS, LORA_ALPHA, lora_signature

log = logging.getLogger(__name__)

# vLLM engines kept for full fine-tuning runs' samplers (each holds a whole copy of the weights and a KV cache).
VLLM_FULL_ENGINES = 2


@dataclass
class VllmHandle:
    """A sampler on a vLLM engine: its adapter version there (None: the engine's own weights), or the weights
    version it was made for (a full fine-tuning run's engine)."""

    engine: VllmSampler
    lora_id: int | None = None
    version: int | None = None


class VllmBackend:
    """`model_dir`: the model directory a base model name resolves to (the kernel's rule). `fallback`: a model
    vLLM cannot serve goes to the torch sampler instead of being refused. `models`: engines started now (one
    vLLM cannot serve is refused now, unless `fallback`). Raises SamplingError when vLLM is not installed."""

    name = "vllm"
    concurrent = True  # sample calls meet in the batcher

    def __init__(
        self,
        home: Path,
        device: str,
        model_dir: Callable[[str], Path],
        fallback: bool = False,
        models: tuple[str, ...] = (),
    ):
        try:
            vllm_version()
        except VllmUnavailable as e:
            raise SamplingError(str(e)) from None
        self.home, self.device, self.fallback = home, device, fallback
        self._model_dir = model_dir
        self._engines: dict[str, Any] = {}  # model directory -> its VllmSampler, or the NotServable it raised
        self._full: OrderedDict[str, Any] = OrderedDict()  # a full fine-tuning run -> its own VllmSampler
        self._no_sleep_said = False
        self._batcher = _Batcher()
        root = home / "vllm"
        if root.is_dir():  # adapter files of kernels that are gone
            for old in root.glob("kernel-*"):
                pid = old.name.removeprefix("kernel-")
                if not (pid.isdigit() and Path(f"/proc/{pid}").exists()):
                    shutil.rmtree(old, ignore_errors=True)
        for name in models:
            self.engine(name)

    def _workdir(self, key: str) -> Path:
        return self.home / "vllm" / f"kernel-{os.getpid()}" / hashlib.sha256(key.encode()).hexdigest()[:16]

    def engine(self, base_model: str, run: str | None = None) -> VllmSampler | None:
        """The vLLM engine for this base model (or, with `run`, a full fine-tuning run's own); None when vLLM
        cannot serve the model and the torch sampler takes it."""
        model_dir = self._model_dir(base_model)
        cache, key = (self._engines, str(model_dir)) if run is None else (self._full, f"{model_dir}\0{run}")
        got = cache.get(key)
        if got is None and run is not None:
            # vLLM engines are never closed (dropping one tears down vLLM's process-wide state under the others): a
            # new run takes over the least recently used run engine of its model, whose samplers then get the
            # "weights were replaced" 404 at the run's first snapshot.
            mine = [k for k, e in cache.items() if k.startswith(f"{model_dir}\0") and isinstance(e, VllmSampler)]
            if len(mine) >= VLLM_FULL_ENGINES:
                got = cache.pop(mine[0])
        if got is None:
            card = model_card(model_dir, name=base_model)
            try:
                got = VllmSampler(
                    model_dir,
                    name=base_model,
                    device=self.device,
                    workdir=self._workdir(key),
                    vocab_size=card.vocab_size,
                    eos_token_ids=card.eos_token_ids,
                    max_context=card.max_context_length,
                    decode=load_tokenizer(model_dir).decode,
                    enable_lora=run is None,
                    weights_on_disk=run is None,
                )
            except NotServable as e:
                got = self._not_servable(e)
        cache[key] = got
        if run is not None:
            cache.move_to_end(key)
        return got if isinstance(got, VllmSampler) else None

    def _not_servable(self, e: Exception) -> Exception:
        """A model or adapter vLLM cannot serve: refused (SamplingError), or remembered for the torch sampler."""
        if not self.fallback:
            raise SamplingError(f"{e} (a kernel started with --sampler-fallback samples it with the torch sampler)")
        log.warning("%s: sampling it with the torch sampler (--sampler-fallback)", e)
        return e

    def open(self, base_model: str, snapshot: Mapping[str, Any] | None, run: str, job: Any = None) -> VllmHandle | None:
        """A sampler for the base model or a snapshot of it (LoRA: a new adapter version; full weights: loaded into
        the run's own engine); None when the torch sampler takes it."""
        weights = dict(snapshot) if snapshot is not None else None
        # (experts=1: a fused-experts-only adapter gets a signature, and is refused below, whatever its rank)
        signature = lora_signature(weights, experts=1) if weights is not None else None
        full = weights is not None and signature is None
        engine = self.engine(base_model, run=run if full else None)
        if engine is None:
            return None
        if signature is not None and EXPERTS in signature[1]:
            self._not_servable(NotServable(f"{base_model}: a LoRA on fused MoE experts is not loaded into vLLM yet"))
            return None
        try:
            if signature is not None:
                assert weights is not None
                return VllmHandle(engine, lora_id=engine.add_lora(weights, signature[0], LORA_ALPHA, signature[1]))
            if full:
                assert weights is not None
                engine.load_weights(weights)
            return VllmHandle(engine, version=engine.version)
        except NotServable as e:
            self._not_servable(e)
            return None

    def request(
        self,
        h: VllmHandle,
        prompt: list[int],
        num_samples: int,
        params: SamplingParams,
        want_prompt_logprobs: bool,
        topk_prompt: int = 0,
        topk_sample: int = 0,
    ) -> SampleRequest:
        """One sample call, checked (SamplingError names what is wrong; SamplerGone: its weights were replaced)."""
        if h.version is not None and h.version != h.engine.version:
            raise SamplerGone(
                "this sampler's weights were replaced: a vLLM engine holds only the latest snapshot of "
                "a full fine-tuning run; make a new sampler (save_weights_and_get_sampling_client)"
            )
        stop = h.engine.check(prompt, num_samples, params)
        return SampleRequest(
            list(prompt), num_samples, params, stop, h.lora_id, want_prompt_logprobs, topk_prompt, topk_sample
        )

    def run(
        self,
        key: str,
        h: VllmHandle,
        request: SampleRequest,
        cancel_point: Callable[[], None],
        in_phase: InPhase,
        tag: Any = None,
    ) -> SampleResult:
        """The request's result, generated in one batch with every call waiting on the same engine under the same
        phase `key`. `in_phase(tags, work)` runs `work` inside the batch's phase (the engine's lock and gate);
        `tags` are the batch's calls' `tag`s. `cancel_point` may raise to drop the call before its batch."""
        return self._batcher.run(key, h.engine, request, cancel_point, in_phase, tag)

    def release(self, h: VllmHandle) -> None:
        """What a dropped sampler held: its adapter version."""
        if h.lora_id is not None:
            h.engine.drop_lora(h.lora_id)

    def engines(self) -> list[VllmSampler]:
        return [e for e in [*self._engines.values(), *self._full.values()] if isinstance(e, VllmSampler)]

    def sleep(self) -> None:
        """Another job waits for the device: every engine sleeps (where vLLM can; said once where it cannot)."""
        for engine in self.engines():
            if not engine.sleep() and not engine.asleep and not self._no_sleep_said:
                self._no_sleep_said = True
                log.warning(
                    "vLLM engines stay resident when another job needs the device: vLLM has no sleep mode on %s",
                    self.device,
                )


class _Batcher:
    """Sample calls that arrive while a vLLM batch runs wait for it, then run together as the next batch: one
    `generate` for all waiting calls on the same engine under the same phase key (lease), so an RL step's
    prompts x samples are one vLLM batch. The thread whose call is not done yet leads the next batch."""

    def __init__(self):
        self._cv = threading.Condition()
        self._queue: list[Ticket] = []
        self._running = False

    def run(self, key, sampler, request, cancel_point, in_phase, tag):
        mine = Ticket(key, sampler, request, cancel_point, tag)
        with self._cv:
            self._queue.append(mine)
            while self._running and not mine.done:
                self._cv.wait()
            if mine.done:
                return mine.result()
            self._running = True
            batch = [t for t in self._queue if t.key == key and t.handle is sampler]
            self._queue = [t for t in self._queue if not (t.key == key and t.handle is sampler)]
        try:
            live = []
            for t in batch:
                try:
                    t.cancel_point()
                    if not sampler.has_version(t.request.lora_id):  # dropped while it waited
                        raise SamplerGone("the sampler was dropped while its request waited")
                    live.append(t)
                except Exception as e:  # noqa: BLE001 - cancelled or gone: that call's error, the others go on
                    t.error = e
            if live:

                def work() -> None:
                    for t, out in zip(live, sampler.generate([t.request for t in live])):
                        t.value = out

                in_phase([t.tag for t in live], work)
        except BaseException as e:  # every call of the batch gets the error
            for t in batch:
                if t.value is None and t.error is None:
                    t.error = e
            raise
        finally:
            with self._cv:
                for t in batch:
                    t.done = True
                self._running = False
                self._cv.notify_all()
        return mine.result()


def _is_a_sampler_backend(backend: VllmBackend) -> SamplerBackend:
    return backend  # checked by pyright: VllmBackend has every method of base.SamplerBackend, with its types
