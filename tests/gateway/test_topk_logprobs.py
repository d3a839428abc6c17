"""topk_prompt_logprobs and topk_sample_logprobs through the real SDK against a real lab: the top-k of each
prompt (or sampled) position's next-token distribution, as the cookbook's distillation recipes read it."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from openrl_lab.train.models import resolve_model_dir

from .helpers import MODEL, TEXTS, new_trainer, sft_batch

K = 5


def _prompt(tok) -> types.ModelInput:
    return types.ModelInput.from_ints(tok.encode("12+34=46 abc cba", add_special_tokens=False))


def _check_topk(out, prompt: list[int], k: int) -> None:
    topk, plp = out.topk_prompt_logprobs, out.prompt_logprobs
    assert len(topk) == len(prompt) and topk[0] is None and plp[0] is None
    for i in range(1, len(prompt)):
        ids, lps = [t for t, _ in topk[i]], [lp for _, lp in topk[i]]
        assert len(ids) == k and len(set(ids)) == k
        assert lps == sorted(lps, reverse=True)
        assert plp[i] <= lps[0] + 1e-6  # the prompt token never outranks the top-1
        if prompt[i] in ids:  # where it ranks in the top k, its own logprob is there
            assert lps[ids.index(prompt[i])] == pytest.approx(plp[i], abs=1e-6)


def test_topk_prompt_logprobs_match_the_full_distribution(lab, service):
    sampler = service.create_sampling_client(base_model=MODEL).result()
    tok = sampler.get_tokenizer()
    prompt = _prompt(tok)
    ids = prompt.to_ints()
    out = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=K
    ).result()
    _check_topk(out, ids, K)
    # The base model loaded here with plain transformers: its full distribution at every position.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(MODEL, lab.home), dtype=torch.float32).eval()
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    for i in range(1, len(ids)):
        want = full[i - 1].topk(K)
        got = out.topk_prompt_logprobs[i]
        assert got[0][0] == int(full[i - 1].argmax())  # the top-1 is the argmax of the whole distribution
        assert [t for t, _ in got] == want.indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in got]), want.values, atol=1e-5, rtol=0)


def test_topk_prompt_logprobs_of_a_trained_snapshot(service):
    trainer = new_trainer(service)
    tok = trainer.get_tokenizer()
    for _ in range(3):
        trainer.forward_backward(sft_batch(tok, TEXTS), "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = _prompt(tok)
    out = sampler.sample(
        prompt, 2, types.SamplingParams(max_tokens=3, seed=1), include_prompt_logprobs=True, topk_prompt_logprobs=K
    ).result()
    _check_topk(out, prompt.to_ints(), K)
    assert len(out.sequences) == 2
    # The same as compute_logprobs; with prompt_logprobs_last_n the earlier positions are empty.
    assert out.prompt_logprobs == sampler.compute_logprobs(prompt).result()
    last = sampler.sample(
        prompt,
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=K,
        prompt_logprobs_last_n=3,
    ).result()
    n = prompt.length
    assert last.topk_prompt_logprobs[: n - 3] == [None] * (n - 3)
    assert last.topk_prompt_logprobs[n - 3 :] == out.topk_prompt_logprobs[n - 3 :]


def test_topk_without_prompt_logprobs_and_k_1(service):
    sampler = service.create_sampling_client(base_model=MODEL).result()
    prompt = _prompt(sampler.get_tokenizer())
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=1).result()
    assert out.prompt_logprobs is None
    assert out.topk_prompt_logprobs[0] is None and all(len(row) == 1 for row in out.topk_prompt_logprobs[1:])


def test_topk_sample_logprobs(service):
    sampler = service.create_sampling_client(base_model=MODEL).result()
    prompt = _prompt(sampler.get_tokenizer())
    out = sampler.sample(
        prompt, 3, types.SamplingParams(max_tokens=5, seed=4, stop=[]), topk_sample_logprobs=K, topk_prompt_logprobs=2
    ).result()
    assert [len(row) for row in out.topk_prompt_logprobs[1:]] == [2] * (prompt.length - 1)
    for seq in out.sequences:
        assert len(seq.topk_logprobs) == len(seq.tokens) == 5
        # The same rows as the prompt top-k of the prompt followed by the sampled tokens.
        full = types.ModelInput.from_ints(prompt.to_ints() + seq.tokens)
        again = sampler.sample(full, 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=K).result()
        for (tok, lp, row), want in zip(
            zip(seq.tokens, seq.logprobs, seq.topk_logprobs), again.topk_prompt_logprobs[prompt.length :]
        ):
            assert [t for t, _ in row] == [t for t, _ in want]
            np.testing.assert_allclose([p for _, p in row], [p for _, p in want], atol=1e-5, rtol=0)
            assert lp <= row[0][1] + 1e-6
            if tok in [t for t, _ in row]:
                assert dict(row)[tok] == pytest.approx(lp, abs=1e-6)
    plain = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
    assert plain.sequences[0].topk_logprobs is None and plain.topk_prompt_logprobs is None


@pytest.mark.parametrize("option", ["topk_prompt_logprobs", "topk_sample_logprobs"])
@pytest.mark.parametrize("k", [21, 10_000])
def test_topk_beyond_the_limit_is_a_400(service, option, k):
    sampler = service.create_sampling_client(base_model=MODEL).result()
    prompt = _prompt(sampler.get_tokenizer())
    with pytest.raises(tinker.BadRequestError, match=rf"{option} {k} is out of range \[1, 20\]"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), **{option: k}).result()
