"""Who is asking and what serves them: the API-key check, and the `User` / `Gw` route dependencies."""

from __future__ import annotations

import base64
import binascii
import ipaddress
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Security
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader
from pydantic import BaseModel

from openrl_lab.gateway.bodies import StrictJsonRoute
from openrl_lab.gateway.downloads import DOWNLOAD_PREFIX
from openrl_lab.gateway.errors import HF_PREFIX, SANDBOX_PREFIX, header_text
from openrl_lab.gateway.gateway import Gateway
from openrl_lab.gateway.store import Store
from openrl_lab.identity import KERNEL_USER

API_KEY = APIKeyHeader(
    name="X-API-Key",
    auto_error=False,
    description="an OpenRL Lab key (`openrl-lab keys create`; it starts with `tml-`)",
)


class ApiKeyAuth:
    """X-API-Key -> user, as plain ASGI middleware: refused before any body is read (and cheaper than
    BaseHTTPMiddleware on every request). Under /hf (the Hugging Face mirror) the key may also come as
    `Authorization: Bearer <key>`: huggingface_hub sends HF_TOKEN that way and cannot send X-API-Key. Under
    /sandbox also as HTTP Basic's password (`http://USER:KEY@host/sandbox/run_code`): SandboxFusion clients send
    no headers of their own, but every HTTP client turns a URL's user info into Basic auth."""

    OPEN_PATHS = ("/api/v1/healthz", "/docs", "/openapi.json")  # and signed download URLs (DOWNLOAD_PREFIX)
    LOOPBACK_PATHS = ("/metrics",)  # open to a client on this machine (the operator's Prometheus), else a key

    def __init__(self, app, store: Store):
        self.app = app
        self.store = store

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or path in self.OPEN_PATHS
            or path.startswith(DOWNLOAD_PREFIX)
            or (path in self.LOOPBACK_PATHS and is_loopback(scope))
        ):
            return await self.app(scope, receive, send)
        mirror = scope["path"].startswith(HF_PREFIX)
        sandbox = scope["path"].startswith(SANDBOX_PREFIX)
        raw, header = next((v for k, v in scope["headers"] if k == b"x-api-key"), None), "X-API-Key"
        if raw is None and (mirror or sandbox):
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if auth is not None:
                scheme, _, token = auth.partition(b" ")
                raw, header = _authorization(scheme.lower(), token.strip(), basic=sandbox), "Authorization"
        user = self.store.user_for_key(raw.decode()) if raw and raw.isascii() else None
        if user == KERNEL_USER:  # a kernel's key drives leases over gRPC; it is nobody's HTTP identity
            user = None
        if user is None:
            if raw is None:
                msg = (
                    "missing API key: send your OpenRL Lab key as `Authorization: Bearer <key>` (huggingface_hub: "
                    "HF_TOKEN=<key>) or X-API-Key"
                    if mirror
                    else "missing API key: send your OpenRL Lab key as X-API-Key, `Authorization: Bearer <key>`, or "
                    "in the URL (http://USER:KEY@host/sandbox/run_code: HTTP Basic's password)"
                    if sandbox
                    else "missing X-API-Key header"
                    + (
                        " (this API reads the key from X-API-Key only, not from the Authorization header)"
                        if any(k == b"authorization" for k, _ in scope["headers"])
                        else ""
                    )
                )
            elif not raw:  # an empty value, or (the mirror only) an Authorization header that is not Bearer
                msg = (
                    "the X-API-Key header is empty: send your OpenRL Lab key in it"
                    if header == "X-API-Key"
                    else "the Authorization header is not `Bearer <key>` with an OpenRL Lab key"
                    + (" (or Basic with the key as the password)" if sandbox else "")
                )
            elif not raw.isascii():
                msg = f"{header} is not a key: keys are ASCII (they start with 'tml-')"
            else:
                msg = "unknown API key" + (
                    ": this mirror takes OpenRL Lab keys (HF_TOKEN=<your lab key>), not Hugging Face tokens"
                    if mirror
                    else ""
                )
            # huggingface_hub shows X-Error-Message when it refuses
            headers = {"X-Error-Message": header_text(msg)} if mirror else None
            return await JSONResponse({"detail": msg, "error": msg}, status_code=401, headers=headers)(
                scope, receive, send
            )
        scope.setdefault("state", {})["user"] = user
        return await self.app(scope, receive, send)


def _authorization(scheme: bytes, token: bytes, basic: bool) -> bytes:
    """The key in an Authorization header: Bearer's token, or (`basic`) Basic's password; b"" for anything else."""
    if scheme == b"bearer":
        return token
    if basic and scheme == b"basic":
        try:
            return base64.b64decode(token, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return b""
    return b""


def is_loopback(scope) -> bool:
    """Whether the request comes from this machine."""
    client = scope.get("client")
    try:
        address = ipaddress.ip_address(client[0]) if client else None
    except ValueError:  # not an IP address (a Unix socket's peer, a test transport's name)
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return bool(address and address.is_loopback)


def current_user(request: Request, _key: Annotated[str | None, Security(API_KEY)]) -> str:
    """The caller (ApiKeyAuth checked the key; naming API_KEY here documents it in the OpenAPI schema)."""
    return request.state.user


def current_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


User = Annotated[str, Depends(current_user)]
Gw = Annotated[Gateway, Depends(current_gateway)]


class ErrorAnswer(BaseModel):
    detail: str
    error: str


REFUSALS = {
    status: {"model": ErrorAnswer, "description": what}
    for status, what in (
        (400, "the request is wrong; `detail` names the problem"),
        (401, "no key, or not a known key"),
        (404, "no such object, or not the caller's"),
    )
} | {
    413: {
        "description": "`Content Too Large` (text): the body is over this endpoint's size limit (see the API "
        "description)",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


def api_router(**kwargs) -> APIRouter:
    """A router of authenticated routes with strict JSON bodies and documented refusals."""
    return APIRouter(route_class=StrictJsonRoute, dependencies=[Depends(current_user)], responses=REFUSALS, **kwargs)
