"""Training: create a model (or load one from a checkpoint), forward_backward, optim_step, save."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path

from fastapi import Request
from tinker import types as tt

from openrl_lab.gateway import wire
from openrl_lab.gateway.bodies import MAX_JSON_FWDBWD_BODY, MAX_PROTO_BODY, MiB
from openrl_lab.gateway.deps import Gw, User, api_router, is_loopback
from openrl_lab.gateway.errors import ApiError
from openrl_lab.gateway.gang import is_gang, ranks_of
from openrl_lab.gateway.gateway import Gateway, encode_json, tokenizer_paths, ttl_problem
from openrl_lab.gateway.store import job_of, loads
from openrl_lab.gateway.wire import PROTO
from openrl_lab.kernel.api import AdamSettings, JobSlicing, KernelApi, LoraSettings
from openrl_lab.kernel.client import KernelError, KernelNotFound
from openrl_lab.memory import FULL_FINETUNE_RANK, MAX_LORA_RANK, full_finetune_bytes
from openrl_lab.train.loss_spec import DataError, LossInputError

router = api_router(tags=["training"])
PROTOBUF_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            PROTO: {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "a tinker_public.ForwardBackwardRequest protobuf (tinker.proto), "
                    "optionally zstd-encoded (Content-Encoding: zstd)",
                }
            },
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": "the same request as JSON, as tinker SDKs before 0.25 send it "
                    "(forward_backward_input, model_id, seq_id)",
                }
            },
        },
    }
}


def _check_optimizer(config: tt.OptimizerConfig | None) -> None:
    if config is not None and config.type != "adamw":
        raise ApiError(400, f"optimizer {config.type!r} is not supported; use adamw")


def _lora(config: tt.LoraConfig | None) -> dict | None:
    """The job's LoRA settings, or None for full fine-tuning: no lora_config, or rank 0 (the SDK's
    create_lora_training_client always sends a lora_config, with the rank as given: 0 means no adapter, every
    weight trained)."""
    if config is None:
        return None
    if config.rank == FULL_FINETUNE_RANK:
        if not (config.train_mlp and config.train_attn and config.train_unembed):
            raise ApiError(
                400,
                "rank 0 asks for full fine-tuning, which trains every weight: train_mlp, train_attn "
                "and train_unembed must stay True (a LoRA rank >= 1 can leave some out)",
            )
        return None
    if not 1 <= config.rank <= MAX_LORA_RANK:
        raise ApiError(
            400,
            f"lora rank {config.rank} is out of range: 1 to {MAX_LORA_RANK} for LoRA, or 0 for full "
            "fine-tuning (no adapter, every weight trained)",
        )
    return config.model_dump()


@router.post("/create_model")
async def create_model(req: tt.CreateModelRequest, gw: Gw, owner: User):
    gw.session(req.session_id, owner)
    _check_optimizer(req.optimizer_config)
    lora = _lora(req.lora_config)
    card = await gw.card(req.base_model)  # an unknown base model is a 400 now, not a failed future later
    needs = None if lora else full_finetune_bytes(card.num_parameters)

    async def create(model_id: str, slicing: dict, kernel):
        # The job's lease is the user's (their quota and view), named after the model unless they chose.
        await gw.kernel_call(
            kernel,
            lambda k: k.create_job(
                job_id=model_id,
                base_model=req.base_model,
                lora=LoraSettings(**lora) if lora else None,
                seed=lora.get("seed") if lora else None,
                slicing=JobSlicing(owner=owner, **slicing),
            ),
        )
        return req.base_model, lora

    async def create_gang(model_id: str, slicing: dict, kernels):
        groups = [k.group for k in kernels]
        await gw.make_gang(model_id, kernels, _gang_job(model_id, req.base_model, lora, groups, owner, slicing))
        return req.base_model, lora

    return await gw.start_job(
        owner,
        req.session_id,
        req.model_seq_id,
        "create_model",
        req.user_metadata,
        create,
        {},
        base_model=req.base_model,
        needs_bytes=needs,
        create_gang=create_gang,
    )


def _gang_job(model_id: str, base_model: str, lora: dict | None, groups: list[str], owner: str, slicing: dict):
    """How each kernel makes its rank of a new run on `len(groups)` devices (Gateway.make_gang): each rank's lease
    is on its own kernel's group (`openrl_group` named rank 0's), under the run's lease name."""

    def make(k: KernelApi, rank: int, master: str, gang_phase: str):
        return k.create_gang_job(
            job_id=model_id,
            base_model=base_model,
            lora=LoraSettings(**lora) if lora else None,
            seed=lora.get("seed") if lora else None,
            slicing=JobSlicing(owner=owner, **(slicing | {"group": groups[rank]})),
            rank=rank,
            world_size=len(groups),
            master=master,
            gang_phase=gang_phase,
        )

    return make


