"""How the gateway answers a refused request: JSON `{"detail", "error"}` naming the problem.

Never an empty 4xx (the SDK retries one as a proxy artefact), and never the server's home directory in
an answer: paths under it are shown relative to `$OPENRL_LAB_HOME`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import get_args

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from openrl_lab.kernel.client import KernelError, KernelNotFound, KernelTimeout, KernelUserError

log = logging.getLogger("openrl_lab.gateway")
MAX_PROBLEMS = 5  # listed in one answer
SANDBOX_PREFIX = "/sandbox/"  # the sandbox service (routes/sandbox.py): SandboxFusion's run_code and more
HF_PREFIX = "/hf/"  # the Hugging Face mirror (routes/hf.py): its refusals also carry X-Error-Message
CLIENT_CLOSED = 499  # nginx's "client closed request": what /metrics counts a hang-up mid-body as
HUNG_UP = "the client hung up before its body had all come"


class ApiError(HTTPException):
    """A refusal with the HTTP status and the message the user sees."""

    def __init__(self, status: int, message: str):
        super().__init__(status_code=status, detail=message)
        self.message = message

    def __str__(self) -> str:  # the message alone, also where it fails a future
        return self.message


def not_found(what: str) -> ApiError:
    return ApiError(404, f"{what} not found (or not yours)")


def redact(text: str, home: Path) -> str:
    return text.replace(str(home), "$OPENRL_LAB_HOME")


def header_text(text: str) -> str:
    """A header value: one line of printable ASCII (a message may quote a name the client sent)."""
    return re.sub(r"[^\x20-\x7e]", "?", text)[:500]


def _answer(request: Request, status: int, message: str, headers: dict | None = None) -> JSONResponse:
    message = redact(message, request.app.state.gateway.home)
    if request.url.path.startswith(HF_PREFIX):  # huggingface_hub shows X-Error-Message; a HEAD answer has no body
        headers = {**(headers or {}), "X-Error-Message": header_text(message)}
    return JSONResponse({"detail": message, "error": message}, status_code=status, headers=headers)


def body_model_name(request: Request) -> str:
    """The name of the route's body model (as the SDK knows it, e.g. CreateSessionRequest)."""
    field = getattr(request.scope.get("route"), "body_field", None)
    if field is None:
        return "request"
    annotation = field.field_info.annotation
    names = [a.__name__ for a in (get_args(annotation) or (annotation,)) if a is not type(None)]
    return names[0] if names else "request"


def _problem(error: dict) -> str:
    where, *loc = error["loc"]
    field = ".".join(str(part) for part in loc)
    if where != "body":
        return f"{where} parameter {field}: {error['msg']}"
    if not loc and error["type"] == "missing":
        return "the request needs a JSON body"
    if not loc and isinstance(error.get("input"), bytes):
        return "the body must be JSON (Content-Type: application/json)"
    return f"{field or 'body'}: {error['msg']}"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def refused(request: Request, exc: HTTPException):
        return _answer(request, exc.status_code, str(exc.detail))

    @app.exception_handler(StarletteHTTPException)  # the router's own (no such route, method not allowed)
    async def unrouted(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)  # the same body as every other refusal: `error` and `detail`, naming the request
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
            message = f"{request.method} is not allowed on {request.url.path}" + (
                f" (allowed: {allowed})" if allowed else ""
            )
        return _answer(request, exc.status_code, message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        problems = "; ".join(_problem(e) for e in exc.errors()[:MAX_PROBLEMS])
        return _answer(request, 400, f"invalid {body_model_name(request)}: {problems}")

    # A client that hangs up before its body has all come is normal (a killed notebook, a dropped connection):
    # one line, and openrl_http_requests_total{status="499"} counts it; nobody reads the answer.
    @app.exception_handler(ClientDisconnect)
    async def hung_up(request: Request, exc: ClientDisconnect):
        log.info("%s %s: %s", request.method, request.url.path, HUNG_UP)
        return Response(status_code=CLIENT_CLOSED)

    # A kernel call made while answering (not in a future): its refusals are the user's, its failures ours.
    @app.exception_handler(KernelUserError)
    async def kernel_refused(request: Request, exc: KernelUserError):
        return _answer(request, 400, str(exc))

    @app.exception_handler(KernelNotFound)
    async def kernel_not_found(request: Request, exc: KernelNotFound):
        return _answer(request, 404, str(exc))

    @app.exception_handler(KernelError)
    async def kernel_failed(request: Request, exc: KernelError):
        log.error("kernel call failed while answering %s: %s", request.url.path, exc)
        return _answer(request, 504 if isinstance(exc, KernelTimeout) else 502, f"the kernel failed: {exc}")

    # Validation problems are 400s here (the SDK's BadRequestError), not FastAPI's 422: say so in the schema.
    make_schema = app.openapi

    def openapi() -> dict:
        schema = make_schema()
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return schema

    app.openapi = openapi
