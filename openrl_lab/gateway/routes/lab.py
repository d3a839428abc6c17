"""The notebook layer's REST endpoints (not part of the Tinker API): named leases and their metric history.

A lab lease is a name the researcher chose for one training run: it points at the model handle the
notebook drives and at the kernel job holding the state. Because it lives here and not in the notebook,
a fresh notebook kernel can `attach` to it (a new handle on the same kernel job) and replay its metrics.

    GET    /api/v1/lab/info                          orchestrator target, version, the caller's user, the
                                                     orchestrator's leases-per-user limit
    GET    /api/v1/lab/leases                        the caller's leases (with placement, device memory, last
                                                     step, metrics, reward, checkpoint and its time)
    PUT    /api/v1/lab/leases/{name}                 bind a name to a model (create or rebind)
    GET    /api/v1/lab/leases/{name}
    PATCH  /api/v1/lab/leases/{name}                 record the last checkpoint
    DELETE /api/v1/lab/leases/{name}                 release: the kernel drops the job, history is deleted
    POST   /api/v1/lab/leases/{name}/attach          a new model handle (for the caller's session) on the job
    POST   /api/v1/lab/leases/{name}/fork            a new lease whose job carries on from this one's (its state
                                                     copied on the kernel), with its variant settings recorded
    POST   /api/v1/lab/leases/{name}/metrics         append rows {step, time, metrics}
    GET    /api/v1/lab/leases/{name}/metrics?after_step=N&limit=M
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Annotated, Any

import pydantic
from fastapi import Depends, Query, Request

from openrl_lab.collapse import COLLAPSE_METRIC
from openrl_lab.gateway.bodies import INT64_MAX, MAX_METRICS_BODY
from openrl_lab.gateway.deps import Gw, User, api_router
from openrl_lab.gateway.errors import ApiError, not_found
from openrl_lab.gateway.gang import is_gang, ranks_of
from openrl_lab.gateway.gateway import Gateway
from openrl_lab.gateway.store import job_of, loads
from openrl_lab.kernel.api import JobSlicing, KernelMetrics
from openrl_lab.kernel.client import KernelError
from openrl_lab.version import TESTED_SDKS, __version__

router = api_router(prefix="/lab", tags=["lab"])
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


class ForkRequest(AttachRequest):
    name: str  # the new lease's
    priority: str | None = None  # interactive | batch (None: the orchestrator's default)
    # the variant's settings as the researcher names them (learning_rate=3e-4): recorded, shown, compared
    settings: dict[str, float | int | str | bool] = pydantic.Field(default_factory=dict, max_length=64)


class MetricRow(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    step: int = pydantic.Field(ge=0)
    time: float | None = None
    metrics: dict[str, float | None] = pydantic.Field(max_length=MAX_METRICS_PER_ROW)


class MetricRows(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    rows: list[MetricRow] = pydantic.Field(max_length=MAX_ROWS_PER_POST)


def lease_name(name: str) -> str:
    if not LEASE_NAME.fullmatch(name):
        raise ApiError(
            400,
            f"lease name {name!r} is not allowed: start with a letter or digit, then letters, "
            "digits, '.', '_' or '-' (max 64)",
        )
    return name


LeaseName = Annotated[str, Depends(lease_name)]


def _lease(gw: Gateway, owner: str, name: str):
    row = gw.store.lab_lease(owner, name)
    if row is None:
        raise not_found(f"lease {name!r}")
    return row


REWARD_LOOKBACK = 64  # steps back from the last one in which `last_reward` looks for a logged `reward`


def _lease_json(row, gw: Gateway | None = None) -> dict[str, Any]:
    """A lab lease as the API shows it. With `gw` (the listings): where its run lives now (`placement`, None when
    its kernel is gone), its last logged metrics (`last_metrics`, and `last_reward`: the last `reward` logged in
    the last REWARD_LOOKBACK steps) and when its last checkpoint was written (`checkpoint_time`)."""
    d = dict(row)
    owner = d.pop("owner", None)
    d["group"] = d.pop("group_id")
    d["variant"] = loads(d.get("variant"))
    if gw is not None:  # where its run lives now (None: no longer resident)
        model = gw.store.model(d["model_id"], owner)
        d["placement"] = gw.placement(model) if model is not None else None
        d["devices"] = len(ranks_of(model)) if model is not None else 1
        live = model is not None and gw.live(model)
        d["state_bytes"] = (
            _sum_known([_state_bytes(gw.kernels.get(e).metrics, d["job_id"]) for e in ranks_of(model)])
            if live and model is not None
            else None
        )
        last = d.get("last_step")
        rows = [] if last is None else gw.store.lab_metrics(owner, d["name"], last - REWARD_LOOKBACK, REWARD_LOOKBACK)
        metrics = [loads(r["metrics"]) or {} for r in rows]
        d["last_metrics"] = metrics[-1] if metrics else {}
        d["last_reward"] = next((m["reward"] for m in reversed(metrics) if m.get("reward") is not None), None)
        d["collapse_since"] = _collapse_since([r["step"] for r in rows], metrics)
        ckpt = gw.store.checkpoint(d["checkpoint"], owner) if d.get("checkpoint") else None
        d["checkpoint_time"] = ckpt["created_at"] if ckpt is not None else None
    return d


def _collapse_since(steps: list[int], metrics: list[dict]) -> int | None:
    """The step at which the collapse the run's last logged step is in began (the `collapse` flag its log carries,
    openrl_lab/collapse.py), within the lookback; None when the last step is not in one."""
    since = None
    for step, m in zip(reversed(steps), reversed(metrics)):
        if not m.get(COLLAPSE_METRIC):
            break
        since = step
    return since


def _state_bytes(kernel_metrics: KernelMetrics | None, job_id: str) -> int | None:
    """The run's device memory (weights, gradients, AdamW moments) as its kernel reports it."""
    return kernel_metrics.job_bytes.get(job_id) if kernel_metrics is not None else None