@router.post("/load_weights")
async def load_weights(req: tt.LoadWeightsRequest, gw: Gw, owner: User):
    ck = gw.checkpoint(req.path, owner, readable=True)
    if ck["checkpoint_type"] != "training":
        raise ApiError(
            400,
            f"{req.path} is a {ck['checkpoint_type']} checkpoint; load_weights needs one saved "
            "with save_state (a tinker://.../weights/... path)",
        )
    if req.model_id is not None:  # legacy TrainingClient.load_state on an existing model
        row = gw.model(req.model_id, owner)
        return gw.submit(
            req.model_id,
            req.seq_id,
            owner,
            "load_weights",
            lambda: gw.model_call(
                row,
                lambda k: k.load_state(job_id=job_of(row), path=ck["fs_path"], include_optimizer=req.optimizer),
            ),
            lambda _: encode_json({"path": req.path, "type": "load_weights"}),
            row,
        )
    if req.session_id is None or req.model_seq_id is None:
        raise ApiError(400, "load_weights needs either model_id + seq_id or session_id + model_seq_id")
    _check_optimizer(req.optimizer_config)
    gw.session(req.session_id, owner)

    async def create(model_id: str, slicing: dict, kernel):
        made = await gw.kernel_call(
            kernel,
            lambda k: k.create_job_from_checkpoint(
                job_id=model_id,
                path=ck["fs_path"],
                with_optimizer=req.optimizer,
                slicing=JobSlicing(owner=owner, **slicing),
            ),
        )
        return made.model.name, asdict(made.lora) if made.lora else None

    async def create_gang(model_id: str, slicing: dict, kernels):
        # The ranks are made empty from the checkpoint's base model and LoRA settings, then all load it (a
        # checkpoint saved on any number of devices loads on any other: it holds whole tensors).
        try:
            meta = json.loads((Path(ck["fs_path"]) / "meta.json").read_text())
            base_model, lora = meta["base_model"], meta.get("lora")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ApiError(400, f"checkpoint {req.path} cannot be read ({e})") from None
        groups = [k.group for k in kernels]
        await gw.make_gang(model_id, kernels, _gang_job(model_id, base_model, lora, groups, owner, slicing))
        ranks = [k.epoch for k in kernels]
        try:
            await gw.model_call(
                {"model_id": model_id, "epoch": ranks[0], "ranks": json.dumps(ranks)},
                lambda k: k.load_state(job_id=model_id, path=ck["fs_path"], include_optimizer=req.optimizer),
            )
        except BaseException:
            await gw.drop_ranks({"model_id": model_id, "job_id": None, "epoch": ranks[0], "ranks": json.dumps(ranks)})
            raise
        return base_model, lora

    return await gw.start_job(
        owner,
        req.session_id,
        req.model_seq_id,
        "load_weights",
        req.user_metadata,
        create,
        {"path": req.path},
        create_gang=create_gang,
    )


@router.post("/get_info")
async def get_info(req: tt.GetInfoRequest, gw: Gw, owner: User, request: Request):
    row = gw.model(req.model_id, owner)
    card = await gw.card(row["base_model"])
    lora = loads(row["lora"])
    # The SDK loads the tokenizer from tokenizer_id. A client on this machine gets the model's directory when
    # it exists here (kernels may run on other hosts): it loads from there without asking a model hub (which,
    # by name, would retry for ~45 s offline, or fail online: the built-in models are not on any hub). Any other
    # client gets the repo id under which the /hf mirror serves the tokenizer (HF_ENDPOINT=<base_url>/hf).
    local = tokenizer_paths() and is_loopback(request.scope) and os.path.isdir(card.path)
    try:  # what the job trains, as its kernel counted it; a job its kernel lost still has its other facts
        trained = asdict(await gw.kernel_call(row["epoch"], lambda k: k.trained_weights(job_id=job_of(row))))
    except (KernelNotFound, KernelError):
        trained = None
    return {
        "model_id": req.model_id,
        "type": "get_info",
        "model_data": {
            "arch": card.arch,
            "model_name": row["base_model"],
            "tokenizer_id": str(card.path) if local else gw.tokenizer_id(row["base_model"]),
        },
        "is_lora": lora is not None,
        "lora_rank": lora["rank"] if lora else None,
        "model_name": row["base_model"],
        "trained": trained,
        "placement": gw.placement(row),
        "devices": len(ranks_of(row)),
    }


