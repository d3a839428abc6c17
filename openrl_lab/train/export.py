"""Trained weights in the formats other tools load, written next to the checkpoint they come from.

- `peft`: a LoRA run's adapter as a PEFT directory (adapter_config.json + adapter_model.safetensors), loadable
  with `peft.PeftModel.from_pretrained(base, dir)`. The checkpoint's keys are already peft's saved-adapter names
  (`base_model.model.<module>.lora_A.weight`, trainer.py), so this is a copy plus the config.
- `merged`: a LoRA run's adapter merged into its base model (W + alpha/r * B @ A), as a Hugging Face model
  directory (config.json, model.safetensors, tokenizer files).

A LoRA on a mixture of experts' fused expert parameters (trainer.FUSED_EXPERT_PARAMS: its meta lists `experts`
among the targets) is exported through PEFT itself: the adapter config names them as `target_parameters` (what
`PeftModel.from_pretrained` needs to rebuild the same wrappers), and the merge is PEFT's `merge_and_unload`.
- `hf`: a full fine-tuning run's weights as a Hugging Face model directory.

Each is written once into `<checkpoint>/export/<format>/` (a temp sibling renamed into place, so a reader never
sees a half-written one) and reused after; deleting or overwriting the checkpoint takes it along.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from openrl_lab.train.checkpoint import WEIGHTS_FILE, CheckpointError, _fsync, read_checkpoint, read_meta
from openrl_lab.train.trainer import EXPERTS, LORA_ALPHA, _lora_config, fused_experts

EXPORT_DIR = "export"
PEFT, MERGED, HF = "peft", "merged", "hf"
FORMATS = (PEFT, MERGED, HF)


def formats_of(meta: dict) -> tuple[str, ...]:
    """The formats a checkpoint exports to, the default first."""
    return (PEFT, MERGED) if meta.get("lora") or meta.get("is_lora") else (HF,)


def export_checkpoint(checkpoint: str | Path, model_dir: str | Path, fmt: str | None = None) -> tuple[str, dict]:
    """(format, {file name: size in bytes}) of the checkpoint's export in `fmt` (None: its default), written now
    unless an earlier call wrote it. CheckpointError for a format the checkpoint has no export in."""
    checkpoint = Path(checkpoint)
    meta = read_meta(checkpoint)
    allowed = formats_of(meta)
    fmt = fmt or allowed[0]
    if fmt not in allowed:
        kind = "a LoRA" if allowed[0] == PEFT else "a full fine-tuning"
        raise CheckpointError(f"format {fmt!r} does not apply to {kind} checkpoint: use one of {', '.join(allowed)}")
    out = checkpoint / EXPORT_DIR / fmt
    if not out.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{fmt}.tmp-", dir=out.parent))
        try:
            weights, meta, _ = read_checkpoint(checkpoint, with_optimizer=False)
            {PEFT: _write_peft, MERGED: _write_merged, HF: _write_hf}[fmt](weights, meta, Path(model_dir), tmp)
            for f in tmp.iterdir():
                _fsync(f)
            try:
                os.rename(tmp, out)
            except OSError:  # another export of the same checkpoint got there first: keep that one
                if not out.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return fmt, {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()}


def lora_pairs(weights: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module path in the plain model (e.g. model.layers.0.self_attn.q_proj) -> (A [r, in], B [out, r])."""
    pairs = {}
    for key, a in weights.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
            pairs[module] = (a, weights[key.replace(".lora_A.", ".lora_B.")])
    if not pairs:
        raise CheckpointError(f"the checkpoint's {WEIGHTS_FILE} holds no LoRA weights")
    return pairs


def _on_experts(meta: dict) -> bool:
    return EXPERTS in (meta.get("lora_target_modules") or [])


def _experts_config(meta: dict, model_dir: Path, base=None):
    """The LoRA config a fused-experts checkpoint was trained with (the trainer's own rule), for PEFT."""
    if base is None:  # only the parameter names are needed: a model without storage
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    config = _lora_config(int(meta["lora_rank"]), list(meta["lora_target_modules"]), fused_experts(base)[0])
    config.lora_alpha = meta.get("lora_alpha") or LORA_ALPHA
    config.task_type, config.base_model_name_or_path = "CAUSAL_LM", meta["base_model"]
    return config


def _write_peft(weights: dict[str, torch.Tensor], meta: dict, model_dir: Path, out: Path) -> None:
    from peft import LoraConfig

    pairs = lora_pairs(weights)
    if _on_experts(meta):
        config = _experts_config(meta, model_dir)
    else:
        rank = int(next(iter(pairs.values()))[0].shape[0])
        targets = meta.get("lora_target_modules") or sorted({m.rsplit(".", 1)[-1] for m in pairs})
        config = LoraConfig(
            r=rank,
            lora_alpha=meta.get("lora_alpha") or LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=meta["base_model"],
        )
    config.save_pretrained(str(out))
    save_file(
        {k: v.contiguous() for k, v in weights.items() if ".lora_" in k},
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )


def _base_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _save_hf(model, model_dir: Path, out: Path) -> None:
    from openrl_lab.train.models import load_tokenizer

    model.save_pretrained(str(out), safe_serialization=True)
    load_tokenizer(model_dir).save_pretrained(str(out))


@torch.no_grad()
def _write_merged(weights: dict[str, torch.Tensor], meta: dict, model_dir: Path, out: Path) -> None:
    model = _base_model(model_dir)
    if _on_experts(meta):
        from peft import get_peft_model, set_peft_model_state_dict

        peft_model = get_peft_model(model, _experts_config(meta, model_dir, model))
        result = set_peft_model_state_dict(peft_model, {k: v for k, v in weights.items() if ".lora_" in k})
        if result.unexpected_keys:
            raise CheckpointError(f"the checkpoint's LoRA weights do not fit the model: {result.unexpected_keys[:3]}")
        _save_hf(peft_model.merge_and_unload(), model_dir, out)
        return
    pairs = lora_pairs(weights)
    scale = (meta.get("lora_alpha") or LORA_ALPHA) / int(next(iter(pairs.values()))[0].shape[0])
    if getattr(model.config, "tie_word_embeddings", False) and any(m.endswith("lm_head") for m in pairs):
        # The unembedding's update must not reach the embedding it shares its tensor with.
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    for module, (a, b) in pairs.items():
        weight = model.get_submodule(module).weight
        assert isinstance(weight, torch.Tensor)  # a Linear's weight (the stubs allow a submodule)
        weight += scale * (b.float() @ a.float()).to(weight.dtype)
    _save_hf(model, model_dir, out)


@torch.no_grad()
def _write_hf(weights: dict[str, torch.Tensor], meta: dict, model_dir: Path, out: Path) -> None:
    model = _base_model(model_dir)
    _, unexpected = model.load_state_dict(weights, strict=False)  # buffers (rotary tables) are not in it
    if unexpected:
        raise CheckpointError(f"the checkpoint has weights the base model lacks: {unexpected[:5]}")
    _save_hf(model, model_dir, out)
