"""The sandbox service over HTTP (at the root, not under /api/v1: SandboxFusion clients are told a URL ending in
`/run_code`, `SANDBOX_URL=<lab>/sandbox/run_code`). The logic is `openrl_lab.sandbox.serving`; this is glue.

    POST /sandbox/run_code     SandboxFusion's run_code (protocol.RunCodeRequest -> RunCodeResponse)
    POST /sandbox/run_batch    many programs in one request, answered in order (an RL group's)
    GET  /sandbox/status       the isolation in use, the pool, the caller's own use and limits

Where the programs run is the service's executor: this host's pool, or a sandbox server (the chart's sandbox
Pods) when OPENRL_SANDBOX_REMOTE_URL is set; these routes, the keys and the per-user accounting are the same.

The key: X-API-Key, `Authorization: Bearer <key>`, or HTTP Basic with the key as the password (a URL's user info,
`http://USER:KEY@host/sandbox/run_code`: what a SandboxFusion client that sends no headers of its own can do).
A request the sandbox refuses before running it is a 400 naming the field; too many queued runs of one user a
429; the program's own failures are answers (`Failed`), and the sandbox's own (`SandboxError`) say why.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from openrl_lab.gateway.bodies import MAX_SANDBOX_BATCH_BODY, MAX_SANDBOX_BODY
from openrl_lab.gateway.deps import User, api_router
from openrl_lab.gateway.errors import ApiError
from openrl_lab.sandbox.protocol import RunBatchRequest, RunBatchResponse, RunCodeRequest, RunCodeResponse
from openrl_lab.sandbox.serving import BadRequest, QueueFull, SandboxService

router = api_router(prefix="/sandbox", tags=["sandbox"])


def _service(request: Request) -> SandboxService:
    return request.app.state.sandbox


Sandboxes = Annotated[SandboxService, Depends(_service)]


@router.post("/run_code", response_model=RunCodeResponse, max_body_size=MAX_SANDBOX_BODY)
async def run_code(req: RunCodeRequest, owner: User, service: Sandboxes) -> RunCodeResponse:
    try:
        return await service.run(owner, req)
    except BadRequest as e:
        raise ApiError(400, str(e)) from None
    except QueueFull as e:
        raise ApiError(429, str(e)) from None


@router.post("/run_batch", response_model=RunBatchResponse, max_body_size=MAX_SANDBOX_BATCH_BODY)
async def run_batch(req: RunBatchRequest, owner: User, service: Sandboxes) -> RunBatchResponse:
    try:
        return RunBatchResponse(responses=await service.run_batch(owner, req.requests))
    except BadRequest as e:
        raise ApiError(400, str(e)) from None
    except QueueFull as e:
        raise ApiError(429, str(e)) from None


@router.get("/status")
async def status(owner: User, service: Sandboxes) -> dict:
    return await service.status(owner)