@router.post("/forward_backward", max_body_size=MAX_PROTO_BODY, openapi_extra=PROTOBUF_BODY)
async def forward_backward(request: Request, gw: Gw, owner: User):
    return await _forward_backward(request, gw, owner, forward_only=False)


@router.post("/forward", max_body_size=MAX_JSON_FWDBWD_BODY)
async def forward(request: Request, gw: Gw, owner: User):
    """What tinker SDKs before 0.25 send for `forward` (JSON): newer ones send a forward_backward, forward_only."""
    return await _forward_backward(request, gw, owner, forward_only=True)


async def _forward_backward(request: Request, gw: Gateway, owner: str, forward_only: bool):
    """A forward_backward as protobuf (tinker >= 0.25, and 0.24 as told by client/config), or as JSON (older
    SDKs; `/forward` is JSON only); both decode to the same protobuf. Decoding runs in worker threads: a large (or
    hostile) body never holds up the event loop."""
    body = await request.body()
    as_json = forward_only or "json" in request.headers.get("content-type", "")
    try:
        if as_json:
            if len(body) > MAX_JSON_FWDBWD_BODY:
                raise ApiError(
                    413,
                    f"a JSON forward_backward body is at most {MAX_JSON_FWDBWD_BODY // MiB} MiB (this one is "
                    f"{len(body) / MiB:.1f} MiB): send fewer datums per request, or send protobuf",
                )
            given = await asyncio.to_thread(wire.parse_forward_backward_json, body, forward_only)
            model_id, seq_id = given.model_id, given.seq_id or 0
        else:
            msg = await asyncio.to_thread(wire.parse_forward_backward, body, request.headers.get("content-encoding"))
            model_id, seq_id = msg.model_id, msg.seq_id
    except wire.WireError as e:
        raise ApiError(400, str(e)) from None
    row = gw.model(model_id, owner)
    card = await gw.card(row["base_model"])
    try:
        if as_json:
            msg = await asyncio.to_thread(wire.forward_backward_from_json, given)
        call = await asyncio.to_thread(wire.decode_forward_backward, msg, card.vocab_size, card.max_context_length)
    except (wire.WireError, DataError, LossInputError) as e:
        raise gw.refuse(model_id, seq_id, 400, str(e)) from None
    return gw.submit_op(
        row,
        seq_id or None,
        owner,
        "forward_backward",
        lambda k: k.forward_backward(
            job_id=job_of(row),
            data=call.data,
            loss_fn=call.loss_fn,
            loss_fn_config=call.loss_fn_config,
            backward=not call.forward_only,
        ),
        lambda r: (PROTO, wire.encode_forward_backward_output(r.logprobs, r.metrics)),
    )


@router.post("/optim_step")
async def optim_step(req: tt.OptimStepRequest, gw: Gw, owner: User):
    row = gw.model(req.model_id, owner)
    p = req.optim_params
    if not isinstance(p, tt.AdamParams):
        raise gw.refuse(req.model_id, req.seq_id, 400, "only AdamW optimizer params are supported")
    adam = AdamSettings(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
    values = asdict(adam)
    bad = [k for k, v in values.items() if not math.isfinite(v) or v < 0]
    bad += [k for k in ("beta1", "beta2") if values[k] >= 1]
    if bad:
        values = ", ".join(f"{k}={values[k]}" for k in bad)
        raise gw.refuse(
            req.model_id, req.seq_id, 400, f"invalid adam_params {values}: values must be finite and >= 0, betas < 1"
        )
    return gw.submit_op(
        row,
        req.seq_id,
        owner,
        "optim_step",
        lambda k: k.optim_step(job_id=job_of(row), adam=adam),
        lambda metrics: encode_json({"metrics": metrics, "type": "optim_step"}),
    )


async def _save(
    gw: Gateway,
    owner: str,
    req: tt.SaveWeightsRequest | tt.SaveWeightsForSamplerRequest | tt.SaveWeightsExternalRequest,
    kind: str,
) -> dict:
    """A named checkpoint of the model (save_state: kind "training"; save_weights_for_sampler: "sampler";
    save_weights_external: "external", the weights exported as a PEFT adapter or a Hugging Face model)."""
    row = gw.model(req.model_id, owner)
    name = req.path or f"ckpt-{int(time.time() * 1000)}"
    segment = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}[kind]
    try:
        target = gw.checkpoint_dir(owner, req.model_id, segment, name)
    except ValueError as e:
        raise gw.refuse(req.model_id, req.seq_id, 400, str(e)) from None
    if problem := ttl_problem(req.ttl_seconds):  # refused before any file is written
        raise gw.refuse(req.model_id, req.seq_id, 400, problem)
    tinker_path = f"tinker://{req.model_id}/{segment}/{name}"
    overwrite = bool(getattr(req, "overwrite", False))
    if target.exists() and not overwrite and req.seq_id is not None and gw.store.checkpoint(tinker_path, owner):
        raise gw.refuse(
            req.model_id,
            req.seq_id,
            400,
            f"checkpoint {tinker_path} already exists; choose another name or pass overwrite=True",
        )
    meta = {
        "base_model": row["base_model"],
        "lora": loads(row["lora"]),
        "training_run_id": row["model_id"],
        "checkpoint_kind": kind,
    }

    async def call():
        job_id, path = job_of(row), str(target)

        def save(k: KernelApi) -> int:
            if kind == "training":
                return k.save_state(job_id=job_id, path=path, include_optimizer=True, meta=meta, overwrite=overwrite)
            return k.save_sampler_weights(job_id=job_id, path=path, meta=meta, overwrite=True)

        size = await gw.model_call(row, save)
        if kind == "external":  # its size is what a download fetches
            export = await gw.kernel_call(row["epoch"], lambda k: k.export_weights(path=path))
            size = sum(export.files.values())
        # Recorded only after the files are in place: an acknowledged checkpoint is durable.
        gw.store.add_checkpoint(
            tinker_path,
            owner,
            req.model_id,
            f"{segment}/{name}",
            kind,
            str(target),
            size,
            req.ttl_seconds,
            getattr(req, "user_metadata", None),
        )
        answer = {
            "training": "save_weights",
            "sampler": "save_weights_for_sampler",
            "external": "save_weights_external",
        }[kind]
        return {"path": tinker_path, "type": answer} | ({"size_bytes": size} if kind == "external" else {})

    return gw.submit(req.model_id, req.seq_id, owner, f"save_{kind}", call, encode_json, row)


