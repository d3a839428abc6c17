"""Tests for the torch sampler, against a tiny random Llama built in-process (no downloads)."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from openrl_lab.sample import invariant
from openrl_lab.sample.base import TOPK_EMPTY_LOGPROB, SampledSequence, SamplingError, SamplingParams
from openrl_lab.sample.torch_sampler import Batch, Rows, mergeable, prompt_logprobs, prompt_scores, sample

VOCAB = 300
MAX_CONTEXT = 128
PROMPT = [5, 17, 42, 99, 7, 250]


def tiny_llama() -> LlamaForCausalLM:
    """A tiny random Llama, the same every call (seed 0); tests/sample/test_torch_sampler_cuda.py copies it to a GPU."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_CONTEXT,
        initializer_range=0.2,  # peaky logits: temperature and greedy gaps are visible, a greedy choice is no tie
    )
    model = LlamaForCausalLM(cfg).eval()
    assert invariant.install(model)  # as the torch backend does: a batched row computes what it does alone
    return model


def model_caller(model):
    """The sampler's model call: (ids, KV cache) -> (float logits, KV cache)."""

    @torch.no_grad()
    def call(ids, pkv, attention_mask=None, position_ids=None):
        out = model(
            input_ids=ids,
            past_key_values=pkv,
            use_cache=True,
            attention_mask=attention_mask,
            position_ids=position_ids,
        )
        return out.logits.float(), out.past_key_values

    return call


@pytest.fixture(scope="module")
def model_call():
    return model_caller(tiny_llama())


def run(model_call, n=4, prompt=PROMPT, eos=(), decode=None, vocab_size=VOCAB, topk_logprobs=0, **kw):
    return sample(
        model_call,
        prompt,
        n,
        SamplingParams(**kw),
        eos_token_ids=eos,
        max_context=MAX_CONTEXT,
        vocab_size=vocab_size,
        decode=decode,
        topk_logprobs=topk_logprobs,
    )


def full_logits(model_call, ids):
    """Last-position logits from a plain forward without any cache."""
    logits, _ = model_call(torch.tensor([ids]), None)
    return logits[0, -1]


def decode(tokens):
    return "".join(f"<{t}>" for t in tokens)


@pytest.fixture(scope="module")
def greedy(model_call):
    """A greedy continuation that never stops early, used to place stops at known positions."""
    (seq,) = run(model_call, n=1, temperature=0, max_tokens=12, stop=[])
    return seq.tokens


def test_shapes_and_types(model_call):
    seqs = run(model_call, n=5, max_tokens=7, seed=1)
    assert len(seqs) == 5
    for s in seqs:
        assert isinstance(s, SampledSequence)
        assert 1 <= len(s.tokens) <= 7 and len(s.logprobs) == len(s.tokens)
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in s.tokens)
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.stop_reason == "length"  # no EOS given, so nothing can stop early


def test_seed_is_deterministic(model_call):
    a = run(model_call, n=6, max_tokens=8, seed=123)
    b = run(model_call, n=6, max_tokens=8, seed=123)
    c = run(model_call, n=6, max_tokens=8, seed=124)
    assert a == b
    assert [s.tokens for s in a] != [s.tokens for s in c]
    # rows of one batch are independent draws, not copies
    assert len({tuple(s.tokens) for s in a}) > 1


def test_no_seed_is_nondeterministic(model_call):
    a = run(model_call, n=6, max_tokens=8)
    b = run(model_call, n=6, max_tokens=8)
    assert [s.tokens for s in a] != [s.tokens for s in b]


def test_greedy_matches_uncached_argmax(model_call):
    seqs = run(model_call, n=3, temperature=0, max_tokens=10, stop=[])
    assert seqs[0].tokens == seqs[1].tokens == seqs[2].tokens
    ids = list(PROMPT)
    for tok in seqs[0].tokens:
        assert tok == int(full_logits(model_call, ids).argmax())
        ids.append(tok)


def test_logprobs_match_prompt_logprobs(model_call):
    # Filters and temperature must not change the reported logprob. The stop set ends rows at different
    # steps, so the batch (and its cache) shrinks while other rows continue.
    stop = list(range(0, VOCAB, 4))
    seqs = run(model_call, n=8, max_tokens=12, seed=7, temperature=0.8, top_k=50, top_p=0.9, stop=stop)
    assert len({len(s.tokens) for s in seqs}) > 1, "want rows of several lengths"
    for s in seqs:
        full = prompt_logprobs(model_call, PROMPT + s.tokens)
        torch.testing.assert_close(torch.tensor(full[len(PROMPT) :]), torch.tensor(s.logprobs), atol=1e-5, rtol=0)


