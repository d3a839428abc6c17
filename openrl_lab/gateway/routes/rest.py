"""REST (RestClient): training runs, checkpoints (list, delete, publish, ttl, weights info), sessions; and the
SDK features this server does not offer, refused with a 400 naming them (not a bare 404/405)."""

from __future__ import annotations

import json
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import pydantic
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse
from packaging.version import InvalidVersion, Version

from openrl_lab.gateway.bodies import INT64_MAX
from openrl_lab.gateway.deps import Gw, User, api_router
from openrl_lab.gateway.downloads import DOWNLOAD_PREFIX, EXPORT_DIR, URL_TTL_S, BadDownload
from openrl_lab.gateway.errors import ApiError, not_found
from openrl_lab.gateway.gateway import MAX_TTL_S, Gateway
from openrl_lab.gateway.store import loads, loads_metadata

router = api_router(tags=["rest"])
download_router = APIRouter(tags=["rest"])  # no key: a signed URL is its own credential (gateway/downloads.py)
FORMAT_DOC = (
    "what to export: peft (a LoRA run's adapter, the default), merged (a LoRA run merged into its base "
    "model, a Hugging Face model), hf (a full fine-tuning run, the default there)"
)
Limit = Annotated[int, Query(ge=1, le=10_000)]
Offset = Annotated[int, Query(ge=0, le=INT64_MAX)]  # SQLite takes no larger integer


class TtlRequest(pydantic.BaseModel):
    ttl_seconds: int | None = pydantic.Field(None, gt=0, le=MAX_TTL_S)


class WeightsInfoRequest(pydantic.BaseModel):
    tinker_path: str


class ProjectRequest(pydantic.BaseModel):
    project_id: str | None = None


def _iso(ts: float | None) -> str | None:
    try:
        return datetime.fromtimestamp(ts, UTC).isoformat() if ts else None
    except (OverflowError, ValueError, OSError):  # a row written before expiry times were bounded
        return None


def _checkpoint_json(row) -> dict:
    return {
        "checkpoint_id": row["checkpoint_id"],
        "checkpoint_type": row["checkpoint_type"],
        "time": _iso(row["created_at"]),
        "tinker_path": row["tinker_path"],
        "size_bytes": row["size_bytes"],
        "public": bool(row["public"]),
        "user_metadata": loads_metadata(row["user_metadata"]),
        "expires_at": _iso(row["expires_at"]),
    }


def _run_json(gw: Gateway, row) -> dict:
    lora = loads(row["lora"])
    last = {kind: gw.store.last_checkpoint(row["owner"], row["model_id"], kind) for kind in ("training", "sampler")}
    return {
        "training_run_id": row["model_id"],
        "base_model": row["base_model"],
        "model_owner": row["owner"],
        "is_lora": lora is not None,
        "corrupted": False,
        "lora_rank": lora["rank"] if lora else None,
        "last_request_time": _iso(row["last_request_time"]),
        "last_checkpoint": _checkpoint_json(last["training"]) if last["training"] else None,
        "last_sampler_checkpoint": _checkpoint_json(last["sampler"]) if last["sampler"] else None,
        "user_metadata": loads_metadata(row["user_metadata"]),
    }


def _run_row(gw: Gateway, run_id: str, owner: str):
    row = gw.store.model(run_id, owner)
    if row is None:
        raise not_found(f"training run {run_id}")
    return row


