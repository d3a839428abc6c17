"""The torch sampler on a CUDA device (`pytest -m cuda`; `make gpu-check` runs it): the same tiny random Llama as
tests/sample/test_torch_sampler.py, built in-process on the CPU and copied to the GPU. Deselected by default
(pyproject addopts: -m "not cuda"), skipped without a GPU."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from openrl_lab.sample.torch_sampler import SamplingParams, prompt_logprobs, sample

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

VOCAB = 300
MAX_CONTEXT = 128
PROMPT = [5, 17, 42, 99, 7, 250]
EOS = set(range(0, 300, 7))  # one token in 7 ends a row: rows drop out of the batch (and its KV cache) early


def _call(model):
    @torch.no_grad()
    def call(ids, pkv):
        out = model(input_ids=ids, past_key_values=pkv, use_cache=True)
        return out.logits.float(), out.past_key_values

    return call


@pytest.fixture(scope="module")
def calls():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_CONTEXT,
        initializer_range=0.2,  # peaky logits: a greedy choice is far from a tie, on either device
    )
    cpu = LlamaForCausalLM(cfg).eval()
    gpu = copy.deepcopy(cpu).to("cuda")
    return _call(cpu), _call(gpu)


def run(call, device, n=4, eos=(), **kw):
    p = SamplingParams(**kw)
    return sample(call, PROMPT, n, p, eos_token_ids=eos, max_context=MAX_CONTEXT, vocab_size=VOCAB, device=device)


def test_greedy_on_the_gpu_is_the_cpus_continuation(calls):
    cpu, gpu = calls
    (a,) = run(cpu, "cpu", n=1, temperature=0, max_tokens=16, stop=[])
    (b,) = run(gpu, "cuda", n=1, temperature=0, max_tokens=16, stop=[])
    assert b.tokens == a.tokens and len(b.tokens) == 16
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
    assert prompt_logprobs(gpu, PROMPT, device="cuda")[1:] == pytest.approx(prompt_logprobs(cpu, PROMPT)[1:], abs=1e-3)


def test_seeded_sampling_on_the_gpu_repeats_and_its_logprobs_are_the_models(calls):
    _, gpu = calls
    kw = dict(n=16, eos=EOS, temperature=1.0, max_tokens=12, seed=3)
    first, again, other = run(gpu, "cuda", **kw), run(gpu, "cuda", **kw), run(gpu, "cuda", **(kw | {"seed": 4}))
    assert [s.tokens for s in first] == [s.tokens for s in again]  # the CUDA generator is seeded per call
    assert [s.tokens for s in first] != [s.tokens for s in other]
    stopped = [s for s in first if s.stop_reason == "stop"]
    # rows ended at different steps: finished rows were dropped from the batch (and its KV cache) while others ran
    assert stopped and len({len(s.tokens) for s in first}) > 1
    for s in first:
        assert all(0 <= t < VOCAB for t in s.tokens) and all(lp <= 0 and math.isfinite(lp) for lp in s.logprobs)
        assert (s.stop_reason == "stop") == (s.tokens[-1] in EOS)
        # after rows were dropped from the batch, each row's logprobs still are the model's own for its tokens
        ref = prompt_logprobs(gpu, PROMPT + s.tokens, device="cuda")[len(PROMPT) :]
        assert s.logprobs == pytest.approx(ref, abs=1e-3)


def test_top_k_on_the_gpu_ranks_the_sampled_distribution(calls):
    _, gpu = calls
    (s,) = sample(
        gpu,
        PROMPT,
        1,
        SamplingParams(temperature=0, max_tokens=6, stop=[]),
        eos_token_ids=(),
        max_context=MAX_CONTEXT,
        vocab_size=VOCAB,
        device="cuda",
        topk_logprobs=5,
    )
    for tok, lp, ids, lps in zip(s.tokens, s.logprobs, s.topk_ids, s.topk_logprobs):
        assert ids[0] == tok and lps[0] == pytest.approx(lp, abs=1e-5)  # greedy: the top token is the one taken
        assert lps == sorted(lps, reverse=True) and len(ids) == 5
