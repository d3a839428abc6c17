"""The hand-off lane: Acquire, Release and ReportEvicted on a plain loopback socket beside the gRPC service.

Why: between one job's phase and the next, the release travels to the orchestrator and the grant back to
the waiting job. Over gRPC those two messages woke about eight threads across the three processes
(grpcio's synchronous stack: its completion-queue thread and a handler from the pool on the
orchestrator, twice for a new call, and the channel's thread in the client), each an idle thread on an
idle core: a hand-off took ~1.6 ms on two cores, where the same two messages between bare sockets, one
thread at each end, take ~0.25 ms (`docs/benchmarks.md`, "Hand-off latency"). So those three calls also
go on a lane: one TCP connection per client thread in use, one server thread per connection, which calls
the scheduler itself and, for an Acquire, waits for the grant on the ticket's event and writes it.

The wire format is in `orchestrator.proto` ("The hand-off lane"). A client asks GetLane (over gRPC, with
its key) for the address and a token; its connections open with that token, never the key, and act as
that key and process. The server keeps gRPC's rules: the key is checked again at every request (a
revoked key stops working at once), the same checks and errors (as `LaneError` with the gRPC status
name), a caller that goes away while waiting is withdrawn (checked every `ALIVE_CHECK_S`). Only for
clients on the same machine: it listens on loopback, whatever address the gRPC port has. Hostile input
closes the connection: frames over `MAX_FRAME`, unknown types, a hello that is not first, has an unknown
token or does not come within `HELLO_TIMEOUT_S`, a frame that stalls half-way for `FRAME_TIMEOUT_S`, a
payload that does not parse. At most `max_connections` connections are served; others are closed at
once (their clients use gRPC).

Everything else (leases, heartbeats, events, status, timelines) stays on gRPC, and a client whose lane
fails (or an orchestrator without one) makes the same calls over gRPC.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import select
import socket
import struct
import threading

from google.protobuf.message import DecodeError

from openrl_lab.orchestrator import orchestrator_pb2 as pb
from openrl_lab.orchestrator.errors import BY_CODE, InvalidArgument, OrchestratorError, Unauthenticated
from openrl_lab.sockets import is_loopback_host, listening_socket

log = logging.getLogger(__name__)

HELLO, ACQUIRE, RELEASE, REPORT_EVICTED = 1, 2, 3, 4
ANSWER = 0x80  # an answer's type: the request's type | ANSWER
ERROR = 0xFF
MAX_FRAME = 64 * 1024
MAX_TOKENS = 4096
HELLO_TIMEOUT_S = 10.0
FRAME_TIMEOUT_S = 10.0
_HEAD = struct.Struct(">IB")  # length of what follows the 4 bytes (type byte + payload), type

# request type -> (its message, the servicer method that answers it); and the answer's message
OPS = {
    ACQUIRE: (pb.AcquireRequest, "acquire"),
    RELEASE: (pb.ReleaseRequest, "release"),
    REPORT_EVICTED: (pb.ReportEvictedRequest, "report_evicted"),
}
ANSWERS = {ACQUIRE: pb.Grant, RELEASE: pb.ReleaseResponse, REPORT_EVICTED: pb.ReportEvictedResponse}


class LaneClosed(ConnectionError):
    """The connection ended or carried something that is not the protocol."""


def send_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    sock.sendall(_HEAD.pack(len(payload) + 1, kind) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise LaneClosed("the connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, idle_timeout: float | None, frame_timeout: float | None) -> tuple[int, bytes]:
    """One frame: waits up to `idle_timeout` for its first byte (None: forever), then `frame_timeout` for the rest."""
    sock.settimeout(idle_timeout)
    first = _recv_exact(sock, 1)
    sock.settimeout(frame_timeout)
    head = first + _recv_exact(sock, _HEAD.size - 1)
    length, kind = _HEAD.unpack(head)
    if not 1 <= length <= MAX_FRAME:
        raise LaneClosed(f"a frame of {length} bytes (at most {MAX_FRAME})")
    return kind, _recv_exact(sock, length - 1)


# --- the server's end ---------------------------------------------------------------------------------


class LaneServer:
    """Serves the lane for one `OrchestratorServicer` (whose `lane_user`, `acquire`, `release` and
    `report_evicted` do the work, exactly as for the gRPC calls)."""

    def __init__(self, servicer, host: str = "127.0.0.1", max_connections: int = 256):
        self.servicer = servicer
        self._sock = listening_socket(host, 0)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(max_connections)
        # token -> (key, process) of the GetLane call that minted it; the oldest are forgotten past MAX_TOKENS
        # (their clients' hellos fail and they ask GetLane again).
        self._tokens: collections.OrderedDict[bytes, tuple[str | None, tuple[str, str]]] = collections.OrderedDict()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="orchestrator-lane", daemon=True)
        self._thread.start()

    def mint(self, key: str | None, process: tuple[str, str]) -> bytes:
        """A token for a client's hello: it stands for `key` and `process` (what GetLane was called with), so
        the key itself never travels on the lane."""
        token = secrets.token_bytes(32)
        with self._lock:
            self._tokens[token] = (key, process)
            while len(self._tokens) > MAX_TOKENS:
                self._tokens.popitem(last=False)
        return token

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue  # e.g. out of file descriptors for a moment, or a connection reset before accept
            if not self._slots.acquire(blocking=False):
                conn.close()  # its client uses gRPC
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    self._slots.release()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="orchestrator-lane-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            kind, body = recv_frame(conn, HELLO_TIMEOUT_S, FRAME_TIMEOUT_S)
            if kind != HELLO:
                raise LaneClosed(f"frame type {kind} before the hello")
            with self._lock:
                minted = self._tokens.get(pb.LaneHello.FromString(body).token)
            if minted is None:
                return self._error(conn, Unauthenticated("unknown lane token: ask GetLane for one"))
            key, process = minted
            try:
                self.servicer.lane_user(key)
            except OrchestratorError as e:
                return self._error(conn, e)
            send_frame(conn, HELLO | ANSWER)
            alive = lambda: _peer_alive(conn)  # noqa: E731
            while not self._closed:
                kind, body = recv_frame(conn, None, FRAME_TIMEOUT_S)
                op = OPS.get(kind)
                if op is None:
                    raise LaneClosed(f"unknown frame type {kind}")
                request = op[0].FromString(body)
                try:
                    user = self.servicer.lane_user(key)
                    answer = getattr(self.servicer, op[1])(user, request, process, alive=alive)
                except OrchestratorError as e:
                    self._error(conn, e)
                    continue
                except Exception as e:  # as the gRPC service does: logged, INTERNAL, serving on
                    log.exception("orchestrator lane: %s failed", op[1])
                    err = OrchestratorError(f"internal error in {op[1]}: {type(e).__name__}: {e}")
                    err.code = "INTERNAL"
                    self._error(conn, err)
                    continue
                send_frame(conn, kind | ANSWER, answer.SerializeToString())
        except (LaneClosed, OSError, DecodeError) as e:
            if not self._closed:
                log.debug("orchestrator lane: connection dropped: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    @staticmethod
    def _error(conn: socket.socket, e: OrchestratorError) -> None:
        send_frame(conn, ERROR, pb.LaneError(code=e.code, message=str(e)).SerializeToString())

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)  # wakes its thread's read; a waiting Acquire sees it gone
        self._thread.join(timeout=5)


def _peer_alive(conn: socket.socket) -> bool:
    """False once the client closed its end (checked while its Acquire waits: nothing else is sent then).
    poll(), not select(), which fails for descriptors past 1024."""
    try:
        p = select.poll()
        p.register(conn.fileno(), select.POLLIN)
        return not p.poll(0) or conn.recv(1, socket.MSG_PEEK) != b""  # readable: data, or the end
    except (OSError, ValueError):
        return False


# --- the client's end ---------------------------------------------------------------------------------


class LaneClient:
    """A pool of lane connections (one per thread that calls at the same time). `call` raises the
    orchestrator's error for an answered error, and `LaneClosed` when the lane itself failed, in which case
    nothing is known to have happened and the caller goes over gRPC."""

    def __init__(self, host: str, port: int, token: bytes, connect_timeout: float = 5.0):
        self.host, self.port = host, port
        self._hello = pb.LaneHello(token=token).SerializeToString()
        self._timeout = connect_timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.closed = False

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self._timeout)
        except OSError as e:
            raise LaneClosed(f"cannot connect to the lane at {self.host}:{self.port}: {e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_frame(sock, HELLO, self._hello)
            kind, body = recv_frame(sock, self._timeout, self._timeout)
        except (OSError, LaneClosed) as e:
            sock.close()
            raise LaneClosed(f"the lane's hello failed: {e}") from None
        if kind == ERROR:  # e.g. a token it forgot: the same call over gRPC says what is wrong, if anything
            sock.close()
            raise LaneClosed(f"the lane refused the hello: {_answered_error(body)}")
        if kind != HELLO | ANSWER:
            sock.close()
            raise LaneClosed(f"the lane answered the hello with frame type {kind}")
        sock.settimeout(None)
        return sock

    def call(self, kind: int, request) -> object:
        with self._lock:
            if self.closed:
                raise LaneClosed("the client is closed")
            if self._pid != os.getpid():  # a forked child must not share its parent's connections
                self._idle, self._pid = [], os.getpid()
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            sock = self._connect()
        try:
            send_frame(sock, kind, request.SerializeToString())
            answer, body = recv_frame(sock, None, FRAME_TIMEOUT_S)
        except BaseException as e:
            # Also on an interrupt (Ctrl-C) while an Acquire waits: closing the connection withdraws it.
            sock.close()
            if isinstance(e, (OSError, LaneClosed)):
                raise LaneClosed(f"the lane failed: {e}") from None
            raise
        with self._lock:
            if self.closed:
                sock.close()
            else:
                self._idle.append(sock)
        if answer == ERROR:
            raise _answered_error(body)
        if answer != kind | ANSWER:
            raise LaneClosed(f"the lane answered type {kind} with type {answer}")
        try:
            return ANSWERS[kind].FromString(body)
        except DecodeError as e:
            raise LaneClosed(f"the lane's answer does not parse: {e}") from None

    def close(self) -> None:
        with self._lock:
            self.closed = True
            idle, self._idle = self._idle, []
        for s in idle:
            s.close()


def _answered_error(body: bytes) -> OrchestratorError:
    try:
        e = pb.LaneError.FromString(body)
    except DecodeError:
        return InvalidArgument("the lane answered an error that does not parse")
    return BY_CODE.get(e.code, OrchestratorError)(e.message)


def lane_target(target: str) -> str | None:
    """The host of a gRPC target if it is a loopback address (the lane is only for this machine), else None."""
    host, sep, port = target.rpartition(":")
    if target.startswith(("unix:", "dns:", "ipv4:", "ipv6:")) or not sep or not port.isdigit():
        return None
    return host.strip("[]") if is_loopback_host(host) else None
