"""Sampling: open a sampler (on a base model or a checkpoint) and sample from it."""

from __future__ import annotations

import math

from tinker import types as tt

from openrl_lab.gateway import wire
from openrl_lab.gateway.bodies import MAX_SAMPLE_BODY
from openrl_lab.gateway.deps import Gw, User, api_router
from openrl_lab.gateway.errors import ApiError, not_found
from openrl_lab.gateway.routes.training import PROTO
from openrl_lab.kernel.api import ModelCard, SamplingParams

router = api_router(tags=["sampling"])
MAX_SAMPLES = 128
# The most top-k prompt logprobs per position: what the cookbook's distillation asks for, and vLLM's default cap.
MAX_TOPK_LOGPROBS = 20


@router.post("/create_sampling_session")
async def create_sampling_session(req: tt.CreateSamplingSessionRequest, gw: Gw, owner: User):
    gw.session(req.session_id, owner)
    sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
    if req.model_path:
        ck = gw.checkpoint(req.model_path, owner, readable=True)
        kernel = await gw.place(purpose="sample")
        info = await gw.kernel_call(
            kernel, lambda k: k.open_sampler(sampler_id=sampler_id, base_model=None, path=ck["fs_path"], owner=owner)
        )
        base_model = info.name
    elif req.base_model:
        await gw.card(req.base_model)
        kernel = await gw.place(purpose="sample", base_model=req.base_model)
        base_model = req.base_model
        await gw.kernel_call(
            kernel, lambda k: k.open_sampler(sampler_id=sampler_id, base_model=base_model, path=None, owner=owner)
        )
    else:
        raise ApiError(400, "create_sampling_session needs base_model or model_path")
    gw.store.add_sampler(sampler_id, owner, req.session_id, base_model, req.model_path, None, kernel.epoch)
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, gw: Gw, owner: User):
    row = gw.store.sampler(sampler_id, owner)
    if row is None:
        raise not_found(f"sampler {sampler_id}")
    return {
        "sampler_id": sampler_id,
        "base_model": row["base_model"],
        "model_path": row["model_path"],
        "placement": gw.kernels.where(row["epoch"]),
    }


def _prompt(req: tt.SampleRequest) -> list[int]:
    unsupported = [
        name
        for name, on in (
            ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
            ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
        )
        if on
    ]
    if unsupported:
        raise ApiError(400, f"{', '.join(unsupported)} not supported by this server")
    prompt = []
    for chunk in req.prompt.chunks:
        if chunk.type != "encoded_text":
            raise ApiError(400, f"prompt chunk of type {chunk.type!r} is not supported (text tokens only)")
        prompt.extend(chunk.tokens)
    return prompt


def _topk(req: tt.SampleRequest) -> dict[str, int]:
    """The top-k logprobs asked for (0: none); the kernel is sent only those asked for."""
    return {"topk_prompt_logprobs": req.topk_prompt_logprobs, "topk_sample_logprobs": req.topk_sample_logprobs}


def _check_sample(prompt: list[int], req: tt.SampleRequest, card: ModelCard) -> None:
    vocab, ctx, sp = card.vocab_size, card.max_context_length, req.sampling_params
    if not prompt:
        raise ApiError(400, "prompt is empty")
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
    if not 1 <= req.num_samples <= MAX_SAMPLES:
        raise ApiError(400, f"num_samples {req.num_samples} is out of range [1, {MAX_SAMPLES}]")
    max_tokens = sp.max_tokens or 1
    if max_tokens < 1 or len(prompt) + max_tokens > ctx:
        raise ApiError(
            400,
            f"max_tokens {max_tokens} with a {len(prompt)}-token prompt is past the model's context of {ctx} tokens",
        )
    if sp.temperature < 0 or not math.isfinite(sp.temperature):
        raise ApiError(400, f"temperature {sp.temperature} must be finite and >= 0")
    if not 0 < sp.top_p <= 1:
        raise ApiError(400, f"top_p {sp.top_p} must be in (0, 1]")
    if sp.top_k == 0 or sp.top_k < -1:
        raise ApiError(400, f"top_k {sp.top_k} must be -1 (off) or >= 1")
    for name, k in _topk(req).items():
        if k and not 1 <= k <= min(MAX_TOPK_LOGPROBS, vocab):
            raise ApiError(400, f"{name} {k} is out of range [1, {min(MAX_TOPK_LOGPROBS, vocab)}] (0: off)")
    if req.prompt_logprobs_last_n is not None and req.prompt_logprobs_last_n < 0:
        raise ApiError(400, f"prompt_logprobs_last_n {req.prompt_logprobs_last_n} must be >= 0")


