"""Sessions end, and their runs leave the device: when a client finishes its session, or stops talking.

A session is alive while its client heartbeats (the tinker SDK does every 10 s) or calls its models and
samplers. It expires after `timeout_s` of silence (default 120 s: the SDK itself warns after 2 minutes of
failed heartbeats), or sooner, `lost_grace_s` after a long poll of its dropped while waiting and nothing
else came from it since: a live SDK re-polls at once and heartbeats every 10 s, a killed one does neither.

Ending a session frees what it holds, in this order: its running and queued kernel calls are cancelled (a
running forward_backward stops at its next micro-batch), its pending futures fail with a message that
says why, and its models' jobs and its samplers are dropped from the kernel (adapter, optimizer state,
snapshots, leases). Checkpoints stay; loading one brings a run back. A job that another live handle
drives (a notebook's named lease, reattached from a new session) stays until that handle ends too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from openrl_lab.gateway.gang import ranks_of
from openrl_lab.gateway.store import job_of
from openrl_lab.settings import settings

if TYPE_CHECKING:
    from openrl_lab.gateway.gateway import Gateway

log = logging.getLogger("openrl_lab.gateway.liveness")
SWEEP_S = 1.0
CANCEL_TIMEOUT_S = 10.0


def session_of(target: str | None) -> str | None:
    """The session a model or sampler id belongs to (`<session>:train:<n>`, `<session>:sample:<n>`)."""
    return target.split(":", 1)[0] if target and ":" in target else None


class Liveness:
    def __init__(self, gw: Gateway, timeout_s: float | None = None, lost_grace_s: float | None = None):
        """`timeout_s`, `lost_grace_s`: default $OPENRL_LAB_SESSION_TIMEOUT_S, $OPENRL_LAB_LOST_POLL_GRACE_S."""
        env = settings()
        timeout_s = env.lab_session_timeout_s if timeout_s is None else timeout_s
        lost_grace_s = env.lab_lost_poll_grace_s if lost_grace_s is None else lost_grace_s
        self.gw = gw
        self.timeout_s = timeout_s
        self.lost_grace_s = lost_grace_s
        self._seen: dict[str, float] = {}  # session -> monotonic time it was last heard from
        self._lost: dict[str, float] = {}  # session -> when one of its long polls was dropped mid-wait
        self._ending: set[str] = set()
        self._next_store_sweep = 0.0

    def touch(self, session_id: str | None) -> None:
        if session_id:
            self._seen[session_id] = time.monotonic()

    def lost_poll(self, session_id: str | None) -> None:
        """A long poll of this session's dropped while it waited: the client may be gone."""
        if session_id:
            self._lost.setdefault(session_id, time.monotonic())

    async def run(self) -> None:
        """The sweep: frees what sessions finished before a restart left, then ends silent sessions."""
        await self._free_finished()
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self._sweep()
            except Exception:  # the next sweep tries again
                log.exception("session sweep failed")

    async def _sweep(self) -> None:
        now = time.monotonic()
        for sid, since in list(self._lost.items()):
            if self._seen.get(sid, 0.0) > since:
                del self._lost[sid]  # it came back
            elif now - since >= self.lost_grace_s:
                del self._lost[sid]
                await self.end(
                    sid,
                    "expired",
                    f"its client went away (a long poll was dropped and nothing came "
                    f"from it for {self.lost_grace_s:.0f} s)",
                )
        if now < self._next_store_sweep:  # silence is judged in the store, at a quarter of the timeout
            return
        self._next_store_sweep = now + self.timeout_s / 4
        cutoff = time.time() - self.timeout_s
        for sid in self.gw.store.silent_sessions(cutoff):
            if now - self._seen.get(sid, 0.0) >= self.timeout_s:
                await self.end(sid, "expired", f"no heartbeat or request for {self.timeout_s:.0f} s")

    async def end(self, session_id: str, status: str, why: str) -> None:
        """Marks the session finished (`status` unless it already was) and frees its runs."""
        if session_id in self._ending:
            return
        self._ending.add(session_id)
        try:
            self.gw.store.finish_session(session_id, status, only_if_open=True)
            self._seen.pop(session_id, None)
            self._lost.pop(session_id, None)
            log.info("session %s %s: %s", session_id, status, why)
            await self.free(session_id, f"session {session_id} {status}: {why}")
        finally:
            self._ending.discard(session_id)

    async def free(self, session_id: str, why: str) -> None:
        gw, store = self.gw, self.gw.store
        models, samplers = store.live_session_models(session_id), store.live_session_samplers(session_id)
        if not models and not samplers:
            return
        live = gw.kernels.is_live
        jobs = [
            (epoch, job_of(m))
            for m in models
            if not store.job_held_elsewhere(job_of(m), session_id)
            for epoch in ranks_of(m)  # every rank of a run on several devices
            if live(epoch)
        ]
        loose = [(s["epoch"], s["sampler_id"]) for s in samplers if live(s["epoch"])]
        for epoch in {e for e, _ in jobs + loose}:  # stop what runs now on each kernel; later calls are refused
            await self._call(epoch, "cancel", ids=[i for e, i in jobs + loose if e == epoch], timeout=CANCEL_TIMEOUT_S)
        message = f"{why}; its runs were freed. Checkpoints stay: load one with create_training_client_from_state"
        for target in [m["model_id"] for m in models] + [s["sampler_id"] for s in samplers]:
            sequencer = gw.sequencers.pop(target, None)
            if sequencer is not None:
                sequencer.clear()
            for rid in store.pending_futures(target):
                gw.fail(rid, message, "user")
        for epoch, job in jobs:
            await self._call(epoch, "drop_job", job_id=job)
            await asyncio.to_thread(gw.kernels.dropped, epoch, job)
        for epoch, sampler in loose:
            await self._call(epoch, "drop_sampler", sampler_id=sampler)
        store.mark_freed(session_id, why)

    async def _call(self, epoch: str, op: str, **kwargs) -> None:
        """A kernel call of the freeing path; a failure is logged (not raised): what a dead kernel held is
        gone with it, and a failed cancel only means the drop waits for the running call."""
        try:
            await asyncio.to_thread(self.gw.kernels.get(epoch).client.call, op, **kwargs)
        except Exception as e:  # noqa: BLE001
            log.warning("%s %s: %s", op, kwargs, e)

    async def _free_finished(self) -> None:
        for sid, how in self.gw.store.finished_sessions_holding_runs():
            await self.free(sid, f"session {sid} {how}")
