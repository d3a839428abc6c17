"""The gateway: the Tinker HTTP API (see docs/architecture.md) in front of the kernels.

It authenticates keys, checks ownership and input, orders each model's requests by seq_id, turns each
request into one kernel call, and hands results back through long-polled futures. It never touches
tensors: requests are decoded to numpy and passed on; results come back as plain arrays.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import time
import uuid
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import pydantic
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from tinker import types as tt

from openrl_lab import __version__
from openrl_lab.gateway import wire
from openrl_lab.gateway.lanes import Lane
from openrl_lab.gateway.leases import lease_options
from openrl_lab.gateway.store import Store, loads
from openrl_lab.home import BUILTIN_MODEL_NAMES
from openrl_lab.kernel.client import KernelError, KernelNotFound, KernelUserError
from openrl_lab.kernel.pool import KernelPool
from openrl_lab.train.loss_spec import DataError, LossInputError

log = logging.getLogger("openrl_lab.gateway")
PROTO = "application/x-protobuf"
LONG_POLL_S = 25.0  # the SDK's read timeout for retrieve_future is 45 s
M = TypeVar("M", bound=pydantic.BaseModel)


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def not_found(what: str) -> ApiError:
    return ApiError(404, f"{what} not found (or not yours)")


class Gateway:
    """State shared by the routes: the store, the kernels, the lanes and the in-flight futures."""

    def __init__(self, home: Path, store: Store, kernels: KernelPool):
        self.home = home
        self.store = store
        self.kernels = kernels
        self.lanes: dict[str, Lane] = {}
        self.done_events: dict[str, asyncio.Event] = {}
        self.cards: dict[str, dict] = {}
        self.sample_slots = asyncio.Semaphore(64)

    # --- futures ----------------------------------------------------------------------------------
    def new_future(self, owner: str, kind: str, target: str | None = None, seq_id: int | None = None) -> tuple[str, bool]:
        """(request_id, is_new); a repeated (target, seq_id) gets the first request's id back."""
        rid = uuid.uuid4().hex
        got = self.store.add_future(rid, owner, kind, target, seq_id)
        if got == rid:
            self.done_events[rid] = asyncio.Event()
        return got, got == rid

    def finish(self, rid: str, content_type: str, body: bytes, ok: bool = True) -> None:
        self.store.finish_future(rid, "done" if ok else "error", content_type, body)
        event = self.done_events.pop(rid, None)
        if event:
            event.set()

    def fail(self, rid: str, message: str, category: str) -> None:
        self.finish(rid, "application/json", json.dumps({"error": message, "category": category}).encode(), ok=False)

    async def run(self, rid: str, kernel_call: Callable[[], Awaitable[Any]],
                  encode: Callable[[Any], tuple[str, bytes]]) -> None:
        """Runs one kernel call and settles the future with its result or a named error."""
        try:
            result = await kernel_call()
            content_type, body = encode(result)
            self.finish(rid, content_type, body)
        except (KernelUserError, LossInputError, DataError, wire.WireError, ApiError) as e:
            self.fail(rid, str(e), "user")
        except KernelNotFound as e:
            self.fail(rid, str(e), "user")
        except KernelError as e:
            self.fail(rid, str(e), "server")
        except Exception as e:  # never leave a future pending forever
            log.exception("request %s failed", rid)
            self.fail(rid, f"{type(e).__name__}: {e}", "server")

    def lane(self, model_id: str) -> Lane:
        if model_id not in self.lanes:
            self.lanes[model_id] = Lane()
        return self.lanes[model_id]

    async def kernel_call(self, op: str, **kwargs: Any) -> Any:
        # Starting a kernel takes seconds: only then leave the event loop for it.
        kernel = self.kernels.running() or await asyncio.to_thread(self.kernels.kernel)
        return await asyncio.to_thread(kernel.call, op, **kwargs)

    async def lease_options(self, user_metadata: dict | None) -> dict:
        """How a new run's phases are time-sliced (its `openrl_*` user_metadata); a 400 for bad values."""
        groups = None
        if self.kernels.orchestrator is not None and any(k.startswith("openrl_") for k in (user_metadata or {})):
            groups = await asyncio.to_thread(self.kernels.groups)
        try:
            return lease_options(user_metadata, groups, self.kernels.group)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def card(self, base_model: str) -> dict:
        if base_model not in self.cards:
            try:
                self.cards[base_model] = await self.kernel_call("model_info", base_model=base_model)
            except KernelUserError as e:
                raise ApiError(400, str(e)) from None
        return self.cards[base_model]

    # --- ownership --------------------------------------------------------------------------------
    def session(self, session_id: str, owner: str):
        row = self.store.session(session_id, owner)
        if row is None:
            raise not_found(f"session {session_id}")
        return row

    def model(self, model_id: str, owner: str):
        row = self.store.model(model_id, owner)
        if row is None:
            raise not_found(f"model {model_id}")
        if row["epoch"] != self.kernels.epoch:
            raise ApiError(404, f"model {model_id} is no longer resident: its kernel restarted since it was "
                                "created. Load it from your last checkpoint (create_training_client_from_state).")
        self.store.touch_model(model_id)
        return row

    def checkpoint(self, tinker_path: str, owner: str, readable: bool = False):
        row = self.store.checkpoint(tinker_path, owner)
        if row is None and readable:
            row = self.store.public_checkpoint(tinker_path)
        if row is None:
            raise not_found(f"checkpoint {tinker_path}")
        return row

    def checkpoint_dir(self, owner: str, run_id: str, kind: str, name: str) -> Path:
        if not name or "/" in name or name in (".", ".."):
            raise ApiError(400, f"checkpoint name {name!r} is not allowed: use a non-empty name without '/'")
        return self.home / "checkpoints" / owner / run_id / kind / name