@router.post("/asample", max_body_size=MAX_SAMPLE_BODY)
async def asample(req: tt.SampleRequest, gw: Gw, owner: User):
    if not req.sampling_session_id:
        raise ApiError(400, "asample needs a sampling_session_id (create a sampling client first)")
    row = gw.sampler(req.sampling_session_id, owner)
    if not gw.kernels.is_live(row["epoch"]) and row["source_model_id"] is not None:
        raise ApiError(
            404,
            f"sampler {req.sampling_session_id} was a snapshot held by a kernel that was lost since "
            f"({gw.kernels.why_gone(row['epoch'])}); make a new one "
            "(save_weights_and_get_sampling_client)",
        )
    prompt = _prompt(req)
    _check_sample(prompt, req, await gw.card(row["base_model"]))
    sp = req.sampling_params
    stop = [sp.stop] if isinstance(sp.stop, str) else sp.stop
    params = SamplingParams(
        max_tokens=sp.max_tokens or 1,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        seed=sp.seed,
        stop=list(stop) if stop is not None else None,
    )
    sampler_id = req.sampling_session_id

    async def call():
        now = gw.store.sampler(sampler_id, owner)  # an earlier request may have reopened it
        assert now is not None  # found above, and sampler rows are never deleted (freeing marks them)
        epoch = now["epoch"]
        if not gw.kernels.is_live(epoch):
            # Its kernel was lost: a sampler on a saved checkpoint or a base model (a snapshot was refused
            # above) can be reopened on another.
            path = gw.checkpoint(row["model_path"], owner, readable=True)["fs_path"] if row["model_path"] else None
            kernel = await gw.place(purpose="sample", base_model=row["base_model"])
            await gw.kernel_call(
                kernel,
                lambda k: k.open_sampler(
                    sampler_id=sampler_id, base_model=None if path else row["base_model"], path=path, owner=owner
                ),
            )
            gw.store.add_sampler(
                sampler_id, owner, row["session_id"], row["base_model"], row["model_path"], None, kernel.epoch
            )
            epoch = kernel.epoch
        async with gw.sample_slots:
            result = await gw.kernel_call(
                epoch,
                lambda k: k.sample(
                    sampler_id=sampler_id,
                    prompt=prompt,
                    num_samples=req.num_samples,
                    params=params,
                    want_prompt_logprobs=bool(req.prompt_logprobs),
                    topk_prompt_logprobs=req.topk_prompt_logprobs,
                    topk_sample_logprobs=req.topk_sample_logprobs,
                ),
            )
        plp, topk = result.prompt_logprobs, result.topk_prompt_logprobs
        if req.prompt_logprobs_last_n is not None:  # positions before the last n are not scored (SDK-checked)
            cut = max(len(prompt) - req.prompt_logprobs_last_n, 0)
            if plp is not None:
                plp = [math.nan] * cut + plp[cut:]
            if topk is not None:
                topk = wire.blank_topk_rows(topk, cut)
        return result.sequences, plp, topk

    rid, new = gw.new_future(owner, "sample", sampler_id, req.seq_id)
    if new:
        gw.spawn(rid, call, lambda r: (PROTO, wire.encode_sample_response(*r)))
    return {"request_id": rid, "model_id": None, "sample_sequence_ids": [f"{rid}:{i}" for i in range(req.num_samples)]}
