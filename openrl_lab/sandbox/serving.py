"""The lab's sandbox service: per-user concurrency, a per-user queue bound and accounting, and the executions'
outcomes and times as Prometheus series, in front of an executor that runs each validated program:

- `LocalExecutor`: this host's warm pool (`pool.SandboxPool`), started on the first request, not with the lab (a
  lab whose users never run code pays nothing). If the host cannot sandbox (no bubblewrap, user namespaces off),
  every request is a `SandboxError` that says what the host lacks (`isolation.check_host`), and the rest of the
  lab works as before. `server.py` (the standalone sandbox server) serves one too.
- `RemoteExecutor`: a sandbox server elsewhere (`openrl-lab sandbox serve`, the chart's sandbox Pods), when
  OPENRL_SANDBOX_REMOTE_URL is set: each program is one `POST <url>/sandbox/run_code` with the service token. A
  server that is down, refuses or answers nonsense is a `SandboxError` response naming it, never a 500.

Fairness: a user runs at most `per_user` programs at once (the others queue, up to `queue_per_user`; past it a
request is refused with a message, HTTP 429), so one RL group of 512 programs does not hold every warm sandbox
while another user's single check waits behind it. Both executors sit behind that gate: a remote server does no
accounting of its own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections import Counter as Tally
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from openrl_lab.sandbox.isolation import Execution, Limits, SandboxUnavailable, check_host
from openrl_lab.sandbox.pool import SandboxPool
from openrl_lab.sandbox.protocol import CommandRunResult, RunCodeRequest, RunCodeResponse
from openrl_lab.settings import settings

OUTCOMES = ("success", "failed", "timeout", "sandbox_error")
# On top of a program's run_timeout, what a remote run may take: waiting for a warm sandbox there and the
# sandbox's start (isolation.START_TIMEOUT_S, 30 s at worst), its report and teardown, and the network.
REMOTE_SLACK_S = 60.0
REMOTE_STATUS_TIMEOUT_S = 5.0


class QueueFull(RuntimeError):
    """The user has `queue_per_user` programs waiting already (HTTP 429)."""


class BadRequest(ValueError):
    """A request the sandbox refuses before running it (HTTP 400); the message names the field."""


@dataclass
class _Account:
    """One user's use of the sandboxes: what runs now, what waits, and what ran."""

    gate: asyncio.Semaphore
    waiting: int = 0
    running: int = 0
    runs: int = 0
    seconds: float = 0.0
    outcomes: Tally = field(default_factory=Tally)


@dataclass(frozen=True)
class SandboxConfig:
    pool_size: int = 4
    per_user: int = 4
    queue_per_user: int = 1024
    max_wall_s: float = 300.0
    memory_bytes: int = 512 << 20
    max_memory_bytes: int = 4 << 30
    remote_url: str | None = None  # a sandbox server's base URL: forward there instead of running here
    remote_token_file: Path | None = None


def config_from_settings() -> SandboxConfig:
    """The service's settings from the environment (OPENRL_SANDBOX_*)."""
    s = settings()
    return SandboxConfig(
        pool_size=s.sandbox_pool_size,
        per_user=s.sandbox_per_user,
        queue_per_user=s.sandbox_queue_per_user,
        max_wall_s=s.sandbox_max_wall_s,
        memory_bytes=s.sandbox_memory_bytes,
        max_memory_bytes=s.sandbox_max_memory_bytes,
        remote_url=s.sandbox_remote_url,
        remote_token_file=s.sandbox_remote_token_file,
    )


def limits_for(config: SandboxConfig, req: RunCodeRequest) -> Limits:
    """The Limits a request asks for, within `config`'s; BadRequest naming the field otherwise."""
    if req.run_timeout > config.max_wall_s:
        raise BadRequest(
            f"run_timeout {req.run_timeout:g} s is over this lab's limit of {config.max_wall_s:g} s "
            "(OPENRL_SANDBOX_MAX_WALL_S)"
        )
    memory = config.memory_bytes if req.memory_limit_MB in (-1, 0) else req.memory_limit_MB << 20
    if memory <= 0 or memory > config.max_memory_bytes:
        raise BadRequest(
            f"memory_limit_MB {req.memory_limit_MB} is not in 1..{config.max_memory_bytes >> 20} "
            "(-1: the lab's default)"
        )
    return Limits(wall_s=req.run_timeout, cpu_s=req.run_timeout + 1.0, memory_bytes=memory)


