"""A pool of warm sandboxes: each execution gets a fresh one, started ahead of time, so a run pays only for
handing the program over and running it, not for bubblewrap and the interpreter (~60 ms cold on this host;
`benchmarks/sandbox_throughput.py` has the ratios).

Single-use: a sandbox runs exactly one program and is then killed (nothing of one user's run can reach the
next), and the pool starts a replacement in the background. `size` is both how many warm sandboxes it keeps
and how many programs run at once; more concurrent `run` calls wait their turn. The scratch size is fixed when a
sandbox starts, so a run whose `limits.scratch_bytes` differs from the pool's gets a sandbox started for it
(cold); every other limit is applied per run inside the warm one.

`run` raises ValueError for a bad request (`isolation.check_request` names the problem); what the program
does, and a sandbox that fails to start, come back as the Execution.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from openrl_lab.sandbox.isolation import Execution, Limits, Sandbox, check_request, new_sandbox


class SandboxPool:
    def __init__(self, size: int = 4, limits: Limits = Limits()) -> None:  # noqa: B008 - frozen
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 256:
            raise ValueError(f"pool size must be an int in [1, 256], not {size!r}")
        limits.check()
        self.size = size
        self.limits = limits
        self._warm: asyncio.Queue[Sandbox] | None = None
        self._gate: asyncio.Semaphore | None = None
        self._starting: set[asyncio.Task] = set()
        self._running: set[Sandbox] = set()
        self._closed = False
        self._counts = {"started": 0, "finished": 0, "cold": 0, "start_failures": 0, "timeouts": 0, "errors": 0}
        self._last_start_error = ""
        self._fail_streak = 0

    # --- warming -------------------------------------------------------------------------------------------
    def _ensure(self) -> asyncio.Queue[Sandbox]:
        if self._closed:
            raise RuntimeError("the sandbox pool is closed")
        if self._warm is None:
            self._warm = asyncio.Queue()
            self._gate = asyncio.Semaphore(self.size)
        self._refill()
        return self._warm

    def _refill(self) -> None:
        """Start sandboxes in the background until `size` are warm or starting."""
        assert self._warm is not None
        while not self._closed and self._warm.qsize() + len(self._starting) < self.size:
            task = asyncio.ensure_future(self._start_one())
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start_one(self) -> None:
        assert self._warm is not None
        if self._fail_streak:  # the host is failing to start sandboxes: back off rather than spin
            await asyncio.sleep(min(5.0, 0.1 * 2**self._fail_streak))
        sb = new_sandbox(self.limits.scratch_bytes)
        try:
            await sb.start()
        except asyncio.CancelledError:
            await sb.kill()
            raise
        except (RuntimeError, OSError) as e:
            self._counts["start_failures"] += 1
            self._fail_streak = min(self._fail_streak + 1, 6)
            self._last_start_error = str(e)
            await sb.kill()
            return
        self._fail_streak = 0
        self._counts["started"] += 1
        if self._closed:
            await sb.kill()
        else:
            self._warm.put_nowait(sb)

    async def start(self) -> None:
        """Begin warming now (optional: the first `run` does it too)."""
        self._ensure()

    async def _take(self, limits: Limits) -> Sandbox:
        warm = self._ensure()
        if limits.scratch_bytes != self.limits.scratch_bytes:
            self._counts["cold"] += 1
            sb = new_sandbox(limits.scratch_bytes)
            try:
                await sb.start()
            except BaseException:  # cancelled or failed half-way: its process must not outlive this call
                await sb.kill()
                raise
            self._counts["started"] += 1
            return sb
        while True:
            if warm.empty() and not self._starting:
                self._refill()
            if warm.empty() and self._fail_streak >= 3:
                raise RuntimeError(self._last_start_error or "sandboxes fail to start")
            try:
                async with asyncio.timeout(1.0):
                    sb = await warm.get()
            except TimeoutError:
                continue
            self._refill()
            if sb.proc is not None and sb.proc.returncode is None:
                return sb
            await sb.kill()  # died while waiting (killed from outside): take the next

    # --- running -------------------------------------------------------------------------------------------
    async def run(
        self,
        code: str,
        language: str = "python",
        *,
        stdin: str = "",
        files: dict[str, bytes] | None = None,
        fetch_files: Sequence[str] = (),
        limits: Limits | None = None,
    ) -> Execution:
        """Run one program in a fresh sandbox. ValueError for a bad request; everything else is the Execution."""
        limits = self.limits if limits is None else limits
        check_request(code, language, stdin, files, fetch_files, limits)
        self._ensure()
        assert self._gate is not None
        async with self._gate:
            try:
                sb = await self._take(limits)
            except (RuntimeError, OSError) as e:
                self._counts["errors"] += 1
                return Execution("Error", None, "", "", 0.0, message=f"no sandbox could be started: {e}")
            self._running.add(sb)
            try:
                ex = await sb.run(code, language, stdin=stdin, files=files, fetch_files=fetch_files, limits=limits)
            finally:
                self._running.discard(sb)
                await sb.kill()
        self._counts["finished"] += 1
        if ex.status == "TimeLimitExceeded":
            self._counts["timeouts"] += 1
        elif ex.status == "Error":
            self._counts["errors"] += 1
        return ex

    def stats(self) -> dict:
        """{"size", "warm", "running", "starting", "started", "finished", "cold", "timeouts", "errors",
        "start_failures", "last_start_error"}"""
        return {
            "size": self.size,
            "warm": 0 if self._warm is None else self._warm.qsize(),
            "running": len(self._running),
            "starting": len(self._starting),
            **self._counts,
            "last_start_error": self._last_start_error,
        }

    async def aclose(self) -> None:
        """Kill every sandbox, warm, starting or running; the pool serves no more runs."""
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        for task in list(self._starting):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._warm is not None:
            while not self._warm.empty():
                await self._warm.get_nowait().kill()
        deadline = time.monotonic() + 10
        for sb in list(self._running):
            await sb.kill()
        while self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