def test_prompt_logprobs_shape(model_call):
    lps = prompt_logprobs(model_call, PROMPT)
    assert len(lps) == len(PROMPT) and math.isnan(lps[0])
    assert all(lp <= 0 for lp in lps[1:])
    assert prompt_logprobs(model_call, [3]) == [pytest.approx(float("nan"), nan_ok=True)]


def test_topk_prompt_logprobs(model_call):
    scores = prompt_scores(model_call, PROMPT, topk=5, vocab_size=VOCAB)
    assert scores.logprobs[1:] == prompt_logprobs(model_call, PROMPT)[1:]
    assert scores.topk_ids.shape == scores.topk_logprobs.shape == (len(PROMPT), 5)
    assert (scores.topk_ids[0] == 0).all() and (scores.topk_logprobs[0] == TOPK_EMPTY_LOGPROB).all()
    for i in range(1, len(PROMPT)):
        full = torch.log_softmax(full_logits(model_call, PROMPT[:i]), dim=-1)
        want = full.topk(5)
        assert scores.topk_ids[i].tolist() == want.indices.tolist()  # most likely first, the argmax on top
        torch.testing.assert_close(torch.from_numpy(scores.topk_logprobs[i]), want.values, atol=1e-5, rtol=0)
        if PROMPT[i] in want.indices.tolist():  # the prompt token's own logprob, where it ranks
            j = want.indices.tolist().index(PROMPT[i])
            assert scores.topk_logprobs[i, j] == pytest.approx(scores.logprobs[i], abs=1e-6)
        assert scores.logprobs[i] <= scores.topk_logprobs[i, 0] + 1e-6


def test_topk_prompt_logprobs_skip_padded_vocab(model_call):
    scores = prompt_scores(model_call, PROMPT, topk=3, vocab_size=200)
    assert (scores.topk_ids[1:] < 200).all()


def test_topk_sample_logprobs_are_the_sampled_distributions(model_call):
    seqs = run(model_call, n=3, max_tokens=6, seed=5, temperature=1.5, top_k=40, stop=[], topk_logprobs=4)
    for s in seqs:
        assert len(s.topk_ids) == len(s.topk_logprobs) == len(s.tokens)
        # the same as the prompt top-k of the prompt followed by the sampled tokens, at those positions
        scores = prompt_scores(model_call, PROMPT + s.tokens, topk=4, vocab_size=VOCAB)
        assert [list(r) for r in scores.topk_ids[len(PROMPT) :]] == s.topk_ids
        torch.testing.assert_close(
            torch.tensor(s.topk_logprobs), torch.from_numpy(scores.topk_logprobs[len(PROMPT) :]), atol=1e-5, rtol=0
        )
        for tok, lp, ids, lps in zip(s.tokens, s.logprobs, s.topk_ids, s.topk_logprobs):
            assert lps == sorted(lps, reverse=True) and lp <= lps[0] + 1e-6
            if tok in ids:
                assert lps[ids.index(tok)] == pytest.approx(lp, abs=1e-5)
    (greedy_seq,) = run(model_call, n=1, max_tokens=5, temperature=0, stop=[], topk_logprobs=1)
    assert [ids[0] for ids in greedy_seq.topk_ids] == greedy_seq.tokens  # greedy picks the top-1
    assert run(model_call, n=1, max_tokens=2, stop=[])[0].topk_ids == []  # none unless asked


def test_eos_stops_when_stop_is_none(model_call, greedy):
    eos = greedy[3]
    (s,) = run(model_call, n=1, temperature=0, max_tokens=12, eos=[eos])
    cut = greedy.index(eos) + 1
    assert s.tokens == greedy[:cut] and s.stop_reason == "stop"


def test_empty_stop_ignores_eos(model_call, greedy):
    (s,) = run(model_call, n=1, temperature=0, max_tokens=12, eos=[greedy[1]], stop=[])
    assert s.tokens == greedy and s.stop_reason == "length"


def test_token_stop(model_call, greedy):
    (s,) = run(model_call, n=1, temperature=0, max_tokens=12, eos=[greedy[0]], stop=[greedy[4]])
    cut = greedy.index(greedy[4]) + 1  # EOS is not a stop once explicit stops are given
    assert s.tokens == greedy[:cut] and s.stop_reason == "stop"
    assert len(s.logprobs) == cut


def test_string_stop_within_one_token(model_call, greedy):
    (s,) = run(model_call, n=1, temperature=0, max_tokens=12, stop=[f"<{greedy[5]}>"], decode=decode)
    cut = greedy.index(greedy[5]) + 1
    assert s.tokens == greedy[:cut] and s.stop_reason == "stop"