@router.get("/training_runs")
async def list_training_runs(gw: Gw, owner: User, limit: Limit = 20, offset: Offset = 0):
    rows, total = gw.store.list_models(owner, limit, offset)
    return {
        "training_runs": [_run_json(gw, r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, gw: Gw, owner: User):
    return _run_json(gw, _run_row(gw, run_id, owner))


def known_kinds(request: Request) -> tuple[str, ...] | None:
    """The checkpoint types the calling SDK can read (None: all). tinker before 0.28 knows no "external"
    checkpoints (save_weights_external came with them) and fails to read a listing that holds one."""
    version = request.headers.get("x-stainless-package-version", "")
    try:
        old = Version(version) < Version("0.28")
    except InvalidVersion:  # no SDK, or not one that says: everything
        return None
    return ("training", "sampler") if old else None


Kinds = Annotated[tuple[str, ...] | None, Depends(known_kinds)]


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(run_id: str, gw: Gw, owner: User, kinds: Kinds):
    _run_row(gw, run_id, owner)
    rows, total = gw.store.list_checkpoints(owner, run_id, kinds=kinds)
    return {
        "checkpoints": [_checkpoint_json(r) for r in rows],
        "cursor": {"offset": 0, "limit": len(rows), "total_count": total},
    }


@router.get("/checkpoints")
async def list_user_checkpoints(gw: Gw, owner: User, kinds: Kinds, limit: Limit = 100, offset: Offset = 0):
    rows, total = gw.store.list_checkpoints(owner, None, limit, offset, kinds)
    return {
        "checkpoints": [_checkpoint_json(r) for r in rows],
        "cursor": {"offset": offset, "limit": limit, "total_count": total},
    }


# --- one checkpoint: its id holds a '/' (weights/<name>), some routes end in an action (/publish, /ttl) ---
def _ckpt_path(run_id: str, checkpoint_id: str) -> str:
    return f"tinker://{run_id}/{checkpoint_id}"


def _ckpt_action(gw: Gateway, owner: str, run_id: str, checkpoint_id: str, action: str, readable: bool = False):
    """The caller's checkpoint row (`readable`: or a published one) for routes of the form
    .../checkpoints/{checkpoint_id}/{action}."""
    if not checkpoint_id.endswith("/" + action):
        raise ApiError(404, f"no such endpoint for checkpoint {checkpoint_id}")
    return gw.checkpoint(_ckpt_path(run_id, checkpoint_id[: -len(action) - 1]), owner, readable=readable)


def delete_checkpoint_files(gw: Gateway, row) -> None:
    shutil.rmtree(row["fs_path"], ignore_errors=True)
    gw.store.delete_checkpoint(row["tinker_path"])


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, gw: Gw, owner: User):
    if checkpoint_id.endswith("/publish"):
        gw.store.set_checkpoint_public(_ckpt_action(gw, owner, run_id, checkpoint_id, "publish")["tinker_path"], False)
        return {}
    delete_checkpoint_files(gw, gw.checkpoint(_ckpt_path(run_id, checkpoint_id), owner))
    return {}


@router.post("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def publish_checkpoint(run_id: str, checkpoint_id: str, gw: Gw, owner: User):
    gw.store.set_checkpoint_public(_ckpt_action(gw, owner, run_id, checkpoint_id, "publish")["tinker_path"], True)
    return {}


@router.put("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def checkpoint_ttl(run_id: str, checkpoint_id: str, req: TtlRequest, gw: Gw, owner: User):
    row = _ckpt_action(gw, owner, run_id, checkpoint_id, "ttl")
    gw.store.set_checkpoint_ttl(row["tinker_path"], req.ttl_seconds)
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def checkpoint_get(
    run_id: str,
    checkpoint_id: str,
    gw: Gw,
    owner: User,
    request: Request,
    fmt: Annotated[str | None, Query(alias="format", description=FORMAT_DOC)] = None,
):
    """.../external_weights_urls: signed URLs, one per file, of the checkpoint's weights exported (the SDK asks
    for external_weights checkpoints only; this server exports training and sampler checkpoints too)."""
    row = _ckpt_action(gw, owner, run_id, checkpoint_id, "external_weights_urls", readable=True)
    export = await gw.kernel_call(None, lambda k: k.export_weights(path=row["fs_path"], fmt=fmt))  # written once
    expires = time.time() + URL_TTL_S
    base = str(request.base_url).rstrip("/")

    def url(name: str) -> str:
        token = gw.downloads.sign(owner, row["tinker_path"], export.format, name, expires)
        return f"{base}{DOWNLOAD_PREFIX}{token}/{quote(name)}"

    return {"urls": {name: url(name) for name in export.files}, "expires": _iso(expires), "format": export.format}


@download_router.get(
    DOWNLOAD_PREFIX.removeprefix("/api/v1") + "{token}/{file}",
    response_class=FileResponse,
    responses={
        403: {"description": "a download URL altered, not this server's, or expired"},
        404: {"description": "the checkpoint was deleted, unpublished, or has no such file"},
    },
)
async def download(token: str, file: str, request: Request):
    """One file of exported weights, by a URL that get_external_weights_urls signed: no key needed."""
    gw: Gateway = request.app.state.gateway
    try:
        grant = gw.downloads.check(token, file)
    except BadDownload as e:
        raise ApiError(403, str(e)) from None
    row = gw.checkpoint(grant.tinker_path, grant.owner, readable=True)  # still theirs, or still published
    folder = Path(row["fs_path"]) / EXPORT_DIR / grant.fmt
    path = folder / file
    if "/" in file or file.startswith(".") or not path.is_file():
        raise ApiError(404, f"checkpoint {grant.tinker_path} has no exported file {file!r} any more")
    return FileResponse(path, media_type="application/octet-stream")


@router.post("/weights_info")
async def weights_info(req: WeightsInfoRequest, gw: Gw, owner: User):
    row = gw.checkpoint(req.tinker_path, owner, readable=True)
    try:
        meta = json.loads((Path(row["fs_path"]) / "meta.json").read_text())
    except (OSError, ValueError):
        raise ApiError(404, f"checkpoint {req.tinker_path} has no readable files on the server any more") from None
    lora = meta.get("lora")
    return {
        "base_model": meta["base_model"],
        "is_lora": lora is not None,
        "lora_rank": lora["rank"] if lora else None,
        **({k: lora[k] for k in ("train_unembed", "train_mlp", "train_attn")} if lora else {}),
    }


# --- sessions -------------------------------------------------------------------------------------------
@router.get("/sessions")
async def list_sessions(gw: Gw, owner: User, limit: Limit = 20, offset: Offset = 0):
    return {"sessions": gw.store.list_sessions(owner, limit, offset)}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, gw: Gw, owner: User):
    row = gw.session(session_id, owner)
    return {
        "training_run_ids": gw.store.session_models(session_id),
        "sampler_ids": gw.store.session_samplers(session_id),
        "user_metadata": loads_metadata(row["user_metadata"]),
        "display_name": row["display_name"],
    }


@router.put("/sessions/{session_id}/project")
async def session_project(session_id: str, req: ProjectRequest, gw: Gw, owner: User):
    gw.session(session_id, owner)
    gw.store.set_session_project(session_id, req.project_id)
    return {}


# --- SDK features this server does not offer -----------------------------------------------------------------
def _not_supported(what: str, why: str) -> ApiError:
    return ApiError(400, f"{what} is not supported by OpenRL Lab: {why}")


NO_ADMIN = "there are no organizations, billing or admin roles"


@router.post("/copy_weights")
async def copy_weights():
    raise _not_supported(
        "copy_weights",
        "there are no projects to copy checkpoints between (publish a checkpoint to let other users load it)",
    )


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(session_id: str):
    raise _not_supported("export_session_trace", "no request traces are recorded")


@router.post("/sessions/search")
async def search_sessions():
    raise _not_supported("search_sessions", "use list_sessions and get_session")


@router.get("/audit")
async def audit_log():
    raise _not_supported("get_audit_log", NO_ADMIN)


@router.get("/billing/usage/events")
async def billing_usage():
    raise _not_supported("get_billing_usage", NO_ADMIN)


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage_usage():
    raise _not_supported("get_current_checkpoint_storage_usage", NO_ADMIN)