def _sum_known(sizes: list[int | None]) -> int | None:
    """A run's state over its ranks (each holds a shard); None when a rank's kernel reported none."""
    return None if any(b is None for b in sizes) else sum(b for b in sizes if b is not None)


async def _fresh_state_bytes(gw: Gateway, model: Any, job_id: str) -> int | None:
    """As its kernels say now (the fleet's copy of their metrics may predate a job made a moment ago), summed over
    a gang's ranks; None when a kernel does not answer (the binding stands: the listings say where the run is)."""
    sizes: list[int | None] = []
    for epoch in ranks_of(model):
        try:
            sizes.append(_state_bytes(await gw.kernel_call(epoch, lambda k: k.metrics()), job_id))
        except KernelError:
            return None
    return _sum_known(sizes)


@router.get("/info")
async def info(request: Request, owner: User):
    return {
        "version": __version__,
        "grpc_target": getattr(request.app.state, "grpc_target", None),
        "user": owner,  # whose the key is (the doctor says so)
        "tested_sdks": list(TESTED_SDKS),
        # the most orchestrator leases one user may hold open (None: no orchestrator); the doctor's `rights`
        "max_leases_per_user": getattr(request.app.state, "max_leases_per_user", None),
    }


@router.get("/leases")
async def list_leases(gw: Gw, owner: User):
    return {"leases": [_lease_json(r, gw) for r in gw.store.lab_leases(owner)]}


@router.get("/leases/{name}")
async def get_lease(name: LeaseName, gw: Gw, owner: User):
    rows = gw.store.lab_leases(owner, name)
    if not rows:
        raise not_found(f"lease {name!r}")
    return _lease_json(rows[0], gw)


@router.get("/kernels")
async def list_kernels(gw: Gw, owner: User):
    """Every kernel of the fleet (`openrl-lab kernel list`, `%openrl top`): host, device, group, memory in use,
    resident jobs, last heartbeat. Counts only: whose jobs they are is not shown."""
    return {"kernels": [r.view() for r in gw.kernels.records()]}


@router.put("/leases/{name}")
async def put_lease(name: LeaseName, req: LeaseBinding, gw: Gw, owner: User):
    row = gw.model(req.model_id, owner)  # the caller's own, live model handle
    gw.store.put_lab_lease(owner, name, req.group, req.base_model, req.rank, req.model_id, job_of(row), req.checkpoint)
    return _lease_json(gw.store.lab_lease(owner, name)) | {
        "state_bytes": await _fresh_state_bytes(gw, row, job_of(row)),
        "devices": len(ranks_of(row)),
    }


@router.patch("/leases/{name}")
async def patch_lease(name: LeaseName, req: LeasePatch, gw: Gw, owner: User):
    _lease(gw, owner, name)
    gw.checkpoint(req.checkpoint, owner)  # only the caller's own checkpoints
    gw.store.update_lab_lease(owner, name, checkpoint=req.checkpoint)
    return _lease_json(gw.store.lab_lease(owner, name))


@router.delete("/leases/{name}")
async def delete_lease(name: LeaseName, gw: Gw, owner: User):
    row = _lease(gw, owner, name)
    model = gw.store.model(row["model_id"], owner)
    if model is not None:  # free the device state now (on every rank's kernel that is still up)
        await gw.drop_ranks(model, row["job_id"])
    gw.store.delete_lab_lease(owner, name)
    return {"released": name}


