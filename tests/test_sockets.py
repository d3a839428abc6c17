"""Every TCP connection of a running lab has Nagle off (TCP_NODELAY), on both ends.

Without it each HTTP request waited ~40 ms for a delayed ACK (the response goes out as head, then body).
The check is deterministic: it reads the socket option of the live sockets inside the lab's own processes
(`pidfd_getfd` borrows a process's descriptor), rather than timing requests.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading

import httpx
import psutil
import pytest
import tinker

from openrl_lab.kernel.client import HANDSHAKE_TIMEOUT_S, KernelClient, KernelError, KernelTimeout
from openrl_lab.sockets import http_client, listening_socket
from tests.processes import lab_kernels

pytestmark = pytest.mark.server  # starts listening sockets, gRPC and HTTP servers

SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture


def _borrow_fd(pid: int, fd: int) -> socket.socket:
    """A socket object on a duplicate of descriptor `fd` of process `pid` (same underlying socket)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            raise OSError(ctypes.get_errno(), f"pidfd_getfd({pid}, {fd})")
    finally:
        os.close(pidfd)
    return socket.socket(fileno=got)


def _tcp_sockets(pid: int) -> list[tuple[str, tuple, tuple, bool]]:
    """(status, local address, remote address, TCP_NODELAY) of each TCP socket process `pid` holds."""
    found = []
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.fd < 0:
            continue
        # The process runs on while we look: a connection may close (its fd gone, or reused by another file or
        # socket) between the listing and the borrowing. Such a one is skipped, not misread.
        try:
            with _borrow_fd(pid, c.fd) as s:
                if s.getsockname()[:2] != tuple(c.laddr) or (c.raddr and s.getpeername()[:2] != tuple(c.raddr)):
                    continue
                nodelay = bool(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        except OSError:
            continue
        found.append((c.status, c.laddr, c.raddr, nodelay))
    return found


def _kernel_pid(lab) -> int:
    kernels = lab_kernels(lab)
    assert len(kernels) == 1, kernels
    return kernels[0].pid


def test_listening_socket_gives_accepted_sockets_nodelay():
    with listening_socket("127.0.0.1", 0) as server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            assert accepted.proto == socket.IPPROTO_TCP  # what asyncio checks before it sets the option itself
        assert not client.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # a plain client: the check can fail


def test_every_connection_of_serve_and_its_kernel_has_nodelay(lab, service):
    """The gateway's accepted HTTP connections (from httpx and from the tinker SDK), its connections to the
    kernel, the kernel's accepted ones, and the gRPC connections to the orchestrator: all without Nagle."""
    trainer = service.create_lora_training_client(base_model="openrl-lab/tiny-llama-1m", rank=4).result()
    trainer.get_info()
    with httpx.Client(base_url=lab.base_url) as plain:  # a client with Nagle on: the server side must still be off
        assert plain.get("/api/v1/healthz").status_code == 200
        server_side = [s for s in _tcp_sockets(lab.proc.pid) if s[0] == psutil.CONN_ESTABLISHED]
        kernel_side = [s for s in _tcp_sockets(_kernel_pid(lab)) if s[0] == psutil.CONN_ESTABLISHED]
        http_port = int(lab.base_url.rsplit(":", 1)[1])
        accepted_http = [s for s in server_side if s[1].port == http_port]
        assert len(accepted_http) >= 2, server_side  # the plain client's and the SDK's
        assert kernel_side, "the kernel holds no connection"
        assert [s for s in server_side + kernel_side if not s[3]] == []


def test_project_http_clients_set_nodelay():
    with listening_socket("127.0.0.1", 0) as server:
        port = server.getsockname()[1]

        def answer_once():
            accepted, _ = server.accept()
            accepted.recv(65536)
            accepted.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            held.append(accepted)  # keep the connection open while the client's side is inspected

        held: list[socket.socket] = []
        threading.Thread(target=answer_once, daemon=True).start()
        with http_client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            assert http.get("/").status_code == 200
            client = [
                c
                for c in psutil.Process().net_connections(kind="tcp")
                if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
            ]
            assert len(client) == 1
            with _borrow_fd(os.getpid(), client[0].fd) as s:
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        held[0].close()


def _kernel_port(lab) -> int:
    kernel = psutil.Process(_kernel_pid(lab))
    return next(c.laddr.port for c in kernel.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN)


def _kernel_key(lab) -> str:
    return psutil.Process(_kernel_pid(lab)).environ()["OPENRL_KERNEL_AUTHKEY"]


def test_silent_peer_on_the_kernel_port_stalls_nobody(lab, service):
    """TCP clients that connect to the kernel port and say nothing, or send garbage, must not delay anyone
    else (the kernel used to authenticate connections one at a time in its accept loop, with no deadline),
    and a silent one is dropped after the handshake deadline."""
    port = _kernel_port(lab)
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    garbage = socket.create_connection(("127.0.0.1", port))
    garbage.sendall(b"\x00" * 9 + b"not http/2 at all" * 100)
    try:
        fresh = KernelClient(("127.0.0.1", port), _kernel_key(lab))  # a new connection is served at once
        assert fresh.call("ping", timeout=HANDSHAKE_TIMEOUT_S) == "pong"
        fresh.close()
        trainer = service.create_lora_training_client(base_model="openrl-lab/tiny-llama-1m", rank=4).result()
        datum = tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
        )
        assert trainer.forward_backward([datum], "cross_entropy").result(timeout=60).metrics
        silent[0].settimeout(HANDSHAKE_TIMEOUT_S * 3)  # a liveness bound: the kernel hangs up on it
        while silent[0].recv(65536):
            pass
    finally:
        for s in [*silent, garbage]:
            s.close()


