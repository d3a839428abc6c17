"""The torch sampler: autoregressive sampling in plain PyTorch with a KV cache, several requests in one batch.

The trainer hands us a `ModelCall` (`train.trainer.ModelCall`): `(input_ids [B,T], past_key_values | None) ->
(logits [B,T,V] float32, past_key_values)`, an HF causal LM run under no_grad with use_cache=True (so the cache is a
DynamicCache), taking an attention mask and position ids when a batch has padded rows.

A request's prompt is prefilled once and its cache copied for every sample; after that each step feeds one token
per live row. Finished rows are dropped from the batch. A `Batch` holds the rows of several requests (continuous
batching: a request joins between steps, leaves when it is done); `sample` is one request alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from openrl_lab.sample import invariant
from openrl_lab.sample.base import (  # the request and result types every backend shares
    GREEDY_EPS,
    TOPK_EMPTY_LOGPROB,
    SampledSequence,
    SamplingParams,
    validate,
)
from openrl_lab.train.trainer import ModelCall


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
    ranked). One request alone in a `Batch`: what it gives in a batch with others, bit for bit on a model with the
    per-request attention installed (`invariant`).
    """
    prompt = [int(t) for t in prompt]
    stop = validate(prompt, num_samples, params, max_context, vocab_size, decode)
    batch = Batch(model_call, vocab_size=vocab_size, decode=decode, device=device)
    request = Rows(prompt, num_samples, params, stop, eos_token_ids, topk_logprobs, cancel_point)
    batch.add(request)
    while batch:
        batch.step()
    if request.error is not None:
        raise request.error
    return request.out


