"""The Jupyter server extension: the user's leases, queues, slice timeline and metrics, as JSON and live.

Enabled as `openrl_lab` (`jupyter server extension enable openrl_lab`; a wheel install enables it through
`etc/jupyter/jupyter_server_config.d/openrl_lab.json`). Routes, under the server's base URL (so they work
behind JupyterHub's proxy at `/user/<name>/`), every one authenticated by Jupyter:

    GET  openrl/api/connection                  the control plane in use: base_url, grpc_target, connected
    GET  openrl/api/leases                      this user's orchestrator leases and lab leases, and `rows`: one
                                                joined row per lease (openrl_lab.lab.rows: group, state, share,
                                                queue position, reason, expected_wait_s, kernel, host, last step,
                                                metrics, reward, checkpoint), what %openrl status shows
    POST openrl/api/leases/<name>/release       releases this user's lab lease <name> (as Lab.release does):
                                                200 {"released": name}; 404 when the user has none of that name
    GET  openrl/api/queue                       per group: holder, queue (position, reason, expected_wait_s),
                                                duty cycle
    GET  openrl/api/timeline?group=G&since_seq=N slices (each group, or group G) after seq N, duty cycles
    GET  openrl/api/metrics/<lease>?after_step=N metric rows of a lab lease after step N
    WS   openrl/api/stream                      the same, pushed (the `leases` topic is the GET's object, rows
                                                included): send {"subscribe": ["leases", "queue",
                                                "timeline", "timeline:<group>", "metrics:<lease>"], "hz": 2};
                                                {"pause": true|false}; {"ping": x} answers a "pong"

POSTs are authenticated and XSRF-checked as every Jupyter POST is (a browser sends the `_xsrf` cookie's value
in `X-XSRFToken`; token-authenticated clients need not).

The control plane is found like a notebook finds it (`find_connection`): `c.OpenRLLab.url` / `api_key` /
`home`, else $OPENRL_LAB_URL / $OPENRL_LAB_API_KEY / $OPENRL_LAB_HOME, else the `connection.json` that
`openrl-lab serve` writes. Everything is asked with that one key, the user's: the control plane and the
orchestrator show each key its own leases only (other users' jobs appear without their names). The key is
never sent to the browser. Without a control plane the endpoints answer 503 saying how to start one.

Errors are JSON `{"message": ..., "status": ...}`. Blocking gRPC calls run on a small thread pool; HTTP
calls use httpx's async client: nothing here blocks the server's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx
from jupyter_server.auth.decorator import ws_authenticated
from jupyter_server.base.handlers import APIHandler, JupyterHandler
from jupyter_server.base.websocket import WebSocketMixin
from jupyter_server.utils import url_path_join
from tornado import ioloop, web, websocket
from traitlets import Float, Unicode
from traitlets.config import Configurable

from openrl_lab.lab.connection import Connection, LabError, find_connection
from openrl_lab.lab.rows import lease_rows
from openrl_lab.orchestrator.errors import (
    InvalidArgument,
    NotFound,
    OrchestratorError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from openrl_lab.sockets import async_http_client

START_HINT = (
    "start one with `openrl-lab serve` in a terminal, or `%openrl connect --local` in a notebook; or point "
    "this server at one with $OPENRL_LAB_URL and $OPENRL_LAB_API_KEY (or c.OpenRLLab.url / api_key)"
)
TOPICS = ("leases", "queue", "timeline")  # plus "timeline:<group>" and "metrics:<lease>"


def _jupyter_server_extension_points() -> list[dict]:
    """`openrl_lab` (whose __init__ re-exports this and `_load_jupyter_server_extension`) is the extension."""
    return [{"module": "openrl_lab"}]


class OpenRLLab(Configurable):
    """Which control plane the extension talks to (`c.OpenRLLab.*` in jupyter_server_config.py, or
    `--OpenRLLab.url=...` on the command line). Unset: the environment, then the lab home's connection.json."""

    url = Unicode(
        None,
        allow_none=True,
        config=True,
        help="Base URL of the control plane (default: $OPENRL_LAB_URL, else the running local one).",
    )
    api_key = Unicode(
        None,
        allow_none=True,
        config=True,
        help="API key (default: $OPENRL_LAB_API_KEY, $TINKER_API_KEY, or the home's connection.json).",
    )
    home = Unicode(
        None,
        allow_none=True,
        config=True,
        help="Lab home holding connection.json (default: $OPENRL_LAB_HOME or the per-user data dir).",
    )
    grpc_target = Unicode(
        None,
        allow_none=True,
        config=True,
        help="Orchestrator host:port (default: connection.json, else GET /api/v1/lab/info).",
    )
    max_hz = Float(10.0, config=True, help="Highest push rate a stream may ask for (per second).")
    min_hz = Float(0.1, config=True, help="Lowest push rate a stream may ask for (per second).")
    timeout_s = Float(10.0, config=True, help="Timeout of one call to the control plane (seconds).")