class ApiKeyAuth:
    """X-API-Key -> user, as plain ASGI middleware (cheaper than BaseHTTPMiddleware on every request)."""

    OPEN_PATHS = ("/api/v1/healthz", "/docs", "/openapi.json")

    def __init__(self, app, store: Store):
        self.app = app
        self.store = store

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        key = next((v.decode() for k, v in scope["headers"] if k == b"x-api-key"), None)
        user = self.store.user_for_key(key) if key else None
        if user is None:
            msg = "missing X-API-Key header" if not key else "unknown API key"
            return await JSONResponse({"detail": msg, "error": msg}, status_code=401)(scope, receive, send)
        scope.setdefault("state", {})["user"] = user
        return await self.app(scope, receive, send)


def _json(obj: Any, status: int = 200) -> JSONResponse:
    if isinstance(obj, pydantic.BaseModel):
        obj = obj.model_dump(mode="json", exclude_none=True)
    return JSONResponse(obj, status_code=status)


def _iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat() if ts else None


def _job(row) -> str:
    """The kernel job a model handle drives: its own id, or the job it reattached to (the notebook layer)."""
    return row["job_id"] or row["model_id"]


def _encode_json(result: Any) -> tuple[str, bytes]:
    return "application/json", json.dumps(result).encode()


async def _body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])
        raise ApiError(400, f"invalid {model.__name__}: {problems}") from None