@dataclass(eq=False)
class Rows:
    """One request's rows in a `Batch`: `num_samples` continuations of `prompt`, drawn with the request's own
    generator (seeded: what it draws does not depend on who else is in the batch). `stop`: as `validate`
    returned it. `cancel_point` runs before each of its decoding steps; what it raises ends this request only."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams
    stop: list[int] | list[str] | None
    eos_token_ids: Collection[int] = ()
    topk_logprobs: int = 0
    cancel_point: Callable[[], None] | None = None
    owner: Any = None  # the caller's, for its own bookkeeping
    adapter: str | None = None  # the adapter its rows run through, on a call that takes one per row (adapter_batch)
    out: list[SampledSequence] = field(init=False)
    error: BaseException | None = field(default=None, init=False)
    done: bool = field(default=False, init=False)
    live: list[int] = field(init=False)  # its rows in the batch, in order: row j holds out[live[j]]
    steps: int = field(default=0, init=False)  # tokens drawn so far per row
    gen: torch.Generator = field(init=False)

    def __post_init__(self):
        self.stop_ids = set(self.eos_token_ids) if self.stop is None else {s for s in self.stop if isinstance(s, int)}
        self.stop_strs = [s for s in self.stop or [] if isinstance(s, str)]
        self.out = [SampledSequence([], [], "length") for _ in range(self.num_samples)]
        self.live = list(range(self.num_samples))


class Batch:
    """Rows of several requests decoding together, one model call per step for all of them (continuous batching):
    a request joins between steps (`add`: its prompt prefilled, together with joiners' prompts of its length, its
    cache copied per sample and merged into the batch's) and leaves when its last row stops. Each request's rows
    are contiguous. Prompts of different lengths sit left-padded in the KV cache, masked out by an attention mask,
    with each row's own positions. Each decoding step runs under an `invariant.layout` of the rows, so that a model
    with the per-request attention installed computes every request's rows as it would alone (`exact` says whether
    it did). Needs a model whose cache is plain `DynamicLayer`s (`mergeable`); the caller runs others one request
    at a time."""

    def __init__(
        self,
        model_call: ModelCall,
        *,
        vocab_size: int,
        decode: Callable[[list[int]], str] | None = None,
        device: str | torch.device = "cpu",
    ):
        self.call, self.vocab_size, self.decode, self.device = model_call, vocab_size, decode, device
        self.requests: list[Rows] = []
        self.cache: Any = None
        self.logits: torch.Tensor | None = None  # [B, V]: each row's next-token logits
        self.mask: torch.Tensor | None = None  # [B, T] 1 = a real token; None: no row is padded
        self.positions: torch.Tensor | None = None  # [B]: each row's next position (its real length)
        self.joined = 0  # requests added so far
        self.exact: bool | None = None  # each request's rows computed as alone (`invariant`); None: no step yet

    def __bool__(self) -> bool:
        return bool(self.requests)

    @property
    def rows(self) -> int:
        return sum(len(r.live) for r in self.requests)

    @torch.no_grad()
    def add(self, *requests: Rows) -> None:
        """Prefill the requests' prompts and put their rows in the batch (requests already checked by `validate`).
        Prompts of one length are one prefill (no padding), each prompt of it computed as alone (`invariant`), so
        what a request computes does not depend on who else joined."""
        by_length: dict[int, list[Rows]] = {}
        for r in requests:
            r.gen = torch.Generator(device=self.device)
            if r.params.seed is None:
                r.gen.seed()  # fresh nondeterministic seed, independent of the global RNG
            else:
                r.gen.manual_seed(r.params.seed % 2**64)  # any Python int is a valid seed
            by_length.setdefault(len(r.prompt), []).append(r)
        for length, same in by_length.items():
            ids = torch.tensor([r.prompt for r in same], dtype=torch.long, device=self.device)
            with invariant.layout((), rows=ids.numel()):
                logits, cache = self._call(ids, None, [r.adapter for r in same])
            counts = [r.num_samples for r in same]
            rows = torch.repeat_interleave(torch.arange(len(same), device=ids.device), torch.tensor(counts))
            if len(rows) != len(same):  # a prompt's cache copied for each of its samples
                cache.batch_select_indices(rows)
            positions = torch.full((len(rows),), length, dtype=torch.long, device=logits.device)
            self._merge(cache, logits[rows, -1], positions, None)
            self.requests.extend(same)
            self.joined += len(same)

    def _merge(self, cache: Any, logits: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> None:
        """New rows (their cache, next-token logits, next positions and padding mask) below the batch's rows."""
        if self.cache is None:
            self.cache, self.logits, self.positions, self.mask = cache, logits, positions, mask
            return
        assert self.logits is not None and self.positions is not None
        mine, theirs = cache.get_seq_length(), self.cache.get_seq_length()
        if self.mask is not None or mask is not None or mine != theirs:
            width = max(mine, theirs)
            old = self.mask if self.mask is not None else _ones(len(self.logits), theirs, self.logits.device)
            new = mask if mask is not None else _ones(len(logits), mine, logits.device)
            self.mask = torch.cat([_pad_left(old, width), _pad_left(new, width)])
        for ours, joined in zip(self.cache.layers, cache.layers):
            width = max(ours.keys.shape[-2], joined.keys.shape[-2])
            ours.keys = torch.cat([_pad_left(ours.keys, width, dim=-2), _pad_left(joined.keys, width, dim=-2)])
            ours.values = torch.cat([_pad_left(ours.values, width, dim=-2), _pad_left(joined.values, width, dim=-2)])
        self.logits = torch.cat([self.logits, logits])
        self.positions = torch.cat([self.positions, positions])

    @torch.no_grad()
    def step(self) -> list[Rows]:
        """Pick one token for every row; drop finished rows; feed the rest one step. Returns the requests that
        ended in this step (done, or with `error` set when their cancel point raised)."""
        assert self.logits is not None and self.positions is not None
        keep: list[int] = []
        ended: list[Rows] = []
        picked: list[torch.Tensor] = []  # every row's token, in batch order (a cancelled request's rows: 0)
        start = 0
        for r in self.requests:
            rows = range(start, start + len(r.live))
            start += len(r.live)
            try:
                if r.cancel_point is not None:
                    r.cancel_point()
            except Exception as e:  # noqa: BLE001 - that request's end (cancelled), the others go on
                r.error, r.done = e, True
                ended.append(r)
                picked.append(torch.zeros(len(rows), dtype=torch.long, device=self.logits.device))
                continue
            tokens, still = self._pick(r, self.logits[rows.start : rows.stop])
            picked.append(tokens)
            r.steps += 1
            if not still or r.steps == r.params.max_tokens:
                r.done = True
                ended.append(r)
                continue
            keep.extend(rows.start + j for j in still)
            r.live = [r.live[j] for j in still]
        self.requests = [r for r in self.requests if not r.done]
        if not keep:
            self.cache = self.logits = self.mask = self.positions = None
            return ended
        tokens = torch.cat(picked)
        if len(keep) < len(tokens):
            # Drop finished rows from the batch and the cache, so no compute is spent on them.
            idx = torch.tensor(keep, dtype=torch.long, device=tokens.device)
            self.cache.batch_select_indices(idx)
            tokens, self.positions = tokens[idx], self.positions[idx]
            if self.mask is not None:
                self.mask = self._trim(self.mask[idx])
        # Runs of rows with one cache length (one request's rows, or neighbours' of the same length): each run's
        # attention is computed apart, on its own columns. The length counts this step's token.
        groups: list[tuple[int, int, int]] = []
        for row, length in enumerate(self.positions.tolist()):
            if groups and groups[-1][2] == length + 1:
                groups[-1] = (groups[-1][0], row + 1, length + 1)
            else:
                groups.append((row, row + 1, length + 1))
        adapters = [r.adapter for r in self.requests for _ in r.live]
        with invariant.layout(groups, len(tokens)) as used:
            if self.mask is None:
                logits, self.cache = self._call(tokens[:, None], self.cache, adapters)
            else:
                self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
                logits, self.cache = self._call(
                    tokens[:, None],
                    self.cache,
                    adapters,
                    attention_mask=self.mask,
                    position_ids=self.positions[:, None],
                )
        self.exact = used.used if self.exact is None else self.exact and used.used
        self.logits = logits[:, -1]
        self.positions = self.positions + 1
        return ended

    def _call(self, ids: torch.Tensor, cache: Any, adapters: list[str | None], **kwargs) -> tuple[torch.Tensor, Any]:
        """The model call on these rows; with the adapter of each row when the requests name theirs."""
        if adapters and adapters[0] is not None:
            kwargs["adapter_names"] = adapters
        return self.call(ids, cache, **kwargs)

    def _pick(self, r: Rows, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Sample `r`'s next tokens from its rows' logits into its sequences: (the tokens, its rows that go on as
        local indices)."""
        tokens, logprobs, every = _next_tokens(logits, r.params, r.gen, self.vocab_size)
        if r.topk_logprobs:
            top = every[:, : self.vocab_size].topk(min(r.topk_logprobs, self.vocab_size), dim=-1)
            top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        still = []
        for j, (tok, lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
            seq = r.out[r.live[j]]
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            if r.topk_logprobs:
                seq.topk_ids.append(top_ids[j])
                seq.topk_logprobs.append(top_lps[j])
            # validate() refused stop strings without a decode function
            if tok in r.stop_ids or (
                r.stop_strs and self.decode is not None and any(s in self.decode(seq.tokens) for s in r.stop_strs)
            ):
                seq.stop_reason = "stop"
            else:
                still.append(j)
        return tokens, still

    def _trim(self, mask: torch.Tensor) -> torch.Tensor | None:
        """Leading cache columns that every row pads are dropped; None once no row is padded."""
        lead = int(mask.any(dim=0).long().argmax())
        if lead:
            mask = mask[:, lead:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
        return None if bool(mask.all()) else mask


def mergeable(cache: Any) -> bool:
    """Whether caches of this kind can be merged into a `Batch` (plain full-attention layers)."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


def _ones(rows: int, width: int, device: torch.device) -> torch.Tensor:
    return torch.ones((rows, width), dtype=torch.long, device=device)


def _pad_left(t: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """`t` left-padded with zeros to `width` along `dim`."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


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