def test_hostile_kernel_protocol_input_is_refused_and_the_kernel_keeps_serving(lab):
    import grpc

    from openrl_lab.kernel import codec
    from openrl_lab.kernel import kernel_pb2 as pb

    port, key = _kernel_port(lab), _kernel_key(lab)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    raw = channel.unary_unary("/openrl_lab.kernel.Kernel/Run")  # bytes in, bytes out
    md = (("x-openrl-kernel-key", key),)

    def refused(body: bytes, metadata=md) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as e:
            raw(body, timeout=30, metadata=metadata)
        return e.value

    def call(op: str, args: bytes = b"{}", blobs=()) -> bytes:
        return pb.Call(op=op, args=args, blobs=list(blobs)).SerializeToString()

    assert refused(b"\xff\x00 garbage frame").code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    assert refused(call("ping"), metadata=(("x-openrl-kernel-key", "wrong"),)).code() == grpc.StatusCode.UNAUTHENTICATED
    assert refused(call("ping"), metadata=()).code() == grpc.StatusCode.UNAUTHENTICATED
    unknown = refused(call("evict_job", b'{"job_id": "x"}'))
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown operation 'evict_job'" in unknown.details()
    assert "unknown operation '__init__'" in refused(call("__init__")).details()
    assert "not JSON" in refused(call("model_info", b"{nope")).details()
    assert "must be a JSON object" in refused(call("model_info", b"[1]")).details()
    assert (
        "rm_rf: not an argument of this operation"
        in refused(call("model_info", b'{"base_model": "m", "rm_rf": 1}')).details()
    )
    assert "base_model: a required argument is missing" in refused(call("model_info", b"{}")).details()
    mistyped = refused(
        call(
            "sample",
            b'{"sampler_id": 7, "prompt": "rm", "num_samples": 1, "params": {"top_k": "all"}, '
            b'"want_prompt_logprobs": false}',
        )
    )
    assert mistyped.code() == grpc.StatusCode.INVALID_ARGUMENT
    for said in ("sampler_id: Input should be a valid string", "prompt: Input should be a valid list", "params.top_k"):
        assert said in mistyped.details()  # every argument checked against its type, each one named
    bad_ref = b'{"job_id": "j", "adam": {"__array__": 5, "dtype": "float32", "shape": [2]}}'
    assert "bad blob reference" in refused(call("optim_step", bad_ref)).details()
    lying = b'{"job_id": "j", "adam": {"__array__": 0, "dtype": "float32", "shape": [1000000]}}'
    assert "needs 4000000 bytes, got 8" in refused(call("optim_step", lying, [b"\0" * 8])).details()
    odd = b'{"job_id": "j", "adam": {"__array__": 0, "dtype": "object", "shape": [1]}}'
    assert "dtype 'object'" in refused(call("optim_step", odd, [b"\0" * 8])).details()
    assert refused(call("ping", b"{}", [b"\0" * (600 << 20)])).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    reply = pb.Reply.FromString(raw(call("ping"), timeout=30, metadata=md))  # still serving
    assert (reply.status, codec.decode(reply.result, list(reply.blobs))) == ("ok", "pong")
    channel.close()


def test_kernel_client_deadline_frees_the_caller():
    """A kernel that accepts a call, then never answers: the call ends with KernelTimeout, not a hang."""
    from concurrent import futures

    import grpc

    from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc

    release = threading.Event()

    class MuteKernel(pb_grpc.KernelServicer):
        def Run(self, request, context):  # noqa: N802
            release.wait(60)
            context.abort(grpc.StatusCode.CANCELLED, "too late")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KernelServicer_to_server(MuteKernel(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        client = KernelClient(("127.0.0.1", port), b"k" * 32)
        with pytest.raises(KernelTimeout, match="did not answer forward_backward within"):
            client.call("forward_backward", timeout=0.5, job_id="x")
        client.close()
    finally:
        release.set()
        server.stop(0)


def test_kernel_client_names_an_unreachable_kernel():
    with listening_socket("127.0.0.1", 0) as s:
        port = s.getsockname()[1]  # then closed: nobody listens there
    with pytest.raises(KernelError, match=f"kernel at 127.0.0.1:{port} is unreachable"):
        KernelClient(("127.0.0.1", port), b"k" * 32).call("ping", timeout=HANDSHAKE_TIMEOUT_S)