def response_of(ex: Execution) -> RunCodeResponse:
    """An Execution as SandboxFusion's response."""
    if ex.status == "Error":
        return RunCodeResponse(status="SandboxError", message=ex.message)
    ok = ex.status == "Finished" and ex.return_code == 0
    return RunCodeResponse(
        status="Success" if ok else "Failed",
        message="" if ok else _why(ex),
        run_result=CommandRunResult(
            status="TimeLimitExceeded" if ex.status == "TimeLimitExceeded" else "Finished",
            execution_time=ex.execution_time,
            return_code=ex.return_code,
            stdout=ex.stdout,
            stderr=ex.stderr,
            truncated=ex.truncated,
        ),
        files={k: base64.b64encode(v).decode() for k, v in ex.files.items()},
    )


def sandbox_error(message: str) -> RunCodeResponse:
    return RunCodeResponse(status="SandboxError", message=message)


# --- executors: what runs a validated program ----------------------------------------------------------------
class Executor(Protocol):
    async def run(self, req: RunCodeRequest, limits: Limits) -> RunCodeResponse:
        """One program, already checked against the lab's limits. BadRequest for what the executor refuses
        before running it; the sandbox's own failures are a SandboxError response."""
        ...

    async def describe(self) -> dict:
        """{"isolation": the line naming it or None, "unavailable": why not or None, "pool": its stats}, plus
        what else names the executor ("remote": its URL)."""
        ...

    def pool_stats(self) -> dict:
        """The pool's last known stats (for /metrics, read at scrape time: never blocks)."""
        ...

    async def aclose(self) -> None: ...


class LocalExecutor:
    """This host's warm pool, started on the first program."""

    def __init__(self, config: SandboxConfig) -> None:
        self.config = config
        self._pool: SandboxPool | None = None
        self._host: str | None = None

    def _ready_pool(self) -> SandboxPool:
        """The warm pool, started on first use; SandboxUnavailable (saying what the host lacks) otherwise."""
        if self._pool is None:
            self._host = check_host()
            self._pool = SandboxPool(size=self.config.pool_size, limits=Limits(memory_bytes=self.config.memory_bytes))
        return self._pool

    async def run(self, req: RunCodeRequest, limits: Limits) -> RunCodeResponse:
        try:
            pool = self._ready_pool()
        except SandboxUnavailable as e:
            return sandbox_error(str(e))
        try:
            ex = await pool.run(
                req.code,
                req.language,
                stdin=req.stdin or "",
                files=req.decoded_files(),
                fetch_files=req.fetch_files,
                limits=limits,
            )
        except ValueError as e:  # the pool's checks: the language, a file name outside the scratch
            raise BadRequest(str(e)) from None
        return response_of(ex)

    async def describe(self) -> dict:
        host, why = self._host, None
        if host is None:
            try:
                host = await asyncio.to_thread(check_host)  # the first time, it starts a sandbox: off the loop
            except SandboxUnavailable as e:
                why = str(e)
        return {"isolation": host, "unavailable": why, "pool": self.pool_stats()}

    def pool_stats(self) -> dict:
        return self._pool.stats() if self._pool is not None else {"size": self.config.pool_size, "warm": 0}

    async def aclose(self) -> None:
        if self._pool is not None:
            with contextlib.suppress(Exception):
                await self._pool.aclose()
            self._pool = None


