"""The orchestrator's gRPC service: a thin layer over one `Scheduler` (grpcio, thread-pool server).

    server = serve_orchestrator(home / "orchestrator.db", port=50051, authenticate=store.user_for_key)
    ...
    server.stop(grace=1)   # also closes the scheduler and flushes its SQLite state

Identity: each call's `x-api-key` metadata (or `authorization: Bearer <key>`) goes through
`authenticate(key) -> user | None`; without an `authenticate` callable every caller is the local user
(bind loopback only then). Users in `service_users` (the kernels' identity) may create leases
`on_behalf_of` another user; anyone else asking is PERMISSION_DENIED. Optional `x-openrl-instance` /
`x-openrl-incarnation` metadata name the calling process (see `Scheduler`). Scheduler errors become status codes
with their message (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED,
UNAUTHENTICATED); anything else is INTERNAL, logged, and the service keeps serving.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from pathlib import Path

import grpc

from openrl_lab.orchestrator import orchestrator_pb2 as pb
from openrl_lab.orchestrator import orchestrator_pb2_grpc as pb_grpc
from openrl_lab.orchestrator.config import OrchestratorConfig
from openrl_lab.orchestrator.errors import InvalidArgument, OrchestratorError, Unauthenticated
from openrl_lab.orchestrator.scheduler import Scheduler
from openrl_lab.orchestrator.types import to_proto

log = logging.getLogger(__name__)

DEFAULT_PORT = 50051
LOCAL_USER = "local"
API_KEY_METADATA = "x-api-key"
INSTANCE_METADATA = "x-openrl-instance"
INCARNATION_METADATA = "x-openrl-incarnation"


def _handle(fn):
    """Runs an RPC; an OrchestratorError becomes its status code, anything else INTERNAL (logged)."""

    @functools.wraps(fn)
    def unary(self, request, context):
        try:
            return fn(self, request, context)
        except OrchestratorError as e:
            err = e
        except Exception as e:  # a bug in one call must not take the service down
            log.exception("orchestrator: %s failed", fn.__name__)
            err = OrchestratorError(f"internal error in {fn.__name__}: {type(e).__name__}: {e}")
            err.code = "INTERNAL"
        context.abort(getattr(grpc.StatusCode, err.code, grpc.StatusCode.UNKNOWN), str(err))
        return None

    return unary


def _handle_stream(fn):
    @functools.wraps(fn)
    def stream(self, request, context):
        try:
            yield from fn(self, request, context)
            return
        except OrchestratorError as e:
            err = e
        except Exception as e:
            log.exception("orchestrator: %s failed", fn.__name__)
            err = OrchestratorError(f"internal error in {fn.__name__}: {type(e).__name__}: {e}")
            err.code = "INTERNAL"
        context.abort(getattr(grpc.StatusCode, err.code, grpc.StatusCode.UNKNOWN), str(err))

    return stream


class OrchestratorServicer(pb_grpc.TimeSliceOrchestratorServicer):
    def __init__(self, scheduler: Scheduler, authenticate: Callable[[str], str | None] | None = None):
        self.s = scheduler
        self.authenticate = authenticate
        self.lane = None  # the LaneServer, once serve_orchestrator started one

    @staticmethod
    def _process(context) -> tuple[str, str]:
        """(instance, incarnation) the caller names itself by, or empty strings."""
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        return md.get(INSTANCE_METADATA, "")[:256], md.get(INCARNATION_METADATA, "")[:256]

    def _user(self, context) -> str:
        return self.lane_user(self._key(context))

    @staticmethod
    def _key(context) -> str | None:
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
        key = md.get(API_KEY_METADATA)
        if key is None and md.get("authorization", "").lower().startswith("bearer "):
            key = md["authorization"][7:].strip()
        return key

    def lane_user(self, key: str | None) -> str:
        """The user of an API key (every gRPC call's and every lane request's)."""
        if self.authenticate is None:
            return LOCAL_USER
        if not key:
            raise Unauthenticated(
                f"missing API key: send it as `{API_KEY_METADATA}` metadata "
                "(TimeSliceOrchestratorClient(api_key=...) or $OPENRL_LAB_API_KEY)"
            )
        user = self.authenticate(key)
        if not user:
            raise Unauthenticated("API key not recognized")
        return user

    # --- groups and status ------------------------------------------------------------------------
    @_handle
    def ListGroups(self, request, context):
        self._user(context)
        return pb.ListGroupsResponse(groups=[to_proto(pb.GroupInfo, g) for g in self.s.list_groups()])

    @_handle
    def GetStatus(self, request, context):
        user = self._user(context)
        window = request.window_s if request.window_s > 0 else 60.0
        groups = self.s.status(user, request.group_id or None, window)
        return pb.GetStatusResponse(groups=[to_proto(pb.GroupStatus, g) for g in groups], now=self.s.clock())

    # --- leases -----------------------------------------------------------------------------------
    @_handle
    def CreateLease(self, request, context):
        user = self._user(context)
        opt = lambda f: getattr(request, f) if request.HasField(f) else None  # noqa: E731
        info = self.s.create_lease(
            user,
            request.group_id,
            request.name,
            opt("weight"),
            opt("quota_s"),
            opt("ttl_s"),
            on_behalf_of=request.on_behalf_of or None,
            process=self._process(context),
            priority=opt("priority"),
        )
        return to_proto(pb.Lease, info)

    @_handle
    def GetLease(self, request, context):
        return to_proto(pb.Lease, self.s.get_lease(self._user(context), request.lease_id))

    @_handle
    def ListLeases(self, request, context):
        leases = self.s.list_leases(self._user(context), request.group_id or None)
        return pb.ListLeasesResponse(leases=[to_proto(pb.Lease, L) for L in leases])

    @_handle
    def CloseLease(self, request, context):
        self.s.close_lease(self._user(context), request.lease_id)
        return pb.CloseLeaseResponse()

    # --- slices -----------------------------------------------------------------------------------
    # Acquire, Release and ReportEvicted: the gRPC handlers and the hand-off lane (`lane.py`) share these.
    def acquire(self, user: str, request, process: tuple[str, str], context=None, alive=None):
        timeout = request.timeout_s if request.HasField("timeout_s") else None
        if timeout is not None and not timeout >= 0:
            raise InvalidArgument(f"timeout_s must be >= 0 (or unset to wait as long as it takes), got {timeout!r}")
        ticket = self.s.request(
            user, request.lease_id, request.kind or "phase", *process, gang=request.gang, gang_size=request.gang_size
        )
        # A caller that goes away while waiting leaves the queue (a no-op once granted: an unclaimed grant
        # is revoked after the holder timeout instead).
        if context is not None and not context.add_callback(lambda: self.s.cancel(ticket)):
            self.s.cancel(ticket)  # it already went away
        return to_proto(pb.Grant, self.s.wait(ticket, timeout, alive=alive))

    def release(self, user: str, request, process: tuple[str, str], alive=None):
        r = self.s.release(
            user,
            request.slice_id,
            request.keep_resident,
            request.restore_s,
            request.outcome or "ok",
            request.error,
            *process,
        )
        return to_proto(pb.ReleaseResponse, r)

    def report_evicted(self, user: str, request, process: tuple[str, str], alive=None):
        self.s.report_evicted(user, request.lease_id, request.switch_id, request.evict_s, request.failed, request.error)
        return pb.ReportEvictedResponse()

    @_handle
    def Acquire(self, request, context):
        return self.acquire(self._user(context), request, self._process(context), context=context)

    @_handle
    def Release(self, request, context):
        return self.release(self._user(context), request, self._process(context))

    @_handle
    def ReportEvicted(self, request, context):
        return self.report_evicted(self._user(context), request, self._process(context))

    @_handle
    def GetLane(self, request, context):
        key = self._key(context)
        self.lane_user(key)
        lane = self.lane
        if lane is None:
            return pb.GetLaneResponse()
        return pb.GetLaneResponse(host=lane.host, port=lane.port, token=lane.mint(key, self._process(context)))

    @_handle
    def DropResidency(self, request, context):
        was = self.s.drop_residency(self._user(context), request.lease_id, request.kept_on_host)
        return pb.DropResidencyResponse(was_resident=was)

    @_handle
    def DropStaleResidency(self, request, context):
        dropped, revoked = self.s.drop_stale_residency(self._user(context), request.instance, request.incarnation)
        return pb.DropStaleResidencyResponse(dropped=dropped, revoked=revoked)

    @_handle
    def Heartbeat(self, request, context):
        events = self.s.heartbeat(self._user(context), request.lease_ids, request.slice_ids)
        return pb.HeartbeatResponse(events=[to_proto(pb.LeaseEvent, e) for e in events])

    @_handle_stream
    def Session(self, request_iterator, context):
        user = self._user(context)
        sub = self.s.subscribe_events(user)

        def read():
            try:
                for hb in request_iterator:
                    for ev in self.s.heartbeat(user, hb.lease_ids, hb.slice_ids, sub=sub):
                        sub.put(ev)
            except Exception:  # noqa: BLE001 - the caller went away; its leases time out on their own
                pass
            finally:
                sub.close()

        threading.Thread(target=read, name="orchestrator-session", daemon=True).start()
        context.add_callback(sub.close)
        try:
            while not sub.closed:
                ev = sub.get(timeout=1.0)
                if ev is not None:
                    yield to_proto(pb.LeaseEvent, ev)
        finally:
            self.s.unsubscribe(sub)

    # --- timeline ---------------------------------------------------------------------------------
    @_handle
    def GetTimeline(self, request, context):
        tl = self.s.timeline(
            self._user(context), request.group_id, request.since, request.since_seq, request.limit or 1000
        )
        return to_proto(pb.GetTimelineResponse, tl)

    @_handle_stream
    def WatchTimeline(self, request, context):
        user = self._user(context)
        sub = self.s.subscribe_timeline(user, request.group_id)  # before the replay: nothing falls in between
        context.add_callback(sub.close)
        try:
            last = request.since_seq
            while True:
                tl = self.s.timeline(user, request.group_id, since_seq=last, limit=1000)
                for rec in tl.records:
                    yield to_proto(pb.SliceRecord, rec)
                last = tl.last_seq
                if len(tl.records) < 1000:
                    break
            while not sub.closed:
                rec = sub.get(timeout=1.0)
                if rec is not None and rec.seq > last:
                    yield to_proto(pb.SliceRecord, rec)
        finally:
            self.s.unsubscribe(sub)


class OrchestratorServer(grpc.Server):
    """A started grpc.Server with its scheduler; `port` is the bound port, `stop` also closes the scheduler."""

    def __init__(self, server: grpc.Server, scheduler: Scheduler, port: int, host: str, lane=None):
        self._server = server
        self.scheduler = scheduler
        self.port = port
        self.host = host
        self.lane = lane  # the hand-off lane (`lane.LaneServer`), or None
        self._stopped = False

    @property
    def target(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]") else self.host
        return f"{host}:{self.port}"

    def add_generic_rpc_handlers(self, generic_rpc_handlers):
        self._server.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers):
        self._server.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address):
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address, server_credentials):
        return self._server.add_secure_port(address, server_credentials)

    def start(self):
        self._server.start()

    def stop(self, grace=None):
        """Stops serving (in-flight calls get `grace` seconds), then closes the scheduler and flushes its
        store. Returns an Event set once all of that is done."""
        stopped = self._server.stop(grace)
        if self._stopped is not False:
            return self._stopped
        done = self._stopped = threading.Event()

        def close():
            if self.lane is not None:
                self.lane.close()
            stopped.wait()
            self.scheduler.close()  # after the last RPC: none touches a closed store
            done.set()

        threading.Thread(target=close, name="orchestrator-stop", daemon=True).start()
        return done

    def wait_for_termination(self, timeout=None):
        return self._server.wait_for_termination(timeout)


def serve_orchestrator(
    store_path: str | Path | None,
    port: int = DEFAULT_PORT,
    host: str = "127.0.0.1",
    authenticate: Callable[[str], str | None] | None = None,
    config: OrchestratorConfig | dict | str | Path | None = None,
    max_workers: int = 256,
    service_users: Iterable[str] = (),
    credentials: grpc.ServerCredentials | None = None,
    services: Iterable[Callable[[grpc.Server, Scheduler], None]] = (),
    lane: bool = True,
) -> OrchestratorServer:
    """Starts the orchestrator's gRPC service on host:port (port 0 picks a free one: see `.port`).

    `store_path`: the SQLite file for leases and the timeline (None: in memory only). `config`: see
    `openrl_lab.orchestrator.config` (default: groups from this machine's devices). Every waiting acquire
    and every client session holds one worker thread: `max_workers` bounds them. `service_users`: users
    trusted to create leases on behalf of others (the control plane passes the kernels' user).
    `credentials`: serve TLS with them (else plaintext). `services`: each adds another service to the same
    server (the control plane's kernel fleet) before it starts.
    `lane`: also
    serve the hand-off lane (`lane.py`) on a free loopback port, for clients on this machine (at most
    `max_workers` connections, one thread each; a client holds one per thread that acquires at once).
    """
    scheduler = Scheduler(config, store=store_path, service_users=service_users)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="orchestrator"),
        options=[("grpc.so_reuseport", 0)],
    )
    servicer = OrchestratorServicer(scheduler, authenticate)
    pb_grpc.add_TimeSliceOrchestratorServicer_to_server(servicer, server)
    for add in services:
        add(server, scheduler)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:
        scheduler.close()
        raise OSError(f"orchestrator: cannot listen on {address}: {e}") from None
    if bound == 0:
        scheduler.close()
        raise OSError(f"orchestrator: cannot listen on {address} (in use?)")
    if lane:
        from openrl_lab.orchestrator.lane import LaneServer
        from openrl_lab.sockets import is_loopback_host

        # Loopback only, whatever the gRPC address: the lane is for clients on this machine.
        bare = host.strip("[]")
        try:
            servicer.lane = LaneServer(
                servicer,
                bare if is_loopback_host(bare) and bare != "localhost" else "127.0.0.1",
                max_connections=max_workers,
            )
        except OSError as e:  # the clients use gRPC alone
            log.warning("orchestrator: no hand-off lane: %s", e)
    server.start()
    scheduler.start_reaper()
    return OrchestratorServer(server, scheduler, bound, host, servicer.lane)
