"""`TimeSliceOrchestratorClient`: a job's handle on the orchestrator (gRPC).

    orchestrator = TimeSliceOrchestratorClient(target="localhost:50051")

    @orchestrator.on_accelerators(group_id="trainer-group")
    def train_phase(model, trajectories): ...

    with orchestrator.on_accelerators(group_id="sampler-group", kind="sample") as s:
        print(s.waited_s, s.restored)

Each call of `train_phase` is one phase: it waits for a slice of the group, runs, and releases it (also
when it raises). A job that keeps state on the devices between phases registers how to move it:

    orchestrator.register("trainer-group", on_evict=arena.offload, on_restore=arena.restore)

and is then asked to evict only when another job waits for the group (lazy yield): `on_evict` runs after
its phase (or, if the other job arrives while this one is between phases, on the client's event thread);
`on_restore` runs before its next phase if it was evicted meanwhile. Both must be idempotent. An
`on_evict` that takes one argument gets the request (a `LeaseEvent`; `waiter_same_process` says whether
the waiting job runs in this process, for clients that name their `instance`).

Identity and names: the API key comes from `api_key=`, else $OPENRL_LAB_API_KEY, else $TINKER_API_KEY,
else the local control plane's connection file (`openrl_lab.home.find_api_key`); the job name (the lease
name, reattachable after a restart) from `job=`, else $OPENRL_LAB_JOB, else host-pid. Unary calls are
retried while the service is unavailable (for up to `retry_timeout_s`); a background session heartbeats the
client's leases and held slices. With an orchestrator on this machine, `acquire`, `release` and eviction
reports go on its hand-off lane (`lane.py`: a loopback socket, one thread at each end; a hand-off takes
about a third of its time over gRPC), and over gRPC when there is none or it fails; `lane=False` keeps
them on gRPC.

`ServiceOrchestratorClient`, for services (the kernels), adds what only the orchestrator's service identities
may do: leases owned by the user they act for, and a process identity whose new incarnation drops what a dead
one left on the devices.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from openrl_lab.home import find_api_key
from openrl_lab.orchestrator import orchestrator_pb2 as pb
from openrl_lab.orchestrator import orchestrator_pb2_grpc as pb_grpc
from openrl_lab.orchestrator.errors import (
    BY_CODE,
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    OrchestratorError,
    Unavailable,
)
from openrl_lab.orchestrator.lane import (
    ACQUIRE,
    RELEASE,
    REPORT_EVICTED,
    LaneClient,
    LaneClosed,
    lane_target,
)
from openrl_lab.orchestrator.types import (
    Grant,
    GroupInfo,
    GroupStatus,
    LeaseEvent,
    LeaseInfo,
    ReleaseResult,
    Slice,
    SliceRecord,
    Timeline,
    from_proto,
)
from openrl_lab.settings import settings
from openrl_lab.sockets import is_loopback_host

log = logging.getLogger(__name__)

DEFAULT_TARGET = "localhost:50051"
LANE_RETRY_S = 1.0  # after the lane failed (or could not be found), ask for it again at most this often


@dataclass
class _Hooks:
    on_evict: Callable[..., Any] | None
    on_restore: Callable[[], Any] | None
    evict_takes_request: bool = False


def _takes_an_argument(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it as documented, without one
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _error(e: grpc.RpcError) -> OrchestratorError:
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    cls = BY_CODE.get(code.name, OrchestratorError)
    err = cls(e.details() if callable(getattr(e, "details", None)) else str(e))
    err.grpc_code = code
    return err


def _default_job() -> str:
    job = settings().lab_job or f"{socket.gethostname()}-{os.getpid()}"
    job = re.sub(r"[^A-Za-z0-9._:@/+-]", "-", job).lstrip("._:@/+-")[:128]
    return job or f"job-{os.getpid()}"


class TimeSliceOrchestratorClient:
    """A job's handle on the orchestrator: llm-d's calls (`lease`, `acquire`, `release`, `on_accelerators`,
    `register`, `close`) and what the notebook layer reads (groups, status, timeline)."""

    # what ServiceOrchestratorClient sets; a user's client acts for its key's user, as no named process
    on_behalf_of: str | None = None
    instance: str | None = None
    incarnation: str | None = None

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        job: str | None = None,
        weight: float | None = None,
        quota_s: float | None = None,
        ttl_s: float | None = None,
        priority: str | None = None,
        retry_timeout_s: float = 30.0,
        heartbeat_interval_s: float | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        lane: bool = True,
    ):
        """`tls`: the orchestrator serves TLS, its certificate checked against `root_certificates` (PEM; None:
        the system's roots). `lane`: use the hand-off lane when the orchestrator offers one (`lane.py`).
        `weight`, `quota_s`, `ttl_s`, `priority`: what this client's leases get where a call names none
        (`priority`: interactive | batch; None: the orchestrator's default, batch)."""
        self.target = target
        self.api_key = find_api_key(api_key)
        self.job = job or _default_job()
        self.weight, self.quota_s, self.ttl_s, self.priority = weight, quota_s, ttl_s, priority
        self.retry_timeout_s = retry_timeout_s
        self._hb_override = heartbeat_interval_s
        md = [("x-api-key", self.api_key)] if self.api_key else []
        if self.instance and self.incarnation:
            md += [("x-openrl-instance", self.instance), ("x-openrl-incarnation", self.incarnation)]
        self._md = tuple(md)
        # Reconnect soon after the control plane comes back (grpc's default backoff starts at 1 s, up to 120 s).
        options = [
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self._channel = (
            grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=options)
            if tls
            else grpc.insecure_channel(target, options=options)
        )
        self._stub = pb_grpc.TimeSliceOrchestratorStub(self._channel)
        self._lock = threading.RLock()
        self._leases: dict[tuple[str, str], LeaseInfo] = {}  # (group_id as asked, lease name) -> lease
        self._hooks: dict[tuple[str, str], _Hooks] = {}
        self._held: dict[str, Slice] = {}  # slice_id -> slice this client holds
        self._evict_locks: dict[str, threading.Lock] = {}
        self._handled_switches: set[tuple[str, int]] = set()
        self._local = threading.local()
        self._closed = threading.Event()
        self._hb_wake = threading.Event()
        self._session: threading.Thread | None = None
        self._session_call = None
        # The hand-off lane (`lane.py`): Acquire, Release and ReportEvicted on a loopback socket, found on first
        # use; only for an orchestrator on this machine.
        self._lane_host = lane_target(target) if lane else None
        self._lane: LaneClient | None = None
        self._lane_next_look = 0.0
        self._lane_unsupported = False

    # --- plumbing ---------------------------------------------------------------------------------
    def _rpc(self, name: str, request, timeout: float | None = None, retry: bool = True):
        method = getattr(self._stub, name)
        return self._with_retries(lambda: method(request, metadata=self._md, timeout=timeout), retry)

    def _acquire_rpc(self, request):
        """Acquire as a future, so an interrupt (Ctrl-C in a notebook) cancels the wait on the server too."""

        def once():
            fut = self._stub.Acquire.future(request, metadata=self._md)
            try:
                return fut.result()
            except grpc.RpcError:
                raise
            except BaseException:
                fut.cancel()
                raise

        return self._with_retries(once)

    def _fast(self, kind: int, name: str, request):
        """Acquire, Release or ReportEvicted (the calls a hand-off waits on): on the lane if there is one; over
        gRPC if not, or if the lane failed (nothing is then known to have happened)."""
        lane = self._lane_now()
        if lane is not None:
            try:
                return lane.call(kind, request)
            except LaneClosed as e:
                log.debug("orchestrator: the hand-off lane failed (%s); over gRPC", e)
                with self._lock:
                    if self._lane is lane:
                        self._lane = None
                lane.close()
            except OrchestratorError as e:
                e.grpc_code = getattr(grpc.StatusCode, e.code, grpc.StatusCode.UNKNOWN)
                raise
        if name == "Acquire":
            return self._acquire_rpc(request)
        return self._rpc(name, request)

    def lane_address(self) -> tuple[str, int] | None:
        """Where this client's hand-off lane is (None: none offered to it, e.g. the orchestrator is on another
        machine, or `lane=False`): the doctor checks it can be reached."""
        lane = self._lane_now()
        return (lane.host, lane.port) if lane is not None else None

    def _lane_now(self) -> LaneClient | None:
        if self._lane_host is None:
            return None
        with self._lock:
            if self._lane is not None or self._lane_unsupported or self._closed.is_set():
                return self._lane
            now = time.monotonic()
            if now < self._lane_next_look:
                return None
            self._lane_next_look = now + LANE_RETRY_S
        try:
            r = self._stub.GetLane(pb.GetLaneRequest(), metadata=self._md, timeout=5)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # an orchestrator from before the lane
                self._lane_unsupported = True
            return None
        if not r.port or not is_loopback_host(r.host):
            return None
        lane = LaneClient(r.host, r.port, r.token)
        with self._lock:
            if self._lane is None and not self._closed.is_set():
                self._lane = lane
                return lane
            current = self._lane
        lane.close()
        return current

    def _with_retries(self, call: Callable[[], Any], retry: bool = True):
        """`call()`; only UNAVAILABLE is retried (the control plane restarting), with backoff, within
        `retry_timeout_s`, while the client is open. Other failures become this package's errors."""
        deadline = time.monotonic() + (self.retry_timeout_s if retry else 0.0)
        delay = 0.05
        while True:
            try:
                return call()
            except grpc.RpcError as e:
                if (
                    e.code() != grpc.StatusCode.UNAVAILABLE
                    or time.monotonic() + delay >= deadline
                    or self._closed.is_set()
                ):
                    raise _error(e) from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _name(self, lease: str | None) -> str:
        return lease or self.job

    # --- groups and status ------------------------------------------------------------------------
    def list_groups(self) -> list[GroupInfo]:
        return [from_proto(GroupInfo, g) for g in self._rpc("ListGroups", pb.ListGroupsRequest()).groups]

    def get_status(self, group_id: str | None = None, *, window_s: float = 60.0) -> GroupStatus | list[GroupStatus]:
        """One group's status (holder, queue, resident job, duty cycle over `window_s`), or every group's."""
        r = self._rpc("GetStatus", pb.GetStatusRequest(group_id=group_id or "", window_s=window_s))
        out = [from_proto(GroupStatus, g) for g in r.groups]
        return out[0] if group_id else out

    def timeline(self, group_id: str, *, since: float = 0.0, since_seq: int = 0, limit: int = 1000) -> Timeline:
        r = self._rpc(
            "GetTimeline", pb.GetTimelineRequest(group_id=group_id, since=since, since_seq=since_seq, limit=limit)
        )
        return from_proto(Timeline, r)

    def watch_timeline(self, group_id: str, *, since_seq: int = 0) -> Iterator[SliceRecord]:
        """Slice records of a group as they change (a slice appears when granted and again when it ends).
        Runs until the iterator is closed or the client is."""
        call = self._stub.WatchTimeline(
            pb.WatchTimelineRequest(group_id=group_id, since_seq=since_seq), metadata=self._md
        )
        try:
            for rec in call:
                yield from_proto(SliceRecord, rec)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise _error(e) from None
        finally:
            call.cancel()

    # --- leases -----------------------------------------------------------------------------------
    def lease(
        self,
        group_id: str,
        name: str | None = None,
        *,
        weight: float | None = None,
        quota_s: float | None = None,
        ttl_s: float | None = None,
        priority: str | None = None,
    ) -> LeaseInfo:
        """Creates this job's lease on the group, or reattaches to it (same user, group and name). `priority`:
        interactive (its phases go before waiting batch phases, within the group's interactive share) or
        batch."""
        name = self._name(name)
        kw = {
            k: v
            for k, v in (
                ("weight", weight if weight is not None else self.weight),
                ("quota_s", quota_s if quota_s is not None else self.quota_s),
                ("ttl_s", ttl_s if ttl_s is not None else self.ttl_s),
                ("priority", priority if priority is not None else self.priority),
            )
            if v is not None
        }
        req = pb.CreateLeaseRequest(group_id=group_id, name=name, on_behalf_of=self.on_behalf_of or "", **kw)
        info = from_proto(LeaseInfo, self._rpc("CreateLease", req))
        with self._lock:
            self._leases[(group_id, name)] = info
        self._ensure_session()
        return info

    def _lease_for(self, group_id: str, name: str) -> LeaseInfo:
        with self._lock:
            info = self._leases.get((group_id, name))
        return info if info is not None else self.lease(group_id, name)

    def leases(self, group_id: str | None = None) -> list[LeaseInfo]:
        return [
            from_proto(LeaseInfo, L)
            for L in self._rpc("ListLeases", pb.ListLeasesRequest(group_id=group_id or "")).leases
        ]

    def close_lease(self, group_id: str, lease: str | None = None) -> None:
        name = self._name(lease)
        info = self._lease_for(group_id, name)
        self._rpc("CloseLease", pb.CloseLeaseRequest(lease_id=info.lease_id))
        with self._lock:
            self._leases.pop((group_id, name), None)

    def register(
        self,
        group_id: str,
        *,
        on_evict: Callable[..., Any] | None = None,
        on_restore: Callable[[], Any] | None = None,
        lease: str | None = None,
    ) -> LeaseInfo:
        """How this job's state on the group's devices is moved off (`on_evict`) and back (`on_restore`). With
        an `on_evict`, the job keeps its state on the devices between phases until another job needs them.
        An `on_evict` that takes an argument is passed the evict request (a `LeaseEvent`)."""
        name = self._name(lease)
        info = self._lease_for(group_id, name)
        takes = on_evict is not None and _takes_an_argument(on_evict)
        with self._lock:  # by the group's own id, whichever alias names it
            self._hooks[(info.group_id, name)] = _Hooks(on_evict, on_restore, takes)
        return info

    def _hooks_for(self, lease_id: str) -> _Hooks | None:
        with self._lock:
            for info in self._leases.values():
                if info.lease_id == lease_id:
                    return self._hooks.get((info.group_id, info.name))
        return None

    def canonical_group(self, group_id: str, lease: str | None = None) -> str:
        """The group's own id (`group_id` may be an alias), from the job's lease on it."""
        return self._lease_for(group_id, self._name(lease)).group_id

    # --- slices -----------------------------------------------------------------------------------
    def acquire(
        self,
        group_id: str,
        *,
        kind: str = "phase",
        timeout: float | None = None,
        lease: str | None = None,
        gang: str = "",
        gang_size: int = 0,
    ) -> Slice:
        """Waits for a slice of the group (at most `timeout` s: DeadlineExceeded). The slice says how long it
        waited and whether the job's state had to be restored (`restored`, via the registered `on_restore`).
        `gang`, `gang_size`: this is one rank's slice of a gang phase of `gang_size` ranks on as many groups,
        granted all at once with the others that name the same key (see the scheduler); a gang phase that cannot
        be granted (a rank stopped waiting, or not all asked within the orchestrator's `gang_assemble_s`)
        raises FailedPrecondition naming the gang. `on_accelerators_gang` does this for a script."""
        name = self._name(lease)
        for attempt in (0, 1):
            info = self._lease_for(group_id, name)
            req = pb.AcquireRequest(lease_id=info.lease_id, kind=kind, gang=gang, gang_size=gang_size)
            if timeout is not None:
                req.timeout_s = timeout
            try:
                grant = from_proto(Grant, self._fast(ACQUIRE, "Acquire", req))
                break
            except NotFound:
                if attempt:
                    raise
                with self._lock:  # the lease expired or the orchestrator lost it: reattach by name once
                    self._leases.pop((group_id, name), None)
        s = Slice(grant=grant)
        with self._lock:
            self._held[s.slice_id] = s
        with self._lock:
            hooks = self._hooks.get((grant.group_id, name))
        if grant.must_restore and hooks is not None and hooks.on_restore is not None:
            t0 = time.perf_counter()
            try:
                hooks.on_restore()
            except BaseException as e:
                self.release(s, error=f"restore failed: {type(e).__name__}: {e}")
                raise
            s.restored, s.restore_s = True, time.perf_counter() - t0
        return s

    def release(self, slice: Slice | str, *, error: str | None = None) -> ReleaseResult:
        """Ends the slice. If another job waits and this job keeps state on the devices, its `on_evict` runs
        here (result: evict_requested=True, evict_s)."""
        with self._lock:
            s = self._held.get(slice if isinstance(slice, str) else slice.slice_id)
        if s is None:
            if isinstance(slice, str):
                s = Slice(
                    Grant(
                        slice_id=slice,
                        lease_id="",
                        group_id="",
                        job="",
                        kind="",
                        waited_s=0.0,
                        must_restore=False,
                        granted_at=0.0,
                    )
                )
            else:
                s = slice
        hooks = self._hooks_for(s.lease_id)
        keep = hooks is not None and hooks.on_evict is not None
        try:
            r = self._fast(
                RELEASE,
                "Release",
                pb.ReleaseRequest(
                    slice_id=s.slice_id,
                    keep_resident=keep,
                    restore_s=s.restore_s,
                    outcome="failed" if error else "ok",
                    error=error or "",
                ),
            )
        finally:
            with self._lock:
                self._held.pop(s.slice_id, None)
            s.released = True
        result = from_proto(ReleaseResult, r)
        if result.evict_requested:
            evict_s = self._evict(
                LeaseEvent(
                    type="evict",
                    lease_id=s.lease_id,
                    group_id=s.group_id,
                    switch_id=result.switch_id,
                    waiter_same_process=result.waiter_same_process,
                )
            )
            result = dataclasses.replace(result, evict_s=evict_s)
        s.release = result
        return s.release

    def report_evicted(
        self, lease_id: str, switch_id: int = 0, evict_s: float = 0.0, *, failed: bool = False, error: str = ""
    ) -> None:
        """For jobs that move their state themselves instead of registering hooks."""
        self._fast(
            REPORT_EVICTED,
            "ReportEvicted",
            pb.ReportEvictedRequest(
                lease_id=lease_id, switch_id=switch_id, evict_s=evict_s, failed=failed, error=error
            ),
        )

    def drop_residency(self, group_id: str, lease: str | None = None, *, kept_on_host: bool = False) -> bool:
        """Tells the orchestrator this job's state is no longer on the group's devices (the job moved it itself,
        `kept_on_host`, or freed it): no other job waits for its eviction. `close()` does this for every
        job with an `on_evict` hook. Returns whether the state was resident."""
        info = self._lease_for(group_id, self._name(lease))
        r = self._rpc("DropResidency", pb.DropResidencyRequest(lease_id=info.lease_id, kept_on_host=kept_on_host))
        return r.was_resident

    def _evict(self, ev: LeaseEvent) -> float:
        lease_id, switch_id = ev.lease_id, ev.switch_id
        with self._lock:
            lock = self._evict_locks.setdefault(lease_id, threading.Lock())
        with lock:
            with self._lock:
                if (lease_id, switch_id) in self._handled_switches:
                    return 0.0
                if len(self._handled_switches) > 100000:
                    self._handled_switches.clear()  # switch ids only grow: old ones never come back
                self._handled_switches.add((lease_id, switch_id))
            hooks = self._hooks_for(lease_id)
            t0 = time.perf_counter()
            failed, err = False, ""
            try:
                if hooks is not None and hooks.on_evict is not None:
                    hooks.on_evict(ev) if hooks.evict_takes_request else hooks.on_evict()
            except Exception as e:  # noqa: BLE001 - reported: the orchestrator treats the state as lost
                failed, err = True, f"{type(e).__name__}: {e}"
                log.error("orchestrator: evicting lease %s failed: %s", lease_id, err)
            evict_s = time.perf_counter() - t0
            try:
                self.report_evicted(lease_id, switch_id, evict_s, failed=failed, error=err)
            except FailedPrecondition as e:  # already given up on by the orchestrator
                log.warning("orchestrator: %s", e)
            return evict_s

    def on_accelerators(
        self,
        group_id: str,
        *,
        kind: str | None = None,
        timeout: float | None = None,
        lease: str | None = None,
        gang: str = "",
        gang_size: int = 0,
    ) -> _Phase:
        """A phase on the group: a decorator (`kind` defaults to the function's name) or a context manager
        (yields the `Slice`). The slice is released when the phase ends, also when it raises. Nested phases
        of the same job and group in one thread run in the outer phase's slice. `gang`, `gang_size`: see
        `acquire` (one rank's slice of a gang phase)."""
        return _Phase(self, group_id, kind, timeout, lease, gang, gang_size)

    @contextlib.contextmanager
    def on_accelerators_gang(
        self,
        group_ids: Sequence[str],
        *,
        kind: str = "phase",
        timeout: float | None = None,
        lease: str | None = None,
    ) -> Iterator[list[Slice]]:
        """A phase on several groups at once (a gang: one slice of each, granted together, never some of them):
        acquires them concurrently under one fresh gang key and yields the slices in the order of `group_ids`;
        all are released when the phase ends, also when it raises. The job's lease on each group is named
        `lease` (default: the client's job). A gang phase that cannot be granted raises the orchestrator's
        error (FailedPrecondition naming the gang; DeadlineExceeded after `timeout`)."""
        groups = list(group_ids)
        if not groups or len(set(groups)) != len(groups):
            raise ValueError(f"a gang phase needs distinct groups, got {groups!r}")
        if len(groups) == 1:
            s = self.acquire(groups[0], kind=kind, timeout=timeout, lease=lease)
            try:
                yield [s]
            except BaseException as e:
                _Phase(self, groups[0], kind, timeout, lease)._release(s, type(e), e)
                raise
            _Phase(self, groups[0], kind, timeout, lease)._release(s, None, None)
            return
        for g in groups:  # the leases first, one at a time (each a call of its own)
            self._lease_for(g, self._name(lease))
        key = f"{self._name(lease)}/gang-{uuid.uuid4().hex[:16]}"
        results: list[Slice | BaseException | None] = [None] * len(groups)

        def one(i: int) -> None:
            try:
                results[i] = self.acquire(
                    groups[i], kind=kind, timeout=timeout, lease=lease, gang=key, gang_size=len(groups)
                )
            except BaseException as e:  # noqa: BLE001 - raised below, after every rank's acquire ended
                results[i] = e

        threads = [
            threading.Thread(target=one, args=(i,), name=f"gang-acquire-{g}", daemon=True) for i, g in enumerate(groups)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        slices = [r for r in results if isinstance(r, Slice)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for s in slices:  # all or nothing: only a restore hook's failure leaves some granted
                _Phase(self, s.group_id, kind, timeout, lease)._release(s, type(errors[0]), errors[0])
            # the rank's own error first (its timeout, say), not its peers' "the gang phase failed"
            own = [e for e in errors if not (isinstance(e, FailedPrecondition) and f"gang {key!r}" in str(e))]
            raise (own or errors)[0]
        try:
            yield slices  # type: ignore[misc] - all are slices here
        except BaseException as e:
            for s in slices:
                _Phase(self, s.group_id, kind, timeout, lease)._release(s, type(e), e)
            raise
        for s in slices:
            _Phase(self, s.group_id, kind, timeout, lease)._release(s, None, None)

    def heartbeat(self) -> list[LeaseEvent]:
        """One explicit heartbeat (the background session sends them anyway)."""
        r = self._rpc("Heartbeat", self._heartbeat_msg())
        return [from_proto(LeaseEvent, e) for e in r.events]

    # --- the session: heartbeats up, events down --------------------------------------------------
    def _heartbeat_msg(self) -> pb.HeartbeatRequest:
        with self._lock:
            return pb.HeartbeatRequest(
                lease_ids=sorted({i.lease_id for i in self._leases.values()}), slice_ids=sorted(self._held)
            )

    def _interval(self) -> float:
        if self._hb_override:
            return self._hb_override
        with self._lock:
            return min(
                (i.heartbeat_interval_s for i in self._leases.values() if i.heartbeat_interval_s > 0), default=2.5
            )

    def _ensure_session(self) -> None:
        with self._lock:
            self._hb_wake.set()  # send the new lease set now
            if self._session is None and not self._closed.is_set():
                self._session = threading.Thread(
                    target=self._session_loop, name="orchestrator-client-session", daemon=True
                )
                self._session.start()

    def _session_loop(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            stop = threading.Event()

            def beats(stop=stop):
                while not stop.is_set() and not self._closed.is_set():
                    self._hb_wake.clear()
                    yield self._heartbeat_msg()
                    self._hb_wake.wait(self._interval())

            try:
                call = self._stub.Session(beats(), metadata=self._md)
                self._session_call = call
                for ev in call:
                    backoff = 0.1
                    self._on_event(from_proto(LeaseEvent, ev))
            except grpc.RpcError as e:
                if not self._closed.is_set() and e.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.CANCELLED,
                ):
                    log.warning("orchestrator session: %s: %s", e.code().name, e.details())
            except Exception:  # keep the session alive whatever one event did
                log.exception("orchestrator session failed")
            finally:
                stop.set()
                self._hb_wake.set()
            self._closed.wait(backoff)
            backoff = min(backoff * 2, 2.0)

    def _on_event(self, ev: LeaseEvent) -> None:
        if ev.type == "evict":
            threading.Thread(target=self._evict, args=(ev,), name="orchestrator-evict", daemon=True).start()
        elif ev.type == "revoked":
            log.warning("orchestrator: %s", ev.message)
            with self._lock:
                self._held.pop(ev.slice_id, None)
        elif ev.type == "unknown_lease":
            with self._lock:
                for key in [k for k, i in self._leases.items() if i.lease_id == ev.lease_id]:
                    del self._leases[key]

    # --- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Releases the slices this client still holds and stops its session (its leases stay, until their TTL,
        for a later client to reattach)."""
        if self._closed.is_set():
            return
        with self._lock:
            held = list(self._held.values())
            stateful = [
                info.lease_id
                for info in self._leases.values()
                if (h := self._hooks.get((info.group_id, info.name))) is not None and h.on_evict is not None
            ]
        # No retries here: a client closing while the orchestrator is down must not hang.
        for s in held:  # its state goes with the client: nothing to evict
            try:
                self._rpc(
                    "Release",
                    pb.ReleaseRequest(
                        slice_id=s.slice_id,
                        restore_s=s.restore_s,
                        outcome="failed",
                        error="the client closed while holding the slice",
                    ),
                    timeout=5,
                    retry=False,
                )
            except OrchestratorError as e:
                log.warning("orchestrator: releasing %s at close: %s", s.slice_id, e)
        for lease_id in stateful:  # what this client kept on the devices goes with it
            try:
                self._rpc("DropResidency", pb.DropResidencyRequest(lease_id=lease_id), timeout=5, retry=False)
            except OrchestratorError as e:
                log.debug("orchestrator: dropping residency of %s at close: %s", lease_id, e)
        self._closed.set()
        self._hb_wake.set()
        with self._lock:
            lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()
        if self._session_call is not None:
            self._session_call.cancel()
        if self._session is not None:
            self._session.join(timeout=5)
        self._channel.close()

    def __enter__(self) -> TimeSliceOrchestratorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TimeSliceOrchestratorClient(target={self.target!r}, job={self.job!r})"


class ServiceOrchestratorClient(TimeSliceOrchestratorClient):
    """The client of a service (a kernel) that drives leases for users. `on_behalf_of=user`: the leases this
    client creates are owned by that user (the caller's key must be one of the orchestrator's service
    identities, else the orchestrator refuses). `instance=` names the process that holds the state, stable
    across its restarts, and `incarnation=` this run of it (default: fresh), so that a new incarnation can
    `drop_stale_residency()` what a dead one left behind. Everything else is TimeSliceOrchestratorClient's."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        on_behalf_of: str | None = None,
        instance: str | None = None,
        incarnation: str | None = None,
        **kwargs: Any,
    ):
        self.on_behalf_of = on_behalf_of
        self.instance = instance
        self.incarnation = (incarnation or uuid.uuid4().hex) if instance else None
        super().__init__(target, **kwargs)

    def drop_stale_residency(self) -> tuple[int, int]:
        """This process replaces every earlier one that ran as the same `instance` (which must be unique to one
        live process): the state they left on the devices is gone and their slices are revoked, so no job waits
        for them to evict. Touches only leases this client's user drives. Returns (leases dropped, slices
        revoked)."""
        if not self.instance:
            raise ValueError("drop_stale_residency needs a client made with instance=<this process's name>")
        assert self.incarnation is not None
        r = self._rpc(
            "DropStaleResidency", pb.DropStaleResidencyRequest(instance=self.instance, incarnation=self.incarnation)
        )
        return r.dropped, r.revoked


class _Phase:
    """One phase on a group: reusable, as a decorator or a context manager, from any number of threads."""

    def __init__(
        self,
        client: TimeSliceOrchestratorClient,
        group_id: str,
        kind: str | None,
        timeout: float | None,
        lease: str | None,
        gang: str = "",
        gang_size: int = 0,
    ):
        self.client, self.group_id, self.kind, self.timeout, self.lease = client, group_id, kind, timeout, lease
        self.gang, self.gang_size = gang, gang_size

    def _stack(self) -> tuple[dict, list]:
        local = self.client._local
        if not hasattr(local, "held"):
            local.held, local.keys = {}, []
        return local.held, local.keys

    def __enter__(self) -> Slice:
        name = self.client._name(self.lease)
        key = (self.client.canonical_group(self.group_id, name), name)
        held, keys = self._stack()
        if key in held:
            held[key][1] += 1
        else:
            s = self.client.acquire(
                self.group_id,
                kind=self.kind or "phase",
                timeout=self.timeout,
                lease=self.lease,
                gang=self.gang,
                gang_size=self.gang_size,
            )
            held[key] = [s, 1]
        keys.append(key)
        return held[key][0]

    def __exit__(self, et, ev, tb) -> bool:
        held, keys = self._stack()
        key = keys.pop()  # phases nest: the innermost open one of this thread ends
        entry = held[key]
        entry[1] -= 1
        if entry[1] == 0:
            del held[key]
            self._release(entry[0], et, ev)
        return False

    def _release(self, s: Slice, et, ev) -> None:
        try:
            self.client.release(s, error=f"{et.__name__}: {ev}" if et is not None else None)
        except (FailedPrecondition, NotFound) as e:  # revoked while the phase ran (its holder timed out), or
            log.warning("orchestrator: %s", e)  # the orchestrator restarted meanwhile: the phase is done anyway
        except (OrchestratorError, DeadlineExceeded, Unavailable) as e:
            if et is None:
                raise
            log.warning("orchestrator: releasing after a failed phase: %s", e)

    def __call__(self, fn):
        kind = self.kind or getattr(fn, "__name__", "phase")
        phase = _Phase(self.client, self.group_id, kind, self.timeout, self.lease, self.gang, self.gang_size)
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args, **kwargs):
                s = await asyncio.to_thread(
                    self.client.acquire,
                    self.group_id,
                    kind=kind,
                    timeout=self.timeout,
                    lease=self.lease,
                    gang=self.gang,
                    gang_size=self.gang_size,
                )
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as e:
                    await asyncio.to_thread(phase._release, s, type(e), e)
                    raise
                await asyncio.to_thread(phase._release, s, None, None)
                return result

            return run_async

        @functools.wraps(fn)
        def run(*args, **kwargs):
            with phase:
                return fn(*args, **kwargs)

        return run