class ApiFailure(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Backend:
    """The extension's one view of the control plane: the connection (re-found when it goes away), a gRPC
    client on the orchestrator, and the calls the handlers make, all as coroutines."""

    def __init__(self, config: OpenRLLab, log):
        self.config, self.log = config, log
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="openrl-lab-ext")
        self._conn: Connection | None = None
        self._orch = None  # (target, key, TimeSliceOrchestratorClient)

    # --- plumbing ----------------------------------------------------------------------------------
    async def _blocking(self, fn: Callable, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kw))

    def forget(self) -> None:
        """Drops the connection (the control plane went away); the next call looks for one again."""
        self._conn = None
        if self._orch is not None:
            client, self._orch = self._orch[2], None
            self.executor.submit(client.close)

    async def connection(self, fresh: bool = False) -> Connection:
        if self._conn is not None and not fresh:
            return self._conn
        c = self.config
        try:
            conn = await self._blocking(find_connection, c.url or None, c.api_key or None, c.home or None)
        except LabError as e:
            self.forget()
            raise ApiFailure(503, f"{e}; {START_HINT}") from None
        if conn is None:
            self.forget()
            where = f" for lab home {c.home}" if c.home else ""
            raise ApiFailure(503, f"no OpenRL Lab control plane is running{where}: {START_HINT}")
        grpc_target = c.grpc_target or conn.grpc_target
        if not grpc_target:  # a URL without connection.json: the gateway says where its orchestrator is
            try:
                async with self._http(conn) as http:
                    r = await http.get("/api/v1/lab/info")
                if r.status_code == 200:
                    grpc_target = r.json().get("grpc_target")
            except (httpx.HTTPError, ValueError):
                pass
        conn = dataclasses.replace(conn, grpc_target=grpc_target or None)
        if self._conn is not None and (self._conn.base_url, self._conn.api_key) != (conn.base_url, conn.api_key):
            self.forget()
        self._conn = conn
        return conn

    def _http(self, conn: Connection) -> httpx.AsyncClient:
        return async_http_client(base_url=conn.base_url, headers=conn.headers(), timeout=self.config.timeout_s)

    async def http_get(
        self, path: str, params: dict | None = None, *, http: httpx.AsyncClient | None = None, ok404: bool = False
    ) -> dict | None:
        """GET on the control plane as the user; None for a 404 when `ok404`."""
        return await self.http_request("GET", path, params, http=http, ok404=ok404)

    async def http_request(
        self,
        method: str,
        path: str,
        params: dict | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        ok404: bool = False,
    ) -> dict | None:
        """A call on the control plane as the user: its JSON; None for a 404 when `ok404`."""
        conn = await self.connection()
        try:
            if http is None:
                async with self._http(conn) as client:
                    r = await client.request(method, path, params=params)
            else:
                r = await http.request(method, f"{conn.base_url}{path}", params=params, headers=conn.headers())
        except httpx.TransportError as e:
            self.forget()
            raise ApiFailure(
                503, f"the control plane at {conn.base_url} does not answer ({type(e).__name__}); {START_HINT}"
            ) from None
        if r.status_code == 200:
            return r.json()
        if r.status_code == 404 and ok404:
            return None
        raise ApiFailure(*_upstream_error(r, conn))

    def _client(self, conn: Connection):
        from openrl_lab.orchestrator import TimeSliceOrchestratorClient

        if not conn.grpc_target:
            raise ApiFailure(
                503,
                f"the control plane at {conn.base_url} runs no orchestrator (or did not say where): "
                "set c.OpenRLLab.grpc_target, or start it with `openrl-lab serve` (gRPC port on)",
            )
        if self._orch is None or self._orch[:2] != (conn.grpc_target, conn.api_key):
            if self._orch is not None:
                self.executor.submit(self._orch[2].close)
            # short retries: a dashboard should say "unavailable" soon rather than hang on a restart
            client = TimeSliceOrchestratorClient(
                conn.grpc_target,
                api_key=conn.api_key,
                job="jupyter-server",
                retry_timeout_s=min(2.0, self.config.timeout_s),
            )
            self._orch = (conn.grpc_target, conn.api_key, client)
        return self._orch[2]

    async def orchestrator(self, method: str, *args, **kw):
        """One call of TimeSliceOrchestratorClient (blocking gRPC) on the thread pool."""
        conn = await self.connection()
        client = self._client(conn)
        try:
            return await self._blocking(getattr(client, method), *args, **kw)
        except Unavailable as e:
            self.forget()
            raise ApiFailure(
                503, f"the orchestrator at {conn.grpc_target} does not answer ({e}); {START_HINT}"
            ) from None
        except Unauthenticated:
            raise ApiFailure(
                403,
                f"the orchestrator at {conn.grpc_target} does not accept the configured API key "
                "(set OPENRL_LAB_API_KEY or c.OpenRLLab.api_key to a key of yours)",
            ) from None
        except PermissionDenied as e:
            raise ApiFailure(403, str(e)) from None
        except NotFound as e:
            raise ApiFailure(404, str(e)) from None
        except InvalidArgument as e:
            raise ApiFailure(400, str(e)) from None
        except OrchestratorError as e:
            raise ApiFailure(502, f"the orchestrator answered {type(e).__name__}: {e}") from None

    # --- what the endpoints answer -----------------------------------------------------------------
    async def connection_info(self) -> dict:
        try:
            conn = await self.connection(fresh=True)
        except ApiFailure as e:
            return {"connected": False, "base_url": self.config.url or None, "grpc_target": None, "message": e.message}
        return {
            "connected": True,
            "base_url": conn.base_url,
            "grpc_target": conn.grpc_target,
            "home": str(conn.home) if conn.home else None,
            "has_api_key": bool(conn.api_key),
        }

    async def leases(self, http: httpx.AsyncClient | None = None) -> dict:
        conn = await self.connection()
        out: dict[str, Any] = {"orchestrator_leases": [], "lab_leases": [], "warnings": []}
        lab = await self.http_get("/api/v1/lab/leases", http=http, ok404=True)
        if lab is None:
            out["warnings"].append(
                f"the control plane at {conn.base_url} has no lab leases endpoint (an older "
                "version): showing orchestrator leases only"
            )
        else:
            out["lab_leases"] = list(lab.get("leases", []))
        groups = []
        if conn.grpc_target:
            out["orchestrator_leases"] = [L.to_dict() for L in await self.orchestrator("leases")]
            groups = await self.orchestrator("list_groups")
        else:
            out["warnings"].append("no orchestrator known for this control plane: no orchestrator leases")
        out["rows"] = lease_rows(out["lab_leases"], out["orchestrator_leases"], groups)
        return out

    async def release(self, name: str) -> dict:
        """Releases the user's lab lease `name`, as `Lab.release(name)` does (the control plane drops its kernel
        job; checkpoints stay)."""
        path = f"/api/v1/lab/leases/{quote(name, safe='')}"
        if await self.http_request("DELETE", path, ok404=True) is None:
            raise ApiFailure(404, f"you have no lab lease named {name!r}; `GET openrl/api/leases` lists yours")
        return {"released": name}

    async def queue(self, window_s: float = 60.0) -> dict:
        statuses = await self.orchestrator("get_status", None, window_s=window_s)
        return {"window_s": window_s, "groups": [_group_json(s) for s in statuses]}

    async def timeline(
        self, group: str | None = None, since: float = 0.0, since_seq: int = 0, limit: int = 1000
    ) -> dict:
        groups = [group] if group else [g.group_id for g in await self.orchestrator("list_groups")]
        out = []
        for g in groups:
            tl = await self.orchestrator("timeline", g, since=since, since_seq=since_seq, limit=limit)
            out.append({"group_id": g, **tl.to_dict()})
        return {"timelines": out}

    async def metrics(
        self, lease: str, after_step: int | None = None, limit: int | None = None, http: httpx.AsyncClient | None = None
    ) -> dict:
        params = {k: v for k, v in (("after_step", after_step), ("limit", limit)) if v is not None}
        path = f"/api/v1/lab/leases/{quote(lease, safe='')}/metrics"
        try:
            out = await self.http_get(path, params, http=http)
            assert out is not None  # only ok404=True gives None; here a 404 raises
            return out
        except ApiFailure as e:
            if e.status == 404:
                raise ApiFailure(
                    404,
                    f"no lab lease named {lease!r} for this user ({e.message}); `GET openrl/api/leases` lists yours",
                ) from None
            raise