@router.post("/leases/{name}/attach")
async def attach(name: LeaseName, req: AttachRequest, gw: Gw, owner: User):
    row = _lease(gw, owner, name)
    gw.session(req.session_id, owner)
    model = gw.store.model(row["model_id"], owner)
    if model is None or not gw.live(model):
        # Its kernel was lost: the client restores from the last checkpoint, if there is one.
        hint = (
            f"its last checkpoint is {row['checkpoint']}"
            if row["checkpoint"]
            else "it has no checkpoint (save_state records one)"
        )
        why = gw.why_gone(model) if model is not None else "it is gone"
        raise ApiError(409, f"lease {name!r} lost its state: its kernel was lost since ({why}); {hint}")
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    gw.store.add_model(
        model_id,
        owner,
        req.session_id,
        model["base_model"],
        loads(model["lora"]),
        loads(model["user_metadata"]),
        model["epoch"],
        job_id=row["job_id"],
        ranks=ranks_of(model),
    )
    gw.store.update_lab_lease(owner, name, model_id=model_id)
    return _lease_json(gw.store.lab_lease(owner, name)) | {
        "state_bytes": await _fresh_state_bytes(gw, model, row["job_id"]),
        "devices": len(ranks_of(model)),
    }


@router.post("/leases/{name}/fork")
async def fork(name: LeaseName, req: ForkRequest, gw: Gw, owner: User):
    new = lease_name(req.name)
    row = _lease(gw, owner, name)
    if gw.store.lab_lease(owner, new) is not None:
        raise ApiError(409, f"lease {new!r} already exists: fork under another name, or release it first")
    gw.session(req.session_id, owner)
    model = gw.store.model(row["model_id"], owner)
    if model is None or not gw.live(model):
        why = gw.why_gone(model) if model is not None else "it is gone"
        raise ApiError(409, f"lease {name!r} has no live state to fork: its kernel was lost ({why})")
    if is_gang(model):
        raise ApiError(
            400,
            f"lease {name!r} runs on {len(ranks_of(model))} devices, and forking such a run is not supported yet: "
            "save its state (save_state) and start the variant from that checkpoint with "
            "create_training_client_from_state_with_optimizer(path, user_metadata={'openrl_devices': ...})",
        )
    slicing = await gw.lease_options(
        {"openrl_lease": new, "openrl_group": row["group_id"]}
        | ({"openrl_priority": req.priority} if req.priority is not None else {})
    )
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    await gw.kernel_call(
        model["epoch"],
        lambda k: k.fork_job(job_id=row["job_id"], new_job_id=model_id, slicing=JobSlicing(owner=owner, **slicing)),
    )
    metadata = (loads(model["user_metadata"]) or {}) | {"openrl_lease": new}
    gw.store.add_model(
        model_id, owner, req.session_id, model["base_model"], loads(model["lora"]), metadata, model["epoch"]
    )
    history = gw.store.lab_metrics(owner, name, -1, 1 << 62)  # the fork's curves start with the common past
    gw.store.add_lab_metrics(owner, new, [(r["step"], r["time"], r["metrics"]) for r in history])
    variant = {"forked_from": name, "step": history[-1]["step"] if history else None, "settings": req.settings}
    gw.store.put_lab_lease(
        owner,
        new,
        row["group_id"],
        row["base_model"],
        row["rank"],
        model_id,
        model_id,
        row["checkpoint"],
        json.dumps(variant),
    )
    return _lease_json(gw.store.lab_lease(owner, new)) | {"state_bytes": await _fresh_state_bytes(gw, model, model_id)}


@router.post("/leases/{name}/metrics", max_body_size=MAX_METRICS_BODY)
async def add_metrics(name: LeaseName, req: MetricRows, gw: Gw, owner: User):
    _lease(gw, owner, name)
    now = time.time()
    rows = [(r.step, r.time if r.time is not None else now, json.dumps(r.metrics)) for r in req.rows]
    gw.store.add_lab_metrics(owner, name, rows)
    return {"stored": len(rows)}


@router.get("/leases/{name}/metrics")
async def get_metrics(
    name: LeaseName,
    gw: Gw,
    owner: User,
    after_step: Annotated[int, Query(ge=-1, le=INT64_MAX)] = -1,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 100_000,
):
    _lease(gw, owner, name)
    rows = gw.store.lab_metrics(owner, name, after_step, limit)
    # (rows stored before non-finite values were refused read back as missing values)
    return {
        "rows": [
            {"step": r["step"], "time": r["time"] if math.isfinite(r["time"]) else None, "metrics": loads(r["metrics"])}
            for r in rows
        ]
    }