def create_app(home: Path, store: Store, kernels: KernelPool) -> FastAPI:
    gw = Gateway(home, store, kernels)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        failed = store.fail_pending_futures("the server restarted before this request finished; send it again")
        if failed:
            log.warning("marked %d unfinished futures from before the restart as failed", failed)
        reaper = asyncio.create_task(_reap_expired(gw))
        yield
        reaper.cancel()

    app = FastAPI(title="OpenRL Lab (Tinker API)", version=__version__, lifespan=lifespan)
    app.state.gateway = gw

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        # Never an empty 400: the SDK would retry it as a proxy artefact.
        return JSONResponse({"detail": exc.message, "error": exc.message}, status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        return JSONResponse({"detail": exc.detail, "error": str(exc.detail)}, status_code=exc.status_code)

    app.add_middleware(ApiKeyAuth, store=store)

    def user(request: Request) -> str:
        return request.state.user

    api = "/api/v1"

    from openrl_lab.gateway.lab_api import add_lab_routes  # here: it imports this module's ApiError

    add_lab_routes(app, gw, _body, user)

    # --- client configuration, sessions, telemetry --------------------------------------------------
    @app.get(f"{api}/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post(f"{api}/client/config")
    async def client_config(request: Request):
        config = {"pjwt_auth_enabled": False, "use_pyqwest_transport": True, "proto_compress_fwdbwd": False,
                  "parallel_fwdbwd_chunks": True}
        if chunk_len := os.environ.get("OPENRL_LAB_FWDBWD_CHUNK_LEN"):  # smaller chunks: tests, huge batches
            config["fwdbwd_max_chunk_len"] = int(chunk_len)
        return config

    @app.post(f"{api}/client/dynamic_config")
    async def dynamic_config(request: Request):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    @app.post(f"{api}/create_session")
    async def create_session(request: Request):
        req = await _body(request, tt.CreateSessionRequest)
        sid = str(uuid.uuid4())
        store.create_session(sid, user(request), req.tags, req.user_metadata or {}, req.display_name, req.project_id)
        return {"session_id": sid, "type": "create_session"}

    @app.post(f"{api}/session_heartbeat")
    async def heartbeat(request: Request):
        req = await _body(request, tt.SessionHeartbeatRequest)
        row = gw.session(req.session_id, user(request))
        if row["finished"]:
            raise ApiError(410, f"session {req.session_id} is finished")
        store.touch_session(req.session_id)
        return {"type": "session_heartbeat"}

    @app.post(f"{api}/sessions/{{session_id}}/finish")
    async def finish_session(session_id: str, request: Request):
        gw.session(session_id, user(request))
        body = json.loads(await request.body() or b"{}")
        store.finish_session(session_id, (body.get("reason") or {}).get("type", "success"))
        return {}

    @app.post(f"{api}/telemetry")
    async def telemetry(request: Request):
        return {"status": "accepted"}

    @app.get(f"{api}/get_server_capabilities")
    async def capabilities(request: Request):
        models = []
        for name in BUILTIN_MODEL_NAMES:
            card = await gw.card(name)
            models.append({"model_name": name, "max_context_length": card["max_context_length"],
                           "trainable": True, "sampleable": True})
        return {"supported_models": models}

    # --- training -----------------------------------------------------------------------------------
    @app.post(f"{api}/create_model")
    async def create_model(request: Request):
        req = await _body(request, tt.CreateModelRequest)
        owner = user(request)
        gw.session(req.session_id, owner)
        if req.optimizer_config.type != "adamw":
            raise ApiError(400, f"optimizer {req.optimizer_config.type!r} is not supported; use adamw")
        if req.lora_config is not None and not 1 <= req.lora_config.rank <= 1024:
            raise ApiError(400, f"lora rank {req.lora_config.rank} is out of range [1, 1024]")
        await gw.card(req.base_model)  # an unknown base model is a 400 now, not a failed future later
        slicing = await gw.lease_options(req.user_metadata)  # bad openrl_* metadata too
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        rid, new = gw.new_future(owner, "create_model", model_id, 0)
        if new:
            lora = req.lora_config.model_dump() if req.lora_config else None

            async def work():
                # The job's lease is the user's (their quota and view), named after the model unless they chose.
                await gw.kernel_call("create_job", job_id=model_id, base_model=req.base_model, lora=lora,
                                     seed=lora.get("seed") if lora else None, owner=owner, **slicing)
                store.add_model(model_id, owner, req.session_id, req.base_model, lora, req.user_metadata,
                                kernels.epoch)
                gw.lanes.pop(model_id, None)
                return {"model_id": model_id, "type": "create_model"}

            asyncio.create_task(gw.run(rid, work, _encode_json))
        return {"request_id": rid, "model_id": model_id}

    @app.post(f"{api}/get_info")
    async def get_info(request: Request):
        req = await _body(request, tt.GetInfoRequest)
        row = gw.model(req.model_id, user(request))
        card = await gw.card(row["base_model"])
        lora = loads(row["lora"])
        return {"model_id": req.model_id, "type": "get_info",
                "model_data": {"arch": card.get("arch"), "model_name": row["base_model"],
                               "tokenizer_id": card["path"]},
                "is_lora": lora is not None, "lora_rank": lora["rank"] if lora else None,
                "model_name": row["base_model"]}

    @app.post(f"{api}/forward_backward")
    async def forward_backward(request: Request):
        owner = user(request)
        try:
            msg = wire.parse_forward_backward(await request.body(), request.headers.get("content-encoding"))
        except wire.WireError as e:
            raise ApiError(400, str(e)) from None
        row = gw.model(msg.model_id, owner)
        card = await gw.card(row["base_model"])
        lane = gw.lane(msg.model_id)
        try:
            call = wire.decode_forward_backward(msg, card["vocab_size"], card["max_context_length"])
        except (wire.WireError, DataError, LossInputError) as e:
            lane.skip(msg.seq_id)
            raise ApiError(400, str(e)) from None
        rid, new = gw.new_future(owner, "forward_backward", msg.model_id, msg.seq_id or None)
        if new:
            async def work():
                await gw.run(rid, lambda: gw.kernel_call(
                    "forward_backward", job_id=_job(row), data=call.data, loss_fn=call.loss_fn,
                    loss_fn_config=call.loss_fn_config, backward=not call.forward_only),
                    lambda r: (PROTO, wire.encode_forward_backward_output(r["logprobs"], r["metrics"])))
            lane.submit(msg.seq_id or None, work)
        return {"request_id": rid, "model_id": msg.model_id}

    @app.post(f"{api}/optim_step")
    async def optim_step(request: Request):
        req = await _body(request, tt.OptimStepRequest)
        owner = user(request)
        row = gw.model(req.model_id, owner)
        p = req.optim_params
        if not isinstance(p, tt.AdamParams):
            gw.lane(req.model_id).skip(req.seq_id or 0)
            raise ApiError(400, "only AdamW optimizer params are supported")
        adam = {k: getattr(p, k) for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")}
        bad = [k for k, v in adam.items() if not math.isfinite(v) or v < 0] + \
              [k for k in ("beta1", "beta2") if adam[k] >= 1]
        if bad:
            gw.lane(req.model_id).skip(req.seq_id or 0)
            raise ApiError(400, f"invalid adam_params {', '.join(f'{k}={adam[k]}' for k in bad)}: "
                                "values must be finite and >= 0, betas < 1")
        return _submit(req.model_id, req.seq_id, owner, "optim_step",
                       lambda: gw.kernel_call("optim_step", job_id=_job(row), adam=adam),
                       lambda metrics: _encode_json({"metrics": metrics, "type": "optim_step"}))

    def _submit(model_id: str, seq_id: int | None, owner: str, kind: str,
                call: Callable[[], Awaitable[Any]], encode: Callable[[Any], tuple[str, bytes]]) -> dict:
        rid, new = gw.new_future(owner, kind, model_id, seq_id)
        if new:
            async def work():
                await gw.run(rid, call, encode)
            gw.lane(model_id).submit(seq_id, work)
        return {"request_id": rid, "model_id": model_id}

    def _meta(row, kind: str) -> dict:
        return {"base_model": row["base_model"], "lora": loads(row["lora"]), "training_run_id": row["model_id"],
                "checkpoint_kind": kind}

    async def _save(request: Request, req, kind: str, include_optimizer: bool, seq_id: int | None) -> dict:
        owner = user(request)
        row = gw.model(req.model_id, owner)
        name = req.path or f"ckpt-{int(time.time() * 1000)}"
        segment = {"training": "weights", "sampler": "sampler_weights"}[kind]
        try:
            target = gw.checkpoint_dir(owner, req.model_id, segment, name)
        except ApiError:
            gw.lane(req.model_id).skip(seq_id or 0)
            raise
        tinker_path = f"tinker://{req.model_id}/{segment}/{name}"
        overwrite = bool(getattr(req, "overwrite", False))
        if target.exists() and not overwrite and seq_id is not None and store.checkpoint(tinker_path, owner):
            gw.lane(req.model_id).skip(seq_id)
            raise ApiError(400, f"checkpoint {tinker_path} already exists; choose another name or pass overwrite=True")
        op = "save_state" if kind == "training" else "save_sampler_weights"
        kwargs = dict(job_id=_job(row), path=str(target), meta=_meta(row, kind))
        if kind == "training":
            kwargs.update(include_optimizer=include_optimizer, overwrite=overwrite)
        else:
            kwargs.update(overwrite=True)

        async def call():
            size = await gw.kernel_call(op, **kwargs)
            # Recorded only after the files are in place: an acknowledged checkpoint is durable.
            store.add_checkpoint(tinker_path, owner, req.model_id, f"{segment}/{name}", kind, str(target), size,
                                 req.ttl_seconds, req.user_metadata)
            return {"path": tinker_path, "type": "save_weights" if kind == "training" else "save_weights_for_sampler"}

        return _submit(req.model_id, seq_id, owner, f"save_{kind}", call, _encode_json)

    @app.post(f"{api}/save_weights")
    async def save_weights(request: Request):
        req = await _body(request, tt.SaveWeightsRequest)
        return await _save(request, req, "training", True, req.seq_id)

    @app.post(f"{api}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        req = await _body(request, tt.SaveWeightsForSamplerRequest)
        if req.path is not None:
            return await _save(request, req, "sampler", False, req.seq_id)
        owner = user(request)
        row = gw.model(req.model_id, owner)
        session_id = row["session_id"]
        if req.sampling_session_seq_id is None:
            raise ApiError(400, "save_weights_for_sampler needs a path or a sampling_session_seq_id")
        sampler_id = f"{session_id}:sample:{req.sampling_session_seq_id}"

        async def call():
            await gw.kernel_call("snapshot_sampler", job_id=_job(row), sampler_id=sampler_id)
            store.add_sampler(sampler_id, owner, session_id, row["base_model"], None, req.model_id, kernels.epoch)
            return {"sampling_session_id": sampler_id, "path": None, "type": "save_weights_for_sampler"}

        return _submit(req.model_id, req.seq_id, owner, "save_sampler", call, _encode_json)

    @app.post(f"{api}/load_weights")
    async def load_weights(request: Request):
        req = await _body(request, tt.LoadWeightsRequest)
        owner = user(request)
        ck = gw.checkpoint(req.path, owner, readable=True)
        if ck["checkpoint_type"] != "training":
            raise ApiError(400, f"{req.path} is a {ck['checkpoint_type']} checkpoint; load_weights needs one saved "
                                "with save_state (a tinker://.../weights/... path)")
        if req.model_id is not None:  # legacy TrainingClient.load_state on an existing model
            row = gw.model(req.model_id, owner)
            return _submit(req.model_id, req.seq_id, owner, "load_weights",
                           lambda: gw.kernel_call("load_state", job_id=_job(row), path=ck["fs_path"],
                                                  include_optimizer=req.optimizer),
                           lambda _: _encode_json({"path": req.path, "type": "load_weights"}))
        if req.session_id is None or req.model_seq_id is None:
            raise ApiError(400, "load_weights needs either model_id + seq_id or session_id + model_seq_id")
        if req.optimizer_config is not None and req.optimizer_config.type != "adamw":
            raise ApiError(400, f"optimizer {req.optimizer_config.type!r} is not supported; use adamw")
        gw.session(req.session_id, owner)
        slicing = await gw.lease_options(req.user_metadata)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        rid, new = gw.new_future(owner, "load_weights", model_id, 0)
        if new:
            async def work():
                info = await gw.kernel_call("create_job_from_checkpoint", job_id=model_id, path=ck["fs_path"],
                                            with_optimizer=req.optimizer, owner=owner, **slicing)
                store.add_model(model_id, owner, req.session_id, info["base_model"], info["lora"],
                                req.user_metadata, kernels.epoch)
                gw.lanes.pop(model_id, None)
                return {"model_id": model_id, "path": req.path, "type": "load_weights"}
            asyncio.create_task(gw.run(rid, work, _encode_json))
        return {"request_id": rid, "model_id": model_id}

    @app.post(f"{api}/save_weights_external")
    async def save_weights_external(request: Request):
        req = await _body(request, tt.SaveWeightsExternalRequest)
        gw.model(req.model_id, user(request))
        gw.lane(req.model_id).skip(req.seq_id or 0)  # refused: the requests after it need not wait
        raise ApiError(400, "save_weights_external is not supported by OpenRL Lab: checkpoints stay on this "
                            "server (use save_state / save_weights_for_sampler)")

    # --- sampling -----------------------------------------------------------------------------------
    @app.post(f"{api}/create_sampling_session")
    async def create_sampling_session(request: Request):
        req = await _body(request, tt.CreateSamplingSessionRequest)
        owner = user(request)
        gw.session(req.session_id, owner)
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if req.model_path:
            ck = gw.checkpoint(req.model_path, owner, readable=True)
            info = await _open_sampler(sampler_id, None, ck["fs_path"], owner)
            base_model = info["base_model"]
        elif req.base_model:
            await gw.card(req.base_model)
            await _open_sampler(sampler_id, req.base_model, None, owner)
            base_model = req.base_model
        else:
            raise ApiError(400, "create_sampling_session needs base_model or model_path")
        store.add_sampler(sampler_id, owner, req.session_id, base_model, req.model_path, None, kernels.epoch)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    async def _open_sampler(sampler_id: str, base_model: str | None, fs_path: str | None, owner: str) -> dict:
        try:
            return await gw.kernel_call("open_sampler", sampler_id=sampler_id, base_model=base_model, path=fs_path,
                                        owner=owner)
        except KernelUserError as e:
            raise ApiError(400, str(e)) from None

    @app.get(f"{api}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request):
        row = store.sampler(sampler_id, user(request))
        if row is None:
            raise not_found(f"sampler {sampler_id}")
        return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": row["model_path"]}

    @app.post(f"{api}/asample")
    async def asample(request: Request):
        req = await _body(request, tt.SampleRequest)
        owner = user(request)
        if not req.sampling_session_id:
            raise ApiError(400, "asample needs a sampling_session_id (create a sampling client first)")
        row = store.sampler(req.sampling_session_id, owner)
        if row is None:
            raise not_found(f"sampler {req.sampling_session_id}")
        if row["epoch"] != kernels.epoch and row["source_model_id"] is not None:
            raise ApiError(404, f"sampler {req.sampling_session_id} was a snapshot held by a kernel that has since "
                                "restarted; make a new one (save_weights_and_get_sampling_client)")
        unsupported = [name for name, on in (("topk_prompt_logprobs", req.topk_prompt_logprobs),
                                             ("topk_sample_logprobs", req.topk_sample_logprobs),
                                             ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
                                             ("target_prompt_logprobs", req.target_prompt_logprobs is not None)) if on]
        if unsupported:
            raise ApiError(400, f"{', '.join(unsupported)} not supported by this server")
        prompt = []
        for chunk in req.prompt.chunks:
            if chunk.type != "encoded_text":
                raise ApiError(400, f"prompt chunk of type {chunk.type!r} is not supported (text tokens only)")
            prompt.extend(chunk.tokens)
        card = await gw.card(row["base_model"])
        sp = req.sampling_params
        _check_sample(prompt, req.num_samples, sp, card)
        stop = sp.stop
        if isinstance(stop, str):
            stop = [stop]
        params = {"max_tokens": sp.max_tokens or 1, "temperature": sp.temperature, "top_k": sp.top_k,
                  "top_p": sp.top_p, "seed": sp.seed, "stop": list(stop) if stop is not None else None}
        sampler_id = req.sampling_session_id
        rid, new = gw.new_future(owner, "sample", sampler_id, req.seq_id)
        if new:
            async def call():
                if row["epoch"] != kernels.epoch and row["model_path"]:
                    # The kernel restarted; a sampler made from a saved checkpoint can be reopened.
                    ck = gw.checkpoint(row["model_path"], owner, readable=True)
                    await gw.kernel_call("open_sampler", sampler_id=sampler_id, base_model=None, path=ck["fs_path"],
                                         owner=owner)
                    store.add_sampler(sampler_id, owner, row["session_id"], row["base_model"], row["model_path"],
                                      None, kernels.epoch)
                elif row["epoch"] != kernels.epoch and row["source_model_id"] is None:
                    await gw.kernel_call("open_sampler", sampler_id=sampler_id, base_model=row["base_model"], path=None,
                                         owner=owner)
                    store.add_sampler(sampler_id, owner, row["session_id"], row["base_model"], None, None, kernels.epoch)
                async with gw.sample_slots:
                    result = await gw.kernel_call("sample", sampler_id=sampler_id, prompt=prompt,
                                                  num_samples=req.num_samples, params=params,
                                                  want_prompt_logprobs=bool(req.prompt_logprobs))
                plp = result["prompt_logprobs"]
                if plp is not None and req.prompt_logprobs_last_n is not None:
                    keep = req.prompt_logprobs_last_n
                    plp = [math.nan] * (len(plp) - keep) + plp[len(plp) - keep:] if keep else [math.nan] * len(plp)
                return result["sequences"], plp

            asyncio.create_task(gw.run(rid, call, lambda r: (PROTO, wire.encode_sample_response(*r))))
        return {"request_id": rid, "model_id": None,
                "sample_sequence_ids": [f"{rid}:{i}" for i in range(req.num_samples)]}

    # --- futures ------------------------------------------------------------------------------------
    @app.post(f"{api}/retrieve_future")
    async def retrieve_future(request: Request):
        req = await _body(request, tt.FutureRetrieveRequest)
        owner = user(request)
        fut = store.future(req.request_id, owner)
        if fut is None:
            raise not_found(f"request {req.request_id}")
        if fut.status == "pending":
            event = gw.done_events.get(req.request_id)
            if event is not None:
                try:
                    await asyncio.wait_for(event.wait(), timeout=LONG_POLL_S)
                except asyncio.TimeoutError:
                    pass
            fut = store.future(req.request_id, owner)
            if fut.status == "pending":
                return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        return Response(fut.result, media_type=fut.content_type)

    # --- REST: training runs, checkpoints, sessions -------------------------------------------------
    def _checkpoint_json(row) -> dict:
        return {"checkpoint_id": row["checkpoint_id"], "checkpoint_type": row["checkpoint_type"],
                "time": _iso(row["created_at"]), "tinker_path": row["tinker_path"], "size_bytes": row["size_bytes"],
                "public": bool(row["public"]), "user_metadata": loads(row["user_metadata"]),
                "expires_at": _iso(row["expires_at"])}

    def _run_json(row) -> dict:
        lora = loads(row["lora"])
        ckpts, _ = store.list_checkpoints(row["owner"], row["model_id"])
        last = {kind: next((c for c in ckpts if c["checkpoint_type"] == kind), None) for kind in ("training", "sampler")}
        return {"training_run_id": row["model_id"], "base_model": row["base_model"], "model_owner": row["owner"],
                "is_lora": lora is not None, "corrupted": False, "lora_rank": lora["rank"] if lora else None,
                "last_request_time": _iso(row["last_request_time"]),
                "last_checkpoint": _checkpoint_json(last["training"]) if last["training"] else None,
                "last_sampler_checkpoint": _checkpoint_json(last["sampler"]) if last["sampler"] else None,
                "user_metadata": loads(row["user_metadata"])}

    def _run_row(run_id: str, owner: str):
        row = store.model(run_id, owner)
        if row is None:
            raise not_found(f"training run {run_id}")
        return row

    @app.get(f"{api}/training_runs")
    async def list_training_runs(request: Request, limit: int = 20, offset: int = 0):
        rows, total = store.list_models(user(request), limit, offset)
        return {"training_runs": [_run_json(r) for r in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    @app.get(f"{api}/training_runs/{{run_id}}")
    async def get_training_run(run_id: str, request: Request):
        return _run_json(_run_row(run_id, user(request)))

    @app.get(f"{api}/training_runs/{{run_id}}/checkpoints")
    async def list_run_checkpoints(run_id: str, request: Request):
        owner = user(request)
        _run_row(run_id, owner)
        rows, total = store.list_checkpoints(owner, run_id)
        return {"checkpoints": [_checkpoint_json(r) for r in rows],
                "cursor": {"offset": 0, "limit": len(rows), "total_count": total}}

    @app.get(f"{api}/checkpoints")
    async def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0):
        rows, total = store.list_checkpoints(user(request), None, limit, offset)
        return {"checkpoints": [_checkpoint_json(r) for r in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    def _ckpt_path(run_id: str, checkpoint_id: str) -> str:
        return f"tinker://{run_id}/{checkpoint_id}"

    def _ckpt_action(run_id: str, checkpoint_id: str, action: str, request: Request):
        """The caller's checkpoint row for routes of the form .../checkpoints/{checkpoint_id}/{action}."""
        if not checkpoint_id.endswith("/" + action):
            raise ApiError(404, f"no such endpoint for checkpoint {checkpoint_id}")
        return gw.checkpoint(_ckpt_path(run_id, checkpoint_id[: -len(action) - 1]), user(request))

    @app.delete(f"{api}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
        if checkpoint_id.endswith("/publish"):
            store.set_checkpoint_public(_ckpt_action(run_id, checkpoint_id, "publish", request)["tinker_path"], False)
            return {}
        _delete_checkpoint(gw, gw.checkpoint(_ckpt_path(run_id, checkpoint_id), user(request)))
        return {}

    @app.post(f"{api}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def publish_checkpoint(run_id: str, checkpoint_id: str, request: Request):
        store.set_checkpoint_public(_ckpt_action(run_id, checkpoint_id, "publish", request)["tinker_path"], True)
        return {}

    @app.put(f"{api}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def checkpoint_ttl(run_id: str, checkpoint_id: str, request: Request):
        row = _ckpt_action(run_id, checkpoint_id, "ttl", request)
        body = json.loads(await request.body() or b"{}")
        ttl = body.get("ttl_seconds")
        if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
            raise ApiError(400, f"ttl_seconds must be a positive integer or null, got {ttl!r}")
        store.set_checkpoint_ttl(row["tinker_path"], ttl)
        return {}

    @app.post(f"{api}/weights_info")
    async def weights_info(request: Request):
        body = json.loads(await request.body() or b"{}")
        path = body.get("tinker_path")
        if not isinstance(path, str):
            raise ApiError(400, "weights_info needs a tinker_path string")
        row = gw.checkpoint(path, user(request), readable=True)
        meta = json.loads((Path(row["fs_path"]) / "meta.json").read_text())
        lora = meta.get("lora")
        return {"base_model": meta["base_model"], "is_lora": lora is not None,
                "lora_rank": lora["rank"] if lora else None,
                **({k: lora[k] for k in ("train_unembed", "train_mlp", "train_attn")} if lora else {})}

    @app.get(f"{api}/sessions")
    async def list_sessions(request: Request, limit: int = 20, offset: int = 0):
        return {"sessions": store.list_sessions(user(request), limit, offset)}

    @app.get(f"{api}/sessions/{{session_id}}")
    async def get_session(session_id: str, request: Request):
        row = gw.session(session_id, user(request))
        return {"training_run_ids": store.session_models(session_id), "sampler_ids": store.session_samplers(session_id),
                "user_metadata": loads(row["user_metadata"]), "display_name": row["display_name"]}

    @app.put(f"{api}/sessions/{{session_id}}/project")
    async def session_project(session_id: str, request: Request):
        gw.session(session_id, user(request))
        body = json.loads(await request.body() or b"{}")
        store.set_session_project(session_id, body.get("project_id"))
        return {}

    # --- SDK features this server does not offer: a 400 naming them, not a bare 404/405 ----------------
    def _not_supported(what: str, why: str) -> ApiError:
        return ApiError(400, f"{what} is not supported by OpenRL Lab: {why}")

    @app.get(f"{api}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def checkpoint_get(run_id: str, checkpoint_id: str, request: Request):
        if checkpoint_id.endswith("/external_weights_urls"):
            raise _not_supported("get_external_weights_urls", "checkpoints stay on this server (no external "
                                 "weights, no download URLs)")
        raise ApiError(404, f"no such endpoint for checkpoint {checkpoint_id}")

    @app.post(f"{api}/copy_weights")
    async def copy_weights(request: Request):
        raise _not_supported("copy_weights", "there are no projects to copy checkpoints between (publish a "
                             "checkpoint to let other users load it)")

    @app.get(f"{api}/sessions/{{session_id}}/trace_export")
    async def trace_export(session_id: str, request: Request):
        raise _not_supported("export_session_trace", "no request traces are recorded")

    @app.post(f"{api}/sessions/search")
    async def search_sessions(request: Request):
        raise _not_supported("search_sessions", "use list_sessions and get_session")

    no_admin = "there are no organizations, billing or admin roles"

    @app.get(f"{api}/audit")
    async def audit_log(request: Request):
        raise _not_supported("get_audit_log", no_admin)

    @app.get(f"{api}/billing/usage/events")
    async def billing_usage(request: Request):
        raise _not_supported("get_billing_usage", no_admin)

    @app.get(f"{api}/billing/usage/checkpoints/current")
    async def checkpoint_storage_usage(request: Request):
        raise _not_supported("get_current_checkpoint_storage_usage", no_admin)

    return app


def _check_sample(prompt: list[int], num_samples: int, sp, card: dict) -> None:
    vocab, ctx = card["vocab_size"], card["max_context_length"]
    if not prompt:
        raise ApiError(400, "prompt is empty")
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
    if not 1 <= num_samples <= 128:
        raise ApiError(400, f"num_samples {num_samples} is out of range [1, 128]")
    max_tokens = sp.max_tokens or 1
    if max_tokens < 1 or len(prompt) + max_tokens > ctx:
        raise ApiError(400, f"max_tokens {max_tokens} with a {len(prompt)}-token prompt is past the model's "
                            f"context of {ctx} tokens")
    if sp.temperature < 0 or not math.isfinite(sp.temperature):
        raise ApiError(400, f"temperature {sp.temperature} must be finite and >= 0")
    if not 0 < sp.top_p <= 1:
        raise ApiError(400, f"top_p {sp.top_p} must be in (0, 1]")
    if sp.top_k == 0 or sp.top_k < -1:
        raise ApiError(400, f"top_k {sp.top_k} must be -1 (off) or >= 1")


def _delete_checkpoint(gw: Gateway, row) -> None:
    shutil.rmtree(row["fs_path"], ignore_errors=True)
    gw.store.delete_checkpoint(row["tinker_path"])


async def _reap_expired(gw: Gateway) -> None:
    while True:
        try:
            for row in gw.store.expired_checkpoints():
                _delete_checkpoint(gw, row)
            gw.store.prune_futures(older_than_s=24 * 3600)
        except Exception:
            log.exception("checkpoint expiry sweep failed")
        await asyncio.sleep(30)