def _upstream_error(r: httpx.Response, conn: Connection) -> tuple[int, str]:
    try:
        body = r.json()
        detail = body.get("detail") or body.get("message") or body.get("error") or r.text
    except (ValueError, AttributeError):
        detail = r.text
    if isinstance(detail, dict):
        detail = detail.get("message") or json.dumps(detail)
    if r.status_code == 401:
        return 403, (
            f"the control plane at {conn.base_url} does not accept the configured API key ({detail}); set "
            "OPENRL_LAB_API_KEY or c.OpenRLLab.api_key to a key of yours"
        )
    if 400 <= r.status_code < 500:
        return r.status_code, str(detail)
    return 502, f"the control plane at {conn.base_url} answered {r.status_code}: {detail}"


def _who(entry: dict | None) -> str:
    if entry is None:
        return "nobody"
    return f"your job {entry['job']!r}" if entry["mine"] else "another user's job"


def _group_json(st) -> dict:
    """A GroupStatus as JSON; each queue entry carries the orchestrator's sentence saying why it waits."""
    d = st.to_dict()
    g = d.pop("group")
    queue = [{**e, "who": _who(e)} for e in d["queue"]]
    return {
        "group_id": g["group_id"],
        "aliases": g["aliases"],
        "devices": g["devices"],
        "policy": g["policy"],
        "max_phase_s": g["max_phase_s"],
        **d,
        "queue": queue,
        "duty_cycle": d["duty"]["duty_cycle"],
    }


