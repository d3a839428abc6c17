"""The lab's sandbox service: one warm pool (`pool.SandboxPool`) shared by the lab's users, each execution in
a fresh sandbox of its own, with per-user concurrency, a per-user queue bound and accounting, and the
executions' outcomes and times as Prometheus series.

The pool starts on the first request, not with the lab (a lab whose users never run code pays nothing); if the
host cannot sandbox (no bubblewrap, user namespaces off), every request is a `SandboxError` that says what the
host lacks (`isolation.check_host`), and the rest of the lab works as before.

Fairness: a user runs at most `per_user` programs at once (the others queue, up to `queue_per_user`; past it a
request is refused with a message, HTTP 429), so one RL group of 512 programs does not hold every warm sandbox
while another user's single check waits behind it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections import Counter as Tally
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from openrl_lab.sandbox.isolation import Execution, Limits, SandboxUnavailable, check_host
from openrl_lab.sandbox.pool import SandboxPool
from openrl_lab.sandbox.protocol import CommandRunResult, RunCodeRequest, RunCodeResponse
from openrl_lab.settings import settings

OUTCOMES = ("success", "failed", "timeout", "sandbox_error")


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
    )


class SandboxService:
    def __init__(self, config: SandboxConfig = SandboxConfig(), registry: CollectorRegistry | None = None):
        self.config = config
        self._pool: SandboxPool | None = None
        self._host: str | None = None
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

    # --- the pool ---------------------------------------------------------------------------------------
    def _ready_pool(self) -> SandboxPool:
        """The warm pool, started on first use; SandboxUnavailable (saying what the host lacks) otherwise."""
        if self._pool is None:
            self._host = check_host()
            self._pool = SandboxPool(size=self.config.pool_size, limits=Limits(memory_bytes=self.config.memory_bytes))
        return self._pool

    def host(self) -> tuple[str | None, str | None]:
        """(the isolation in use, None) or (None, why the host cannot sandbox)."""
        try:
            return check_host(), None
        except SandboxUnavailable as e:
            return None, str(e)

    def _account(self, owner: str) -> _Account:
        a = self._accounts.get(owner)
        if a is None:
            a = self._accounts[owner] = _Account(asyncio.Semaphore(self.config.per_user))
        return a

    # --- runs -------------------------------------------------------------------------------------------
    def limits_for(self, req: RunCodeRequest) -> Limits:
        c = self.config
        if req.run_timeout > c.max_wall_s:
            raise BadRequest(
                f"run_timeout {req.run_timeout:g} s is over this lab's limit of {c.max_wall_s:g} s "
                "(OPENRL_SANDBOX_MAX_WALL_S)"
            )
        memory = c.memory_bytes if req.memory_limit_MB in (-1, 0) else req.memory_limit_MB << 20
        if memory <= 0 or memory > c.max_memory_bytes:
            raise BadRequest(
                f"memory_limit_MB {req.memory_limit_MB} is not in 1..{c.max_memory_bytes >> 20} (-1: the lab's default)"
            )
        return Limits(wall_s=req.run_timeout, cpu_s=req.run_timeout + 1.0, memory_bytes=memory)

    async def run(self, owner: str, req: RunCodeRequest) -> RunCodeResponse:
        """One program, for `owner`: its response (SandboxFusion's). BadRequest and QueueFull before it ran."""
        limits = self.limits_for(req)
        files = req.decoded_files()
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
            try:
                pool = self._ready_pool()
            except SandboxUnavailable as e:
                return self._count(
                    account, "sandbox_error", 0.0, RunCodeResponse(status="SandboxError", message=str(e))
                )
            async with account.gate:
                account.waiting -= 1
                waiting = False
                account.running += 1
                try:
                    self.queued.observe(time.perf_counter() - t0)
                    ex = await pool.run(
                        req.code,
                        req.language,
                        stdin=req.stdin or "",
                        files=files,
                        fetch_files=req.fetch_files,
                        limits=limits,
                    )
                except ValueError as e:  # the pool's checks: the language, a file name outside the scratch
                    raise BadRequest(str(e)) from None
                finally:
                    account.running -= 1
        finally:
            if waiting:
                account.waiting -= 1
        return self._answer(account, ex)

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

    def _answer(self, account: _Account, ex: Execution) -> RunCodeResponse:
        if ex.status == "Error":
            return self._count(
                account, "sandbox_error", ex.execution_time, RunCodeResponse(status="SandboxError", message=ex.message)
            )
        result = CommandRunResult(
            status="TimeLimitExceeded" if ex.status == "TimeLimitExceeded" else "Finished",
            execution_time=ex.execution_time,
            return_code=ex.return_code,
            stdout=ex.stdout,
            stderr=ex.stderr,
            truncated=ex.truncated,
        )
        ok = ex.status == "Finished" and ex.return_code == 0
        outcome = "success" if ok else "timeout" if ex.status == "TimeLimitExceeded" else "failed"
        response = RunCodeResponse(
            status="Success" if ok else "Failed",
            message="" if ok else _why(ex),
            run_result=result,
            files={k: base64.b64encode(v).decode() for k, v in ex.files.items()},
        )
        return self._count(account, outcome, ex.execution_time, response)

    def _count(self, account: _Account, outcome: str, seconds: float, response: RunCodeResponse) -> RunCodeResponse:
        account.runs += 1
        account.seconds += seconds
        account.outcomes[outcome] += 1
        self.executions.labels(outcome).inc()
        if outcome != "sandbox_error":
            self.seconds.observe(seconds)
        return response

    # --- views ------------------------------------------------------------------------------------------
    def status(self, owner: str) -> dict:
        """What `%openrl sandbox` and `lab.sandbox.status()` show: the isolation, the pool, and the caller's own
        use (never another user's)."""
        host, why = (self._host, None) if self._host else self.host()
        a = self._accounts.get(owner)
        return {
            "available": host is not None,
            "isolation": host,
            "unavailable": why,
            "pool": self._pool.stats() if self._pool is not None else {"size": self.config.pool_size, "warm": 0},
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

    async def aclose(self) -> None:
        if self._pool is not None:
            with contextlib.suppress(Exception):
                await self._pool.aclose()
            self._pool = None


def _why(ex: Execution) -> str:
    if ex.status == "TimeLimitExceeded":
        return "the program ran past its run_timeout"
    if ex.return_code is not None and ex.return_code < 0:
        return f"the program was killed by signal {-ex.return_code}"
    return f"the program exited with return code {ex.return_code}"


class _PoolCollector:
    """Read at scrape time: the pool's warm and running sandboxes (none until the first request)."""

    def __init__(self, service: SandboxService):
        self.service = service

    def collect(self):
        stats = self.service._pool.stats() if self.service._pool is not None else {}
        warm = GaugeMetricFamily("openrl_sandbox_warm", "Warm sandboxes waiting for a program")
        warm.add_metric([], float(stats.get("warm", 0)))
        running = GaugeMetricFamily("openrl_sandbox_running", "Sandboxed programs running now")
        running.add_metric([], float(stats.get("running", 0)))
        return [warm, running]