class RemoteExecutor:
    """A sandbox server (`openrl-lab sandbox serve`) at `url`, authenticated with the token in `token_file`."""

    def __init__(self, url: str, token_file: Path | None) -> None:
        self.url = url.rstrip("/")
        self.token_file = token_file
        self._http: httpx.AsyncClient | None = None
        self._stats: dict = {}

    def _headers(self) -> dict[str, str]:
        """Read at every request: a rotated Secret is picked up without a restart. ValueError naming the file."""
        if self.token_file is None:
            raise ValueError("OPENRL_SANDBOX_REMOTE_TOKEN_FILE is not set (the sandbox server's service token)")
        try:
            token = self.token_file.read_text().strip()
        except OSError as e:
            raise ValueError(f"the sandbox server's token file {self.token_file} cannot be read ({e})") from None
        if not token:
            raise ValueError(f"the sandbox server's token file {self.token_file} is empty")
        return {"Authorization": f"Bearer {token}"}

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            # as many connections as programs may run at once across users; the server's pool bounds the rest
            self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))
        return self._http

    async def _call(self, method: str, path: str, timeout: float, **kw) -> httpx.Response | str:
        """The response, or one line saying why there is none (naming the server)."""
        try:
            headers = self._headers()
        except ValueError as e:
            return f"the sandbox server at {self.url} cannot be used: {e}"
        try:
            return await self._client().request(method, self.url + path, headers=headers, timeout=timeout, **kw)
        except httpx.TimeoutException:
            return f"the sandbox server at {self.url} did not answer within {timeout:g} s"
        except httpx.HTTPError as e:
            return f"the sandbox server at {self.url} cannot be reached ({type(e).__name__}: {e or 'no detail'})"

    def _refused(self, r: httpx.Response) -> str:
        try:
            detail = r.json().get("detail") or r.text
        except ValueError:
            detail = r.text
        return f"the sandbox server at {self.url} refused the request (HTTP {r.status_code}: {str(detail)[:300]})"

    async def run(self, req: RunCodeRequest, limits: Limits) -> RunCodeResponse:
        # the lab's memory default, not the server's: the lab decides the limits, the server applies them
        body = req.model_copy(update={"memory_limit_MB": limits.memory_bytes >> 20}).model_dump()
        r = await self._call("POST", "/sandbox/run_code", req.run_timeout + REMOTE_SLACK_S, json=body)
        if isinstance(r, str):
            return sandbox_error(r)
        if r.status_code == 400:
            raise BadRequest(self._refused(r))
        if r.status_code != 200:
            return sandbox_error(self._refused(r))
        try:
            return RunCodeResponse.model_validate(r.json())
        except ValueError:
            return sandbox_error(f"the sandbox server at {self.url} answered something that is not a response")

    async def describe(self) -> dict:
        r = await self._call("GET", "/sandbox/status", REMOTE_STATUS_TIMEOUT_S)
        if isinstance(r, str) or r.status_code != 200:
            self._stats = {}
            why = r if isinstance(r, str) else self._refused(r)
            return {"isolation": None, "unavailable": why, "pool": {"warm": 0}, "remote": self.url}
        s = r.json()
        self._stats = s.get("pool") or {}
        return {"isolation": s.get("isolation"), "unavailable": s.get("unavailable"), "pool": self._stats,
                "remote": self.url}  # fmt: skip

    def pool_stats(self) -> dict:
        return self._stats

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def executor_for(config: SandboxConfig) -> Executor:
    if config.remote_url:
        return RemoteExecutor(config.remote_url, config.remote_token_file)
    return LocalExecutor(config)