# --- HTTP handlers ------------------------------------------------------------------------------------


def _int_arg(handler: web.RequestHandler, name: str, default: int | None, lo: int | None = None) -> int | None:
    raw = handler.get_argument(name, None)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiFailure(400, f"{name} must be an integer, got {raw!r}") from None
    if lo is not None and value < lo:
        raise ApiFailure(400, f"{name} must be >= {lo}, got {value}")
    return value


def _float_arg(handler: web.RequestHandler, name: str, default: float) -> float:
    raw = handler.get_argument(name, None)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ApiFailure(400, f"{name} must be a number >= 0, got {raw!r}")
    return value


class _Handler(APIHandler):
    def initialize(self, backend: Backend) -> None:
        self.backend = backend

    async def _answer(self, produce: Callable[[], Any]) -> None:
        try:
            body = await produce()
        except ApiFailure as e:
            self.set_status(e.status)
            body = {"message": e.message, "status": e.status}
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(body))


class ConnectionHandler(_Handler):
    @web.authenticated
    async def get(self) -> None:
        await self._answer(self.backend.connection_info)


class LeasesHandler(_Handler):
    @web.authenticated
    async def get(self) -> None:
        await self._answer(self.backend.leases)


class ReleaseHandler(_Handler):
    @web.authenticated
    async def post(self, name: str) -> None:
        await self._answer(lambda: self.backend.release(name))


class QueueHandler(_Handler):
    @web.authenticated
    async def get(self) -> None:
        async def produce():
            window = _float_arg(self, "window_s", 60.0)
            return await self.backend.queue(window if window > 0 else 60.0)

        await self._answer(produce)


class TimelineHandler(_Handler):
    @web.authenticated
    async def get(self) -> None:
        async def produce():
            return await self.backend.timeline(
                self.get_argument("group", None) or None,
                since=_float_arg(self, "since", 0.0),
                since_seq=_int_arg(self, "since_seq", 0, lo=0),
                limit=_int_arg(self, "limit", 1000, lo=1),
            )

        await self._answer(produce)


class MetricsHandler(_Handler):
    @web.authenticated
    async def get(self, lease: str) -> None:
        async def produce():
            return await self.backend.metrics(
                lease, after_step=_int_arg(self, "after_step", None, lo=-1), limit=_int_arg(self, "limit", None, lo=1)
            )

        await self._answer(produce)


# --- the live stream ----------------------------------------------------------------------------------


