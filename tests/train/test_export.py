"""Exports of checkpoints (train/export.py) loaded by plain peft / transformers give the trainer's logits."""

from __future__ import annotations

import pytest
import torch

from openrl_lab.train.checkpoint import CheckpointError
from openrl_lab.train.export import export_checkpoint
from openrl_lab.train.trainer import LoraSettings

IDS = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 11]])


def _perturbed(job, seed: int = 0):
    """A job whose trainable weights moved off their initial values (LoRA B starts at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in job.params.values():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return job


def _logits(call) -> torch.Tensor:
    return call(IDS, None)[0][0]


def test_lora_exports_load_with_plain_peft_and_transformers(host, tiny_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    job = _perturbed(host.create_job("j", LoraSettings(rank=4)))
    job.save(tmp_path / "ck")
    want = _logits(job.model_call())
    fmt, files = export_checkpoint(tmp_path / "ck", tiny_dir)
    assert fmt == "peft" and set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, tmp_path / "ck" / "export" / "peft").eval()
    with torch.no_grad():
        got = peft(IDS).logits[0]
    assert (got - want).abs().max() < 1e-5

    _, files = export_checkpoint(tmp_path / "ck", tiny_dir, "merged")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ck" / "export" / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        got = merged(IDS).logits[0]
    assert (got - want).abs().max() < 1e-4  # merging reorders the float sums

    before = (tmp_path / "ck" / "export" / "peft" / "adapter_model.safetensors").stat().st_mtime_ns
    export_checkpoint(tmp_path / "ck", tiny_dir, "peft")  # written once, then reused
    assert (tmp_path / "ck" / "export" / "peft" / "adapter_model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(CheckpointError, match="'hf' does not apply to a LoRA checkpoint: use one of peft, merged"):
        export_checkpoint(tmp_path / "ck", tiny_dir, "hf")


def test_full_fine_tuning_exports_a_hugging_face_model(host, tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = _perturbed(host.create_job("full", None), seed=1)
    job.save(tmp_path / "ck", include_optimizer=False)
    want = _logits(job.model_call())
    fmt, files = export_checkpoint(tmp_path / "ck", tiny_dir)
    assert fmt == "hf" and {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    out = tmp_path / "ck" / "export" / "hf"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(IDS).logits[0]
    assert (got - want).abs().max() < 1e-5
    assert AutoTokenizer.from_pretrained(out).encode("12+3") == host.tokenizer.encode("12+3")
    with pytest.raises(CheckpointError, match="'peft' does not apply to a full fine-tuning checkpoint"):
        export_checkpoint(tmp_path / "ck", tiny_dir, "peft")