def test_string_stop_spanning_tokens(model_call, greedy):
    # "3><4" is only complete once the second of the two tokens is out
    text = f"{greedy[2]}><{greedy[3]}"
    (s,) = run(model_call, n=1, temperature=0, max_tokens=12, stop=text, decode=decode)
    assert text in decode(s.tokens) and text not in decode(s.tokens[:-1])
    assert s.tokens == greedy[: len(s.tokens)] and s.stop_reason == "stop"


def test_stop_on_last_token_is_stop(model_call, greedy):
    (s,) = run(model_call, n=1, temperature=0, max_tokens=len(greedy), eos=[greedy[-1]])
    if greedy[-1] not in greedy[:-1]:
        assert s.tokens == greedy and s.stop_reason == "stop"


def test_top_k_1_and_tiny_top_p_equal_greedy(model_call, greedy):
    (g,) = run(model_call, n=1, temperature=0, max_tokens=12, stop=[])
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        seqs = run(model_call, n=4, temperature=1.5, max_tokens=12, stop=[], seed=3, **kw)
        assert all(s.tokens == g.tokens for s in seqs), kw
        assert all(s.logprobs == pytest.approx(g.logprobs, abs=1e-5) for s in seqs)


@pytest.mark.parametrize("kw", [{"top_k": 5}, {"top_p": 0.5}])
def test_filters_keep_to_their_set(model_call, kw):
    seqs = run(model_call, n=6, max_tokens=6, seed=11, temperature=1.0, **kw)
    for s in seqs:
        ids = list(PROMPT)
        for tok in s.tokens:
            logits = full_logits(model_call, ids)
            rank = int((logits > logits[tok]).sum())
            if "top_k" in kw:
                assert rank < kw["top_k"]
            else:  # the mass ranked above the token must be under top_p
                probs = logits.softmax(-1)
                assert float(probs[logits > logits[tok]].sum()) < kw["top_p"] + 1e-6
            ids.append(tok)


def test_temperature_sharpens_and_flattens(model_call):
    def stats(t):
        seqs = run(model_call, n=32, max_tokens=6, seed=5, temperature=t)
        mean_lp = sum(sum(s.logprobs) for s in seqs) / (32 * 6)
        return mean_lp, len({tuple(s.tokens) for s in seqs})

    cold, hot = stats(0.2), stats(3.0)
    assert cold[0] > hot[0]  # cold samples are the model's likelier tokens
    assert cold[1] < hot[1]  # and less diverse
    assert hot[1] == 32


def test_padded_vocab_never_sampled(model_call):
    # logits have 300 columns but only 200 real tokens: the padding must never be drawn
    seqs = run(model_call, n=16, max_tokens=8, seed=2, temperature=5.0, vocab_size=200, prompt=[1, 2, 3])
    assert all(t < 200 for s in seqs for t in s.tokens)


def test_batch_of_32(model_call):
    seqs = run(model_call, n=32, max_tokens=10, seed=9, eos=[0, 1, 2])
    assert len(seqs) == 32
    assert all(1 <= len(s.tokens) <= 10 for s in seqs)
    assert all(s.stop_reason == ("stop" if s.tokens[-1] in (0, 1, 2) else "length") for s in seqs)


@pytest.mark.parametrize(
    "case, match",
    [
        ({"prompt": []}, "prompt is empty"),
        ({"prompt": [1, VOCAB]}, "outside the vocabulary"),
        ({"prompt": [-1, 2]}, "outside the vocabulary"),
        ({"n": 0}, "num_samples=0"),
        ({"n": 129}, "num_samples=129 .* 128"),
        ({"max_tokens": 0}, "max_tokens=0"),
        ({"max_tokens": MAX_CONTEXT}, f"max_tokens={MAX_CONTEXT} .*past the context of {MAX_CONTEXT} tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ["\n"]}, "decode"),
        ({"stop": ["a", 3], "decode": decode}, "mix"),
    ],
)
def test_validation_errors(model_call, case, match):
    with pytest.raises(SamplingError, match=match):
        run(model_call, **case)


def test_max_tokens_exactly_fits_context(model_call):
    (s,) = run(model_call, n=1, max_tokens=MAX_CONTEXT - len(PROMPT), stop=[], seed=0)
    assert len(s.tokens) == MAX_CONTEXT - len(PROMPT) and s.stop_reason == "length"


# --- several requests in one batch -----------------------------------------------------------------------------
def _rows(prompt, n, eos=(), cancel_point=None, topk=0, **kw):
    params = SamplingParams(**kw)
    stop = [params.stop] if isinstance(params.stop, str) else params.stop
    return Rows(list(prompt), n, params, stop, eos, topk, cancel_point)


JOINERS = [  # prompts of different lengths, settings of their own, some joining while others decode
    (0, [5, 17, 42, 99, 7, 250], dict(n=4, max_tokens=12, seed=1, stop=[])),
    (0, [3, 9], dict(n=3, max_tokens=7, seed=2, temperature=0.7, top_k=20, stop=[])),
    (2, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], dict(n=2, max_tokens=9, seed=3, top_p=0.9, eos=(1, 2, 3))),
    (5, [8], dict(n=5, max_tokens=4, seed=4, temperature=0.0, stop=[])),
    (5, [40, 41, 42], dict(n=1, max_tokens=10, seed=5, topk=3, stop=[])),
    (0, [60, 61, 62, 63, 64, 65], dict(n=2, max_tokens=5, seed=6, stop=[])),  # the first's length: one prefill
]