class StreamHandler(WebSocketMixin, websocket.WebSocketHandler, JupyterHandler):
    """Pushes what the client subscribed to, at the rate it chose (capped), until it pauses or leaves.

    Each tick sends one `{"type": "update", "seq", "time", <topic>: ..., "unchanged": [...]}`: `leases` and
    `queue` are snapshots, sent when they changed (else named in `unchanged`); `timeline` carries the slice
    records after the last one sent (a slice appears again, with a higher seq, when it ends: key them by
    `slice_id`) and each group's duty cycle; `metrics:<lease>` the rows after the last step sent. A topic
    that fails carries `{"error", "status"}`; no control plane at all is one `{"type": "error", ...}` (sent
    again only when it changes; the stream resumes by itself when one appears).
    """

    def initialize(self, backend: Backend) -> None:
        self.backend = backend
        self.topics: list[str] = []
        self.hz = 2.0
        self.paused = False
        self.timer: ioloop.PeriodicCallback | None = None
        self.busy = False
        self.closed = False
        self.seq = 0
        self.ticks = self.paused_ticks = 0
        self.last: dict[str, str] = {}
        self.timeline_seq: dict[str, int] = {}
        self.metrics_step: dict[str, int] = {}
        self.last_error: str | None = None
        self.http: httpx.AsyncClient | None = None
        self._bg_tasks: set[asyncio.Future] = set()  # the loop keeps only weak references to the tasks started here

    def _start_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._bg_tasks.add(task)
        task.add_done_callback(self._bg_tasks.discard)

    @ws_authenticated
    async def get(self, *args, **kwargs):
        res = super().get(*args, **kwargs)
        if res is not None:
            await res

    def open(self, *args, **kwargs):
        self.http = async_http_client(timeout=self.backend.config.timeout_s)
        return super().open(*args, **kwargs)

    def send(self, msg: dict) -> None:
        if not self.closed:
            try:
                self.write_message(json.dumps(msg))
            except websocket.WebSocketClosedError:
                self.closed = True

    def on_message(self, message) -> None:
        try:
            msg = json.loads(message)
            if not isinstance(msg, dict):
                raise ValueError("not an object")
        except ValueError:
            self.send(
                {
                    "type": "error",
                    "status": 400,
                    "message": 'messages are JSON objects: {"subscribe": [...], "hz": 2}, {"pause": true}, {"ping": 1}',
                }
            )
            return
        unknown = sorted(set(msg) - {"subscribe", "hz", "pause", "ping"})
        if unknown:
            self.send(
                {
                    "type": "error",
                    "status": 400,
                    "message": f"unknown field(s) {unknown}: send subscribe, hz, pause or ping",
                }
            )
            return
        if "subscribe" in msg or "hz" in msg:
            try:
                self._configure(msg.get("subscribe", self.topics), msg.get("hz", self.hz))
            except ValueError as e:
                self.send({"type": "error", "status": 400, "message": str(e)})
                return
            self.send({"type": "subscribed", "topics": self.topics, "hz": self.hz})
        if "pause" in msg:
            self.paused = bool(msg["pause"])
            self.send({"type": "paused" if self.paused else "resumed"})
        if "ping" in msg:
            self.send(
                {
                    "type": "pong",
                    "ping": msg["ping"],
                    "ticks": self.ticks,
                    "paused_ticks": self.paused_ticks,
                    "updates": self.seq,
                    "paused": self.paused,
                }
            )
        if ("subscribe" in msg or "pause" in msg) and not self.paused and self.topics:
            self._start_task(self._tick())  # at once, not a period later

    def _configure(self, topics, hz) -> None:
        if not isinstance(topics, list) or not all(isinstance(t, str) for t in topics):
            raise ValueError(
                "subscribe takes a list of topics: leases, queue, timeline, timeline:<group>, metrics:<lease>"
            )
        bad = [
            t
            for t in topics
            if t not in TOPICS and not (t.startswith(("metrics:", "timeline:")) and len(t.split(":", 1)[1]) > 0)
        ]
        if bad:
            raise ValueError(f"unknown topic(s) {bad}: use leases, queue, timeline, timeline:<group>, metrics:<lease>")
        cfg = self.backend.config
        if isinstance(hz, bool) or not isinstance(hz, (int, float)) or not math.isfinite(hz) or hz <= 0:
            raise ValueError(f"hz must be a positive number (at most {cfg.max_hz:g}), got {hz!r}")
        self.hz = float(min(max(hz, cfg.min_hz), cfg.max_hz))
        new = list(dict.fromkeys(topics))
        for t in set(self.topics) - set(new):  # a topic subscribed again starts over with a snapshot
            self.last.pop(t, None)
        self.timeline_seq = {g: s for g, s in self.timeline_seq.items() if "timeline" in new or f"timeline:{g}" in new}
        self.metrics_step = {n: s for n, s in self.metrics_step.items() if f"metrics:{n}" in new}
        self.topics = new
        if self.timer is not None:
            self.timer.stop()
        self.timer = ioloop.PeriodicCallback(self._tick, 1000.0 / self.hz)
        self.timer.start()

    async def _tick(self) -> None:
        self.ticks += 1
        if self.closed or not self.topics:
            return
        if self.paused:
            self.paused_ticks += 1
            return
        if self.busy:  # the last one still runs: skip a beat rather than pile up calls
            return
        self.busy = True
        try:
            msg = await self._update()
            if self.paused or self.closed:
                return
            self.seq += 1
            self.send({"type": "update", "seq": self.seq, "time": time.time(), **msg})
            self.last_error = None
        except ApiFailure as e:
            if e.message != self.last_error and not self.paused:
                self.send({"type": "error", "status": e.status, "message": e.message})
                self.last_error = e.message
        except Exception as e:  # one bad tick must not end the stream
            self.log.exception("openrl_lab stream tick failed")
            self.send({"type": "error", "status": 500, "message": f"{type(e).__name__}: {e}"})
        finally:
            self.busy = False

    async def _update(self) -> dict:
        b = self.backend
        await b.connection()  # no control plane: one error for the whole tick
        out: dict[str, Any] = {}
        unchanged = []
        groups_wanted = [t.split(":", 1)[1] for t in self.topics if t.startswith("timeline:")]
        for topic in self.topics:
            try:
                if topic in ("leases", "queue"):
                    data = await (b.leases(http=self.http) if topic == "leases" else b.queue())
                    text = json.dumps(data, sort_keys=True)
                    if self.last.get(topic) == text:
                        unchanged.append(topic)
                        continue
                    self.last[topic] = text
                    out[topic] = data
                elif topic == "timeline" or topic.startswith("timeline:"):
                    if topic == "timeline":
                        groups = [g.group_id for g in await b.orchestrator("list_groups")]
                    else:
                        groups = [topic.split(":", 1)[1]]
                    if topic == "timeline":
                        groups = [g for g in groups if g not in groups_wanted]  # not twice
                    out[topic] = {"timelines": [await self._timeline(g) for g in groups]}
                else:
                    name = topic.split(":", 1)[1]
                    after = self.metrics_step.get(name)
                    data = await b.metrics(name, after_step=after, http=self.http)
                    rows = data.get("rows", [])
                    if rows:
                        self.metrics_step[name] = max(r["step"] for r in rows)
                    out[topic] = {"rows": rows, "last_step": self.metrics_step.get(name)}
            except ApiFailure as e:
                if e.status == 503:
                    raise
                out[topic] = {"error": e.message, "status": e.status}
        if unchanged:
            out["unchanged"] = unchanged
        return out

    async def _timeline(self, group: str) -> dict:
        since = self.timeline_seq.get(group, 0)
        tl = await self.backend.orchestrator("timeline", group, since_seq=since, limit=1000)
        status = await self.backend.orchestrator("get_status", group)
        self.timeline_seq[group] = max(since, tl.last_seq)
        return {
            "group_id": group,
            "records": [r.to_dict() for r in tl.records],
            "last_seq": self.timeline_seq[group],
            "duty": status.duty.to_dict(),
        }

    def on_close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.stop()
        if self.http is not None:
            self._start_task(self.http.aclose())


# --- loading ------------------------------------------------------------------------------------------


def _load_jupyter_server_extension(serverapp) -> None:
    config = OpenRLLab(parent=serverapp)
    backend = Backend(config, serverapp.log)
    base = serverapp.web_app.settings["base_url"]
    kw = {"backend": backend}
    route = lambda *p: url_path_join(base, "openrl", "api", *p)  # noqa: E731
    serverapp.web_app.add_handlers(
        ".*$",
        [
            (route("connection"), ConnectionHandler, kw),
            (route("leases"), LeasesHandler, kw),
            (route("leases", "([^/]+)", "release"), ReleaseHandler, kw),
            (route("queue"), QueueHandler, kw),
            (route("timeline"), TimelineHandler, kw),
            (route("metrics", "([^/]+)"), MetricsHandler, kw),
            (route("stream"), StreamHandler, kw),
        ],
    )
    serverapp.web_app.settings["openrl_lab_backend"] = backend
    serverapp.log.info("openrl_lab: serving %s", route(""))
    __import__("openrl_lab.lab.save_hook", fromlist=["register"]).register(serverapp)  # widget outputs save a note
