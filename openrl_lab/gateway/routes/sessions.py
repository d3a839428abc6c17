"""Client configuration, sessions (create, heartbeat, finish), telemetry and the server's models."""

from __future__ import annotations

import uuid

import pydantic
from tinker import types as tt

from openrl_lab.gateway.deps import Gw, User, api_router
from openrl_lab.gateway.errors import ApiError
from openrl_lab.gateway.gateway import check_metadata
from openrl_lab.gateway.wire import MAX_DATA_PER_REQUEST
from openrl_lab.home import VALIDATED, served_names
from openrl_lab.settings import settings

router = api_router(tags=["sessions"])


class ClientConfigRequest(pydantic.BaseModel):
    """What the SDK sends (declared for the schema; the answer does not depend on it)."""

    sdk_version: str | None = None


class FinishReason(pydantic.BaseModel):
    type: str = pydantic.Field(default="success", max_length=64)


class FinishSessionRequest(pydantic.BaseModel):
    reason: FinishReason | None = None
    detail: str | None = None


@router.post("/client/config")
async def client_config(body: ClientConfigRequest | None = None):
    # The SDK splits a forward_backward into chunks of at most what one request may carry (smaller: tests).
    chunk_len = min(settings().lab_fwdbwd_chunk_len or MAX_DATA_PER_REQUEST, MAX_DATA_PER_REQUEST)
    return {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": True,
        # tinker 0.24 sends forward_backward as JSON unless told to send protobuf (and `forward` through it);
        # later SDKs always send protobuf; JSON is still accepted (0.18 knows nothing else).
        "proto_write_fwdbwd": True,
        "fwd_via_fwdbwd": True,
        "proto_compress_fwdbwd": False,
        "parallel_fwdbwd_chunks": True,
        "fwdbwd_max_chunk_len": chunk_len,
    }


@router.post("/client/dynamic_config")
async def dynamic_config(body: ClientConfigRequest | None = None):
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}


@router.post("/create_session")
async def create_session(req: tt.CreateSessionRequest, gw: Gw, owner: User):
    check_metadata(req.user_metadata)
    sid = str(uuid.uuid4())
    gw.store.create_session(sid, owner, req.tags, req.user_metadata or {}, req.display_name, req.project_id)
    return {"session_id": sid, "type": "create_session"}


@router.post("/session_heartbeat")
async def heartbeat(req: tt.SessionHeartbeatRequest, gw: Gw, owner: User):
    row = gw.session(req.session_id, owner)
    if row["finished"]:
        raise ApiError(410, f"session {req.session_id} is finished ({row['finished']}); its runs were freed")
    gw.store.touch_session(req.session_id)
    gw.liveness.touch(req.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, gw: Gw, owner: User, body: FinishSessionRequest | None = None):
    gw.session(session_id, owner)
    reason = body.reason if body and body.reason else FinishReason()
    gw.store.finish_session(session_id, reason.type)
    # Its runs leave the kernel in the background: a drop waits for the kernel's running call to end.
    gw.background(gw.liveness.end(session_id, reason.type, "finished by its client"))
    return {}


# The SDK's telemetry batches are accepted and discarded, unread.
@router.post(
    "/telemetry",
    openapi_extra={
        "requestBody": {
            "content": {
                "application/json": {
                    "schema": {"type": "object", "description": "the SDK's telemetry batch (discarded)"}
                }
            }
        }
    },
)
async def telemetry():
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def capabilities(gw: Gw):
    """The built-in models and the operator's catalog, each with its context length, its family and what tests
    validate for that family (`home.VALIDATED`); a catalog model the kernels cannot load says why."""
    models = []
    for name in served_names():
        try:
            card = await gw.card(name)
        except ApiError as e:
            models.append({"model_name": name, "trainable": False, "sampleable": False, "problem": e.message})
            continue
        models.append(
            {
                "model_name": name,
                "max_context_length": card.max_context_length,
                "trainable": True,
                "sampleable": True,
                "family": card.family,
                "architecture": card.arch,
                "num_parameters": card.num_parameters,
                "validated": list(VALIDATED.get(card.family, ())),
            }
        )
    return {"supported_models": models}