def _alone(model_call, prompt, kw):
    kw = dict(kw)
    n, eos, topk = kw.pop("n"), kw.pop("eos", ()), kw.pop("topk", 0)
    return run(model_call, n=n, prompt=prompt, eos=eos, topk_logprobs=topk, **kw)


def test_requests_that_join_a_running_batch_draw_what_they_draw_alone(model_call):
    """Seeded requests of different prompt lengths, joining at steps 0, 2 and 5 (two or three at a time, two of one
    length prefilled together): the same tokens, logprobs and top-k as each alone, bit for bit (its own generator;
    `sample/invariant.py`), and one model call per decoding step for all of them."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return model_call(*args, **kwargs)

    batch = Batch(counted, vocab_size=VOCAB)
    waiting = [(at, _rows(p, kw["n"], **{k: v for k, v in kw.items() if k != "n"})) for at, p, kw in JOINERS]
    requests = [r for _, r in waiting]
    step = 0
    while waiting or batch:
        now = [w for w in waiting if w[0] <= step]
        batch.add(*[r for _, r in now])
        waiting = [w for w in waiting if w not in now]
        batch.step()
        step += 1
    assert batch.joined == len(JOINERS) and batch.exact is True
    assert max(calls) > 5, "the rows of several requests went through one model call"
    for (_, prompt, kw), r in zip(JOINERS, requests):
        assert r.done and r.error is None
        alone = _alone(model_call, prompt, kw)
        assert [s.tokens for s in r.out] == [s.tokens for s in alone]
        assert [s.stop_reason for s in r.out] == [s.stop_reason for s in alone]
        for got, want in zip(r.out, alone):
            assert got.logprobs == want.logprobs
            assert (got.topk_ids, got.topk_logprobs) == (want.topk_ids, want.topk_logprobs)
    # Fewer model calls than the requests one after another (each: its prefill + one per token but the last).
    alone_calls = sum(1 + kw["max_tokens"] - 1 for _, _, kw in JOINERS)
    assert len(calls) < alone_calls


def test_a_cancelled_request_leaves_and_the_others_go_on(model_call):
    class Gone(Exception):
        pass

    steps = {"n": 0}

    def cancel_after_three():
        steps["n"] += 1
        if steps["n"] > 3:
            raise Gone("its session ended")

    batch = Batch(model_call, vocab_size=VOCAB)
    doomed = _rows([5, 6, 7], 4, cancel_point=cancel_after_three, max_tokens=12, seed=1, stop=[])
    kept = _rows([9, 10], 2, max_tokens=12, seed=2, stop=[])
    batch.add(doomed)
    batch.add(kept)
    ended = []
    while batch:
        ended += batch.step()
    assert isinstance(doomed.error, Gone) and all(len(s.tokens) == 3 for s in doomed.out)
    assert ended == [doomed, kept] and kept.error is None
    alone = run(model_call, n=2, prompt=[9, 10], max_tokens=12, seed=2, stop=[])
    assert [s.tokens for s in kept.out] == [s.tokens for s in alone]


def test_a_batch_returns_to_no_padding_when_the_padded_rows_leave(model_call):
    batch = Batch(model_call, vocab_size=VOCAB)
    batch.add(_rows([5, 6, 7, 8], 2, max_tokens=10, seed=1, stop=[]))
    short = _rows([9], 2, max_tokens=2, seed=2, stop=[])
    batch.add(short)
    assert batch.mask is not None  # rows of length 1 next to rows of length 4
    while not short.done:
        batch.step()
    assert batch.mask is None and batch.rows == 2  # the short rows left, and with them every padded column


def test_plain_llama_caches_can_be_merged(model_call):
    _, cache = model_call(torch.tensor([PROMPT]), None)
    assert mergeable(cache)