@router.post("/save_weights")
async def save_weights(req: tt.SaveWeightsRequest, gw: Gw, owner: User):
    return await _save(gw, owner, req, "training")


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(req: tt.SaveWeightsForSamplerRequest, gw: Gw, owner: User):
    if req.path is not None:
        return await _save(gw, owner, req, "sampler")
    row = gw.model(req.model_id, owner)
    if req.sampling_session_seq_id is None:
        raise gw.refuse(
            req.model_id, req.seq_id, 400, "save_weights_for_sampler needs a path or a sampling_session_seq_id"
        )
    session_id = row["session_id"]
    sampler_id = f"{session_id}:sample:{req.sampling_session_seq_id}"

    async def call():
        # The sampler goes to the sampler group's kernel. On the trainer's own kernel it is an in-memory
        # snapshot; on another kernel it gets the weights through the checkpoint store (one file per run,
        # overwritten: the sampler reads it whole before the run's next request runs).
        kernel = await gw.place(purpose="sample", base_model=row["base_model"])
        if kernel.epoch == row["epoch"] and not is_gang(row):  # a gang's weights are whole only once gathered
            await gw.kernel_call(kernel, lambda k: k.snapshot_sampler(job_id=job_of(row), sampler_id=sampler_id))
        else:
            path = str(gw.checkpoint_root / owner / req.model_id / "sampler_snapshot")
            meta = {
                "base_model": row["base_model"],
                "lora": loads(row["lora"]),
                "training_run_id": req.model_id,
                "checkpoint_kind": "sampler",
            }
            await gw.model_call(
                row, lambda k: k.save_sampler_weights(job_id=job_of(row), path=path, meta=meta, overwrite=True)
            )
            await gw.kernel_call(
                kernel, lambda k: k.open_sampler(sampler_id=sampler_id, base_model=None, path=path, owner=owner)
            )
        gw.store.add_sampler(sampler_id, owner, session_id, row["base_model"], None, req.model_id, kernel.epoch)
        return {"sampling_session_id": sampler_id, "path": None, "type": "save_weights_for_sampler"}

    return gw.submit(req.model_id, req.seq_id, owner, "save_sampler", call, encode_json, row)


@router.post("/save_weights_external")
async def save_weights_external(req: tt.SaveWeightsExternalRequest, gw: Gw, owner: User):
    """The model's weights as files other tools load (a PEFT adapter for LoRA runs, a Hugging Face model for full
    fine-tuning), downloaded through get_external_weights_urls."""
    gw.model(req.model_id, owner)
    if req.age_encryption_recipients:
        raise gw.refuse(
            req.model_id,
            req.seq_id,
            400,
            "age_encryption_recipients is not supported by OpenRL Lab: "
            "exported weights are stored and served unencrypted",
        )
    return await _save(gw, owner, req, "external")
