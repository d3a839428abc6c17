"""The notebook layer's REST endpoints (not part of the Tinker API): named leases and their metric history.

A lab lease is a name the researcher chose for one training run: it points at the model handle the
notebook drives and at the kernel job holding the state. Because it lives here and not in the notebook,
a fresh notebook kernel can `attach` to it (a new handle on the same kernel job) and replay its metrics.

    GET    /api/v1/lab/info                          orchestrator target, version
    GET    /api/v1/lab/leases                        the caller's leases
    PUT    /api/v1/lab/leases/{name}                 bind a name to a model (create or rebind)
    GET    /api/v1/lab/leases/{name}
    PATCH  /api/v1/lab/leases/{name}                 record the last checkpoint
    DELETE /api/v1/lab/leases/{name}                 release: the kernel drops the job, history is deleted
    POST   /api/v1/lab/leases/{name}/attach          a new model handle (for the caller's session) on the job
    POST   /api/v1/lab/leases/{name}/metrics         append rows {step, time, metrics}
    GET    /api/v1/lab/leases/{name}/metrics?after_step=N&limit=M
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

import pydantic
from fastapi import FastAPI, Request

from openrl_lab import __version__
from openrl_lab.gateway.app import ApiError, not_found
from openrl_lab.gateway.store import loads

LEASE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_ROWS_PER_POST = 10_000
MAX_METRICS_PER_ROW = 64


class LeaseBinding(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    group: str = "default"
    base_model: str
    rank: int | None = None
    model_id: str
    checkpoint: str | None = None


class LeasePatch(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    checkpoint: str


class AttachRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    session_id: str
    model_seq_id: int = pydantic.Field(ge=0)


class MetricRow(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    step: int = pydantic.Field(ge=0)
    time: float | None = None
    metrics: dict[str, float | None]


class MetricRows(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    rows: list[MetricRow]


def _lease_json(row) -> dict[str, Any]:
    d = dict(row)
    d.pop("owner", None)
    d["group"] = d.pop("group_id")
    return d


def add_lab_routes(app: FastAPI, gw, body, user) -> None:
    """Registers the endpoints on the gateway's app (`body` parses a pydantic model, `user` names the caller)."""
    store, api = gw.store, "/api/v1/lab"

    def check_name(name: str) -> str:
        if not LEASE_NAME.fullmatch(name):
            raise ApiError(400, f"lease name {name!r} is not allowed: start with a letter or digit, then letters, "
                                "digits, '.', '_' or '-' (max 64)")
        return name

    def lease(owner: str, name: str):
        row = store.lab_lease(owner, check_name(name))
        if row is None:
            raise not_found(f"lease {name!r}")
        return row

    @app.get(f"{api}/info")
    async def info(request: Request):
        return {"version": __version__, "grpc_target": getattr(app.state, "grpc_target", None)}

    @app.get(f"{api}/leases")
    async def list_leases(request: Request):
        return {"leases": [_lease_json(r) for r in store.lab_leases(user(request))]}

    @app.get(f"{api}/leases/{{name}}")
    async def get_lease(name: str, request: Request):
        owner = user(request)
        check_name(name)
        rows = store.lab_leases(owner, name)
        if not rows:
            raise not_found(f"lease {name!r}")
        return _lease_json(rows[0])

    @app.put(f"{api}/leases/{{name}}")
    async def put_lease(name: str, request: Request):
        owner = user(request)
        check_name(name)
        req = await body(request, LeaseBinding)
        row = gw.model(req.model_id, owner)  # the caller's own, live model handle
        store.put_lab_lease(owner, name, req.group, req.base_model, req.rank, req.model_id,
                            row["job_id"] or row["model_id"], req.checkpoint)
        return _lease_json(store.lab_lease(owner, name))

    @app.patch(f"{api}/leases/{{name}}")
    async def patch_lease(name: str, request: Request):
        owner = user(request)
        lease(owner, name)
        req = await body(request, LeasePatch)
        gw.checkpoint(req.checkpoint, owner)  # only the caller's own checkpoints
        store.update_lab_lease(owner, name, checkpoint=req.checkpoint)
        return _lease_json(store.lab_lease(owner, name))

    @app.delete(f"{api}/leases/{{name}}")
    async def delete_lease(name: str, request: Request):
        owner = user(request)
        row = lease(owner, name)
        model = store.model(row["model_id"], owner)
        if model is not None and model["epoch"] == gw.kernels.epoch:  # free the device state now
            await gw.kernel_call("drop_job", job_id=row["job_id"])
        store.delete_lab_lease(owner, name)
        return {"released": name}

    @app.post(f"{api}/leases/{{name}}/attach")
    async def attach(name: str, request: Request):
        owner = user(request)
        row = lease(owner, name)
        req = await body(request, AttachRequest)
        gw.session(req.session_id, owner)
        model = store.model(row["model_id"], owner)
        if model is None or model["epoch"] != gw.kernels.epoch:
            # The kernel restarted: the client restores from the last checkpoint, if there is one.
            hint = (f"its last checkpoint is {row['checkpoint']}" if row["checkpoint"]
                    else "it has no checkpoint (save_state records one)")
            raise ApiError(409, f"lease {name!r} lost its state: the kernel restarted since; {hint}")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        store.add_model(model_id, owner, req.session_id, model["base_model"], loads(model["lora"]),
                        loads(model["user_metadata"]), gw.kernels.epoch, job_id=row["job_id"])
        store.update_lab_lease(owner, name, model_id=model_id)
        return _lease_json(store.lab_lease(owner, name))

    @app.post(f"{api}/leases/{{name}}/metrics")
    async def add_metrics(name: str, request: Request):
        owner = user(request)
        lease(owner, name)
        req = await body(request, MetricRows)
        if len(req.rows) > MAX_ROWS_PER_POST:
            raise ApiError(400, f"{len(req.rows)} rows in one request; send at most {MAX_ROWS_PER_POST}")
        now, rows = time.time(), []
        for r in req.rows:
            if len(r.metrics) > MAX_METRICS_PER_ROW:
                raise ApiError(400, f"step {r.step} has {len(r.metrics)} metrics; at most {MAX_METRICS_PER_ROW}")
            bad = [k for k, v in r.metrics.items() if v is not None and not math.isfinite(v)]
            clean = {k: (None if k in bad else v) for k, v in r.metrics.items()}  # NaN/inf are not JSON
            rows.append((r.step, r.time if r.time is not None else now, json.dumps(clean)))
        store.add_lab_metrics(owner, name, rows)
        return {"stored": len(rows)}

    @app.get(f"{api}/leases/{{name}}/metrics")
    async def get_metrics(name: str, request: Request, after_step: int = -1, limit: int = 100_000):
        owner = user(request)
        lease(owner, name)
        if not 1 <= limit <= 100_000:
            raise ApiError(400, f"limit {limit} is out of range [1, 100000]")
        rows = store.lab_metrics(owner, name, after_step, limit)
        return {"rows": [{"step": r["step"], "time": r["time"], "metrics": json.loads(r["metrics"])} for r in rows]}
