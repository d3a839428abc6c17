"""The standalone sandbox server (`openrl-lab sandbox serve`): the sandbox service's three routes over this
host's warm pool, for a lab gateway elsewhere (OPENRL_SANDBOX_REMOTE_URL; the chart's sandbox Pods).

    POST /sandbox/run_code     SandboxFusion's run_code (protocol.RunCodeRequest -> RunCodeResponse)
    POST /sandbox/run_batch    many programs in one request, answered in order
    GET  /sandbox/status       the isolation in use and the pool
    GET  /healthz              200 once serving (no token: for probes)

One shared service token, `Authorization: Bearer <token>`, compared in constant time, checked before a body is
read; anything else is a 401 that names the problem. Its callers are gateways, which do the per-user limits,
queueing and accounting: this server checks only the lab's limits (OPENRL_SANDBOX_MAX_WALL_S and
OPENRL_SANDBOX_MAX_MEMORY_BYTES) and runs what it is given, at most `OPENRL_SANDBOX_POOL_SIZE` at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import sys
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from openrl_lab.sandbox.isolation import Limits, SandboxUnavailable, check_host
from openrl_lab.sandbox.protocol import RunBatchRequest, RunBatchResponse, RunCodeRequest, RunCodeResponse
from openrl_lab.sandbox.serving import BadRequest, LocalExecutor, SandboxConfig, config_from_settings, limits_for

MiB = 1 << 20
MAX_RUN_BODY = 16 * MiB  # as the gateway's /sandbox/run_code (gateway/bodies.py)
MAX_BATCH_BODY = 128 * MiB
OPEN_PATHS = ("/healthz",)


class ServiceToken:
    """Pure ASGI: every request but OPEN_PATHS carries `Authorization: Bearer <token>`, else 401 naming why."""

    def __init__(self, app, token: str) -> None:
        if not token:
            raise ValueError("the sandbox server needs a non-empty service token")
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope, receive, send) -> None:
        why = None
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            why = self._check(dict(scope["headers"]).get(b"authorization"))
        if why is None:
            await self.app(scope, receive, send)
            return
        body = json.dumps({"detail": why}).encode()
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _check(self, header: bytes | None) -> str | None:
        if header is None:
            return "missing service token: send `Authorization: Bearer <token>` (the token the server was given)"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return "the Authorization header is not `Bearer <token>`"
        if not hmac.compare_digest(token.strip(), self._token):
            return "wrong service token (not the one this sandbox server was given)"
        return None


def create_app(token: str, config: SandboxConfig | None = None) -> ServiceToken:
    """The server's ASGI app: `token` is the service token its callers must send."""
    config = config or SandboxConfig()
    executor = LocalExecutor(config)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await executor.aclose()

    app = FastAPI(
        title="OpenRL Lab sandbox server", lifespan=lifespan, max_body_size=MAX_BATCH_BODY, strict_content_type=False
    )

    def checked(req: RunCodeRequest, where: str = "") -> Limits:
        try:
            return limits_for(config, req)
        except BadRequest as e:
            raise BadRequest(f"{where}{e}") from None

    @app.exception_handler(BadRequest)
    async def _bad_request(_request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.post("/sandbox/run_code", response_model=RunCodeResponse, max_body_size=MAX_RUN_BODY)
    async def run_code(req: RunCodeRequest) -> RunCodeResponse:
        return await executor.run(req, checked(req))

    @app.post("/sandbox/run_batch", response_model=RunBatchResponse)
    async def run_batch(req: RunBatchRequest) -> RunBatchResponse:
        limits = [checked(r, f"requests[{i}]: ") for i, r in enumerate(req.requests)]
        return RunBatchResponse(
            responses=list(await asyncio.gather(*(executor.run(r, lim) for r, lim in zip(req.requests, limits))))
        )

    @app.get("/sandbox/status")
    async def status() -> dict:
        where = await executor.describe()
        return {"available": where["isolation"] is not None, **where}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return ServiceToken(app, token)


def serve(host: str, port: int, token_file: Path) -> None:
    """Run the server until SIGINT/SIGTERM: `port` 0 picks a free one. Its first line on stdout is
    `sandbox server: http://HOST:PORT (<isolation>)`. Exits with the reason when the token file cannot be read or
    the host cannot sandbox (pod isolation outside a Pod, say): a server that would only answer errors is not
    started."""
    import uvicorn

    try:
        token = token_file.read_text().strip()
    except OSError as e:
        sys.exit(f"sandbox serve: the token file {token_file} cannot be read ({e})")
    if not token:
        sys.exit(f"sandbox serve: the token file {token_file} is empty")
    try:
        isolation = check_host()
    except SandboxUnavailable as e:
        sys.exit(f"sandbox serve: this host cannot run sandboxes: {e}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"sandbox server: http://{shown}:{bound} ({isolation})", flush=True)
    app = create_app(token, config_from_settings())
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    server.run(sockets=[sock])
