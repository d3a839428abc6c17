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

from openrl_lab.kernel.client import HANDSHAKE_TIMEOUT_S, KernelClient, KernelError, KernelTimeout, handshake
from openrl_lab.sockets import http_client, listening_socket

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
        with _borrow_fd(pid, c.fd) as s:
            found.append((c.status, c.laddr, c.raddr, bool(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))))
    return found


def _kernel_pid(lab) -> int:
    kernels = [p for p in psutil.Process(lab.proc.pid).children() if "openrl_lab.kernel" in " ".join(p.cmdline())]
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
            client = [c for c in psutil.Process().net_connections(kind="tcp")
                      if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED]
            assert len(client) == 1
            with _borrow_fd(os.getpid(), client[0].fd) as s:
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        held[0].close()


def test_silent_peer_on_the_kernel_port_stalls_nobody(lab, service):
    """TCP clients that connect to the kernel port and say nothing must not delay anyone else (the kernel
    used to authenticate connections one at a time in its accept loop, with no deadline), and are dropped
    after the handshake deadline."""
    kernel = psutil.Process(_kernel_pid(lab))
    port = [c.laddr.port for c in kernel.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN][0]
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        # A new connection, as the gateway opens one per concurrent request, is served at once.
        fresh = KernelClient(("127.0.0.1", port), kernel.environ()["OPENRL_KERNEL_AUTHKEY"].encode())
        answered = []
        caller = threading.Thread(target=lambda: answered.append(fresh.call("ping")), daemon=True)
        caller.start()
        caller.join(HANDSHAKE_TIMEOUT_S)  # a liveness bound (the old stall was unbounded), not a performance figure
        assert answered == ["pong"]
        trainer = service.create_lora_training_client(base_model="openrl-lab/tiny-llama-1m", rank=4).result()
        datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
                                   loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]})
        assert trainer.forward_backward([datum], "cross_entropy").result(timeout=60).metrics
        silent[0].settimeout(HANDSHAKE_TIMEOUT_S * 3)
        assert silent[0].recv(1024 * 1024) != b""  # the kernel's challenge ...
        assert silent[0].recv(1) == b""            # ... then, unanswered, it hangs up
    finally:
        for s in silent:
            s.close()


def test_kernel_client_deadline_frees_the_caller():
    """A peer that authenticates, then never answers: the call ends with KernelTimeout, not a hang."""
    authkey = b"k" * 32
    with listening_socket("127.0.0.1", 0) as server:
        held = []

        def mute_kernel():
            sock, _ = server.accept()
            held.append(handshake(sock, authkey, server=True))  # then reads nothing, answers nothing

        threading.Thread(target=mute_kernel, daemon=True).start()
        client = KernelClient(server.getsockname(), authkey)
        with pytest.raises(KernelTimeout, match="did not answer forward_backward within"):
            client.call("forward_backward", timeout=0.5, job_id="x")


def test_kernel_client_refuses_a_peer_without_the_key():
    with listening_socket("127.0.0.1", 0) as server:
        def impostor():
            sock, _ = server.accept()
            try:
                handshake(sock, b"w" * 32, server=True)
            except Exception:  # noqa: BLE001 - the client's refusal ends it
                pass

        threading.Thread(target=impostor, daemon=True).start()
        with pytest.raises(KernelError, match="unreachable: digest sent was rejected"):
            KernelClient(server.getsockname(), b"k" * 32).call("ping")
