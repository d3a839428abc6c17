"""Default sampler backend: batched autoregressive sampling in plain PyTorch with a KV cache.

The trainer hands us a `ModelCall`: `(input_ids [B,T], past_key_values | None) -> (logits [B,T,V] float32,
past_key_values)`, an HF causal LM run under no_grad with use_cache=True (so the cache is a DynamicCache).

The prompt is prefilled once and its cache copied for every sample; after that each step feeds one token
per live row. Finished rows are dropped from the batch, so every live row always has the same length and
no padding or attention mask is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from openrl_lab.sample.base import (  # the request and result types every backend shares
    GREEDY_EPS,
    TOPK_EMPTY_LOGPROB,
    SampledSequence,
    SamplingParams,
    validate,
)

ModelCall = Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]


def _next_tokens(
    logits: torch.Tensor, p: SamplingParams, gen: torch.Generator, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row from last-position logits [B,V]; return (tokens [B], their logprobs [B], every
    token's logprob [B,V])."""
    logits = logits.float()
    # The reported logprob is the model's own: log_softmax of the raw logits, whatever the filters did.
    # This is what prompt_logprobs and the trainer compute for the same token.
    logprobs = torch.log_softmax(logits, dim=-1)
    scores = logits
    if scores.shape[-1] > vocab_size:  # padded embedding rows are not real tokens: never pick them
        scores = scores.clone()
        scores[:, vocab_size:] = float("-inf")
    if p.temperature < GREEDY_EPS:
        tokens = scores.argmax(dim=-1)
    else:
        scores = scores / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = scores.topk(p.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            probs = sorted_scores.softmax(dim=-1)
            # Drop a token once the tokens ranked above it already hold top_p of the mass; the top one stays.
            drop = probs.cumsum(dim=-1) - probs >= p.top_p
            scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
        tokens = torch.multinomial(scores.softmax(dim=-1), 1, generator=gen).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1), logprobs


@torch.no_grad()
def sample(
    model_call: ModelCall,
    prompt: Sequence[int],
    num_samples: int,
    params: SamplingParams,
    *,
    eos_token_ids: Collection[int],
    max_context: int,
    vocab_size: int,
    decode: Callable[[list[int]], str] | None = None,
    device: str | torch.device = "cpu",
    cancel_point: Callable[[], None] | None = None,
    topk_logprobs: int = 0,
) -> list[SampledSequence]:
    """Draw `num_samples` continuations of `prompt`. Raises SamplingError for a bad request.

    Stops: with `params.stop` None a row ends at any of `eos_token_ids`; with token ids it ends at one of
    those (EOS is then not a stop unless listed); with strings it ends once `decode(generated so far)`
    contains one; with [] it runs to max_tokens. The stopping token is kept in tokens/logprobs.
    `cancel_point` runs before each decoding step and may raise to abandon the call. `topk_logprobs` > 0: each
    sequence also gets the top-k of the distribution it sampled each token from (padded vocabulary rows never
    ranked).
    """
    prompt = [int(t) for t in prompt]
    stop = validate(prompt, num_samples, params, max_context, vocab_size, decode)
    stop_ids = set(eos_token_ids) if stop is None else {s for s in stop if isinstance(s, int)}
    stop_strs = [s for s in stop or [] if isinstance(s, str)]

    gen = torch.Generator(device=device)
    if params.seed is None:
        gen.seed()  # fresh nondeterministic seed, independent of the global RNG
    else:
        gen.manual_seed(params.seed % 2**64)  # any Python int is a valid seed

    # One prefill for the shared prompt, then copy its cache for every sample.
    logits, cache = model_call(torch.tensor([prompt], dtype=torch.long, device=device), None)
    logits = logits[:, -1].expand(num_samples, -1)
    if num_samples > 1:
        cache.batch_repeat_interleave(num_samples)

    out = [SampledSequence([], [], "length") for _ in range(num_samples)]
    live = list(range(num_samples))  # batch row j holds sample live[j]
    for step in range(params.max_tokens):
        if cancel_point is not None:
            cancel_point()
        tokens, logprobs, every = _next_tokens(logits, params, gen, vocab_size)
        if topk_logprobs:
            top = every[:, :vocab_size].topk(min(topk_logprobs, vocab_size), dim=-1)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        keep = []
        for j, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
            seq = out[live[j]]
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            if topk_logprobs:
                seq.topk_ids.append(top_ids[j])
                seq.topk_logprobs.append(top_lps[j])
            # validate() refused stop strings without a decode function
            if tok in stop_ids or (
                stop_strs and decode is not None and any(s in decode(seq.tokens) for s in stop_strs)
            ):
                seq.stop_reason = "stop"
            else:
                keep.append(j)
        if not keep or step == params.max_tokens - 1:
            break
        if len(keep) < len(live):
            # Drop finished rows from the batch and the cache, so no compute is spent on them.
            idx = torch.tensor(keep, dtype=torch.long, device=tokens.device)
            cache.batch_select_indices(idx)
            tokens = tokens[idx]
            live = [live[j] for j in keep]
        logits, cache = model_call(tokens[:, None], cache)
        logits = logits[:, -1]
    return out


@torch.no_grad()
def prompt_logprobs(model_call: ModelCall, prompt: Sequence[int], *, device: str | torch.device = "cpu") -> list[float]:
    """log p(prompt[i] | prompt[:i]) for each position, from one uncached forward; the first is NaN."""
    return prompt_scores(model_call, prompt, device=device).logprobs


@dataclass
class PromptScores:
    logprobs: list[float]  # log p(prompt[i] | prompt[:i]); the first is NaN
    # The k most likely tokens at each position i (of p(. | prompt[:i])), most likely first, as (N, k) int32 ids
    # and float32 logprobs; row 0 has no context and is the wire's empty cell (id 0, TOPK_EMPTY_LOGPROB).
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


@torch.no_grad()
def prompt_scores(
    model_call: ModelCall,
    prompt: Sequence[int],
    *,
    topk: int = 0,
    vocab_size: int | None = None,
    device: str | torch.device = "cpu",
) -> PromptScores:
    """Prompt logprobs and, with `topk` > 0, the top-k of each position's next-token distribution, from one
    uncached forward. Logprobs are the raw model's (as for sampled tokens); padded embedding rows past
    `vocab_size` are no tokens and never ranked."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        return PromptScores([])
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    logits, _ = model_call(ids, None)
    logprobs = torch.log_softmax(logits[0, :-1].float(), dim=-1)
    picked = logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)
    scores = PromptScores([float("nan"), *picked.tolist()])
    if topk > 0:
        ranked = logprobs[:, :vocab_size] if vocab_size is not None else logprobs
        values, indices = ranked.topk(min(topk, ranked.shape[-1]), dim=-1)  # sorted, most likely first
        n = len(prompt)
        scores.topk_ids = np.zeros((n, topk), dtype=np.int32)
        scores.topk_logprobs = np.full((n, topk), TOPK_EMPTY_LOGPROB, dtype=np.float32)
        scores.topk_ids[1:, : indices.shape[1]] = indices.cpu().numpy()
        scores.topk_logprobs[1:, : values.shape[1]] = values.cpu().numpy()
    return scores