# --- the service -----------------------------------------------------------------------------------------------
class SandboxService:
    def __init__(
        self,
        config: SandboxConfig = SandboxConfig(),
        registry: CollectorRegistry | None = None,
        executor: Executor | None = None,
    ):
        self.config = config
        self.executor = executor if executor is not None else executor_for(config)
        self._accounts: dict[str, _Account] = {}
        self.executions = Counter(
            "openrl_sandbox_executions",
            "Sandboxed programs run, by outcome (success: return code 0; failed: another return code or a "
            "signal; timeout: past its run_timeout; sandbox_error: the sandbox itself failed)",
            ["outcome"],
            registry=registry,
        )
        self.seconds = Histogram(
            "openrl_sandbox_execution_seconds",
            "Wall time of sandboxed programs",
            registry=registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.queued = Histogram(
            "openrl_sandbox_queue_seconds",
            "Time a sandboxed program waited for its user's share of the pool",
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300),
        )
        if registry is not None:
            registry.register(_PoolCollector(self))

    def _account(self, owner: str) -> _Account:
        a = self._accounts.get(owner)
        if a is None:
            a = self._accounts[owner] = _Account(asyncio.Semaphore(self.config.per_user))
        return a

    # --- runs -------------------------------------------------------------------------------------------
    def limits_for(self, req: RunCodeRequest) -> Limits:
        return limits_for(self.config, req)

    async def run(self, owner: str, req: RunCodeRequest) -> RunCodeResponse:
        """One program, for `owner`: its response (SandboxFusion's). BadRequest and QueueFull before it ran."""
        limits = self.limits_for(req)
        req.decoded_files()  # base64 checked by the model; decoded here once so a bad body fails before queueing
        account = self._account(owner)
        if account.waiting >= self.config.queue_per_user:
            raise QueueFull(
                f"{account.waiting} of your sandbox runs are queued already (at most {self.config.queue_per_user}; "
                f"{self.config.per_user} run at once): wait for some to finish"
            )
        t0 = time.perf_counter()
        account.waiting += 1
        waiting = True
        try:
            async with account.gate:
                account.waiting -= 1
                waiting = False
                account.running += 1
                try:
                    self.queued.observe(time.perf_counter() - t0)
                    response = await self.executor.run(req, limits)
                finally:
                    account.running -= 1
        finally:
            if waiting:
                account.waiting -= 1
        return self._count(account, response)

    async def run_batch(self, owner: str, reqs: list[RunCodeRequest]) -> list[RunCodeResponse]:
        """Many programs at once (an RL group's), in order; each checked before any runs."""
        for i, r in enumerate(reqs):
            try:
                self.limits_for(r)
            except BadRequest as e:
                raise BadRequest(f"requests[{i}]: {e}") from None
        account = self._account(owner)
        if account.waiting + len(reqs) > self.config.queue_per_user:
            raise QueueFull(
                f"{len(reqs)} more sandbox runs would queue {account.waiting + len(reqs)} of yours (at most "
                f"{self.config.queue_per_user}; {self.config.per_user} run at once): send fewer at a time"
            )
        return list(await asyncio.gather(*(self.run(owner, r) for r in reqs)))

    def _count(self, account: _Account, response: RunCodeResponse) -> RunCodeResponse:
        run = response.run_result
        if response.status == "SandboxError":
            outcome = "sandbox_error"
        elif response.status == "Success":
            outcome = "success"
        else:
            outcome = "timeout" if run is not None and run.status == "TimeLimitExceeded" else "failed"
        seconds = (run.execution_time or 0.0) if run is not None else 0.0
        account.runs += 1
        account.seconds += seconds
        account.outcomes[outcome] += 1
        self.executions.labels(outcome).inc()
        if outcome != "sandbox_error":
            self.seconds.observe(seconds)
        return response

    # --- views ------------------------------------------------------------------------------------------
    async def status(self, owner: str) -> dict:
        """What `%openrl sandbox` and `lab.sandbox.status()` show: the isolation (a remote server's: "remote"
        names it), the pool, and the caller's own use (never another user's)."""
        where = await self.executor.describe()
        a = self._accounts.get(owner)
        return {
            "available": where["isolation"] is not None,
            **where,
            "limits": {
                "per_user": self.config.per_user,
                "queue_per_user": self.config.queue_per_user,
                "max_wall_s": self.config.max_wall_s,
                "memory_bytes": self.config.memory_bytes,
            },
            "you": {
                "runs": a.runs if a else 0,
                "running": a.running if a else 0,
                "waiting": a.waiting if a else 0,
                "seconds": round(a.seconds, 3) if a else 0.0,
                "outcomes": {o: (a.outcomes[o] if a else 0) for o in OUTCOMES},
            },
        }

    async def announce(self, log) -> None:
        """One line in the lab's log at start: the isolation code rewards will run in, or what the host lacks."""
        where = await self.executor.describe()
        if where["isolation"]:
            log.info("sandbox: %s%s", where["isolation"], f" (at {where['remote']})" if where.get("remote") else "")
        else:
            log.warning("sandbox: code rewards cannot run here: %s", where["unavailable"])

    async def aclose(self) -> None:
        await self.executor.aclose()


def _why(ex: Execution) -> str:
    if ex.status == "TimeLimitExceeded":
        return "the program ran past its run_timeout"
    if ex.return_code is not None and ex.return_code < 0:
        return f"the program was killed by signal {-ex.return_code}"
    return f"the program exited with return code {ex.return_code}"


class _PoolCollector:
    """Read at scrape time: the pool's warm and running sandboxes (none until the first request; a remote
    server's as of the last status asked of it)."""

    def __init__(self, service: SandboxService):
        self.service = service

    def collect(self):
        stats = self.service.executor.pool_stats()
        warm = GaugeMetricFamily("openrl_sandbox_warm", "Warm sandboxes waiting for a program")
        warm.add_metric([], float(stats.get("warm", 0)))
        running = GaugeMetricFamily("openrl_sandbox_running", "Sandboxed programs running now")
        running.add_metric([], float(stats.get("running", 0)))
        return [warm, running]
