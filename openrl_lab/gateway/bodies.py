"""Request bodies: how large they may be and which JSON the gateway accepts.

JSON bodies are parsed by FastAPI into the route's pydantic model, through `StrictJsonRoute`, which
refuses (400, naming the place) what Python's json module would let through and SQLite or a later JSON
answer could not take back: invalid UTF-8, NaN and infinities (`1e999`), integers outside int64 and
unpaired UTF-16 surrogates. What is refused is never stored, so it cannot break a later read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from openrl_lab.gateway.errors import CLIENT_CLOSED, HUNG_UP, ApiError, body_model_name

KiB, MiB = 1024, 1024 * 1024
# Bodies over these sizes get a 413 before they are read. Everything that is stored (metadata, names,
# tags) comes in bodies of the default size, which also bounds what one request can store.
MAX_BODY = 64 * KiB
MAX_SAMPLE_BODY = 8 * MiB  # a prompt of the longest context, as JSON ints
MAX_METRICS_BODY = 32 * MiB  # the lab client's 10,000 rows of up to 64 metrics
MAX_PROTO_BODY = 64 * MiB  # one forward_backward chunk; also its size after zstd decoding (wire.py)
# the same chunk as JSON (SDKs before 0.25, whose chunks are ~5 MB by their estimate of 10 bytes a value; a float
# is ~20 as JSON): smaller than protobuf's, since every JSON number is parsed into a Python object first
MAX_JSON_FWDBWD_BODY = 32 * MiB
MAX_SANDBOX_BODY = 16 * MiB  # one program with its files (test cases), base64 in JSON
MAX_SANDBOX_BATCH_BODY = 128 * MiB  # an RL group's programs in one request

LIMITS_DOC = (
    f"Request bodies are at most {MAX_BODY // KiB} KiB (413 otherwise), except `asample` "
    f"({MAX_SAMPLE_BODY // MiB} MiB), `lab/leases/{{name}}/metrics` ({MAX_METRICS_BODY // MiB} MiB) and "
    f"`forward_backward` ({MAX_PROTO_BODY // MiB} MiB, before and after zstd decoding; "
    f"{MAX_JSON_FWDBWD_BODY // MiB} MiB as JSON, also for `forward`), `/sandbox/run_code` "
    f"({MAX_SANDBOX_BODY // MiB} MiB) and `/sandbox/run_batch` ({MAX_SANDBOX_BATCH_BODY // MiB} MiB)."
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodyError(ValueError):
    """A body that is not JSON the gateway accepts; the message names the problem and where it is."""


def _refuse_constant(name: str) -> None:
    raise BodyError(f"{name} is not a JSON number: numbers must be finite")


def _where(loc: tuple) -> str:
    # escaped: the place may itself be a key holding a surrogate, which the JSON answer could not encode
    return ".".join(str(part) for part in loc).encode("utf-8", "backslashreplace").decode() or "body"


def _check_values(value: Any) -> None:
    """Refuses the body if any value is one it must not hold; the place is named by a second, slower walk
    that only a refused body pays for (this runs on the event loop, for bodies of up to 8 MiB)."""
    if _any_bad(value):
        _refuse_first_bad(value)


def _bad_scalar(v: Any) -> bool:
    t = type(v)  # json.loads makes exactly these types
    if t is int:
        return not INT64_MIN <= v <= INT64_MAX
    if t is float:
        return not math.isfinite(v)
    return t is str and _SURROGATE.search(v) is not None


def _any_bad(value: Any) -> bool:
    stack = [value]
    while stack:  # iteratively: the depth is the sender's choice
        v = stack.pop()
        if type(v) is dict:
            stack.extend(v)
            stack.extend(v.values())
        elif type(v) is list:
            for item in v:  # scalars inline: a long list of numbers is the common large body
                if type(item) in (dict, list):
                    stack.append(item)
                elif _bad_scalar(item):
                    return True
        elif _bad_scalar(v):
            return True
    return False


def _refuse_first_bad(value: Any) -> None:
    """Raises BodyError naming the place of a bad value."""
    stack: list[tuple[tuple, Any]] = [((), value)]
    while stack:
        loc, v = stack.pop()
        if isinstance(v, dict):
            stack.extend(((*loc, "<key>"), k) for k in v)
            stack.extend(((*loc, k), item) for k, item in v.items())
        elif isinstance(v, list):
            stack.extend(((*loc, i), item) for i, item in enumerate(v))
        elif isinstance(v, str):
            if _SURROGATE.search(v):
                raise BodyError(f"{_where(loc)}: the string holds an unpaired UTF-16 surrogate")
        elif isinstance(v, bool):
            continue
        elif isinstance(v, int):
            if not INT64_MIN <= v <= INT64_MAX:
                raise BodyError(f"{_where(loc)}: integer {str(v)[:24]}… does not fit in 64 bits")
        elif isinstance(v, float) and not math.isfinite(v):
            raise BodyError(f"{_where(loc)}: number out of range (overflows to infinity): numbers must be finite")


def parse_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(f"the body is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except BodyError:
        raise
    except json.JSONDecodeError as e:
        raise BodyError(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise BodyError(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise BodyError("the body is not valid JSON: nested too deeply") from None
    _check_values(value)
    return value


class StrictJsonRequest(Request):
    async def body(self) -> bytes:
        try:
            return await super().body()
        except ClientDisconnect:  # FastAPI would answer 400 "error parsing the body": it is a hang-up, counted as one
            raise ApiError(CLIENT_CLOSED, HUNG_UP) from None

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json(await self.body())
            except BodyError as e:
                raise ApiError(400, f"invalid {body_model_name(self)}: {e}") from None
        return self._json


class StrictJsonRoute(APIRoute):
    """A route whose JSON body FastAPI reads with `parse_json` (FastAPI's documented custom-Request hook)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler
