"""The torch sampler on a CUDA device (`pytest -m cuda`; `make gpu-check` runs it): the same tiny random Llama as
tests/sample/test_torch_sampler.py, built in-process on the CPU and copied to the GPU. Deselected by default
(pyproject addopts: -m "not cuda"), skipped without a GPU."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from openrl_lab.sample.base import SamplingParams
from openrl_lab.sample.torch_sampler import prompt_logprobs, sample
from tests.sample.test_torch_sampler import MAX_CONTEXT, PROMPT, VOCAB, model_caller, tiny_llama

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

EOS = set(range(0, 300, 7))  # one token in 7 ends a row: rows drop out of the batch (and its KV cache) early


@pytest.fixture(scope="module")
def calls():
    cpu = tiny_llama()
    return model_caller(cpu), model_caller(copy.deepcopy(cpu).to("cuda"))


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
