"""Talking to kernels from the control plane (torch-free): a connection pool and a local launcher."""

from __future__ import annotations

import os
import queue
import secrets
import socket
import struct
import subprocess
import sys
import threading
from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from openrl_lab.sockets import set_nodelay

# Deadlines on the kernel protocol. A handshake is a few small messages: a peer that stays silent longer
# is not a kernel (or not one that works). An operation may wait for its slice behind other users' phases,
# so its default deadline is long; past it the caller gets KernelTimeout and the model's lane moves on.
HANDSHAKE_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = float(os.environ.get("OPENRL_KERNEL_CALL_TIMEOUT_S", 1800))


class KernelError(RuntimeError):
    """The kernel failed (crashed, unreachable, or raised an internal error)."""


class KernelUserError(ValueError):
    """The kernel refused a request because of its content."""


class KernelNotFound(LookupError):
    """The kernel does not hold the job or sampler asked for."""


class KernelTimeout(KernelError):
    """The kernel did not answer within the call's deadline; the connection was dropped."""


def recv_timeout(sock: socket.socket, seconds: float) -> None:
    """A receive deadline that survives `detach()`: `multiprocessing` Connections read the raw descriptor,
    so `settimeout` (which switches the socket to non-blocking) would not apply; 0 means none."""
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


def handshake(sock: socket.socket, authkey: bytes, server: bool) -> Connection:
    """Both sides prove they hold the key (HMAC challenges, as `multiprocessing.connection` does), within
    HANDSHAKE_TIMEOUT_S; raises AuthenticationError, OSError or EOFError for a peer that fails or stalls."""
    set_nodelay(sock)
    recv_timeout(sock, HANDSHAKE_TIMEOUT_S)
    conn = Connection(sock.detach())
    try:
        if server:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
        with socket.socket(fileno=conn.fileno()) as s:  # the same descriptor: clear the deadline, keep it open
            recv_timeout(s, 0)
            s.detach()
    except BaseException:
        conn.close()
        raise
    return conn


class KernelClient:
    def __init__(self, address: tuple[str, int], authkey: bytes):
        self.address = address
        self._authkey = authkey
        self._idle: queue.SimpleQueue[Connection] = queue.SimpleQueue()

    def connect(self) -> Connection:
        host, port = self.address
        try:
            sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
            sock.settimeout(None)  # blocking again: the Connection reads the raw descriptor
            return handshake(sock, self._authkey, server=False)
        except (OSError, EOFError, AuthenticationError) as e:
            raise KernelError(f"kernel at {host}:{port} is unreachable: {e or type(e).__name__}") from None

    def call(self, op: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """Runs one operation on the kernel; blocking, thread-safe (each caller borrows a connection).
        Raises KernelTimeout when no answer comes within `timeout` (default CALL_TIMEOUT_S)."""
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            conn = self.connect()
        deadline = CALL_TIMEOUT_S if timeout is None else timeout
        try:
            conn.send((op, kwargs))
            if not conn.poll(deadline):
                conn.close()  # the late answer must not reach the next caller of this connection
                raise KernelTimeout(f"the kernel did not answer {op} within {deadline:.0f} s; the request was "
                                    f"abandoned (the kernel may still finish it)")
            status, payload = conn.recv()
        except (EOFError, OSError) as e:
            conn.close()
            raise KernelError(f"lost the kernel while running {op}: {e or 'connection closed'}") from None
        self._idle.put(conn)
        if status == "ok":
            return payload
        if status == "user":
            raise KernelUserError(payload)
        if status == "not_found":
            raise KernelNotFound(payload)
        raise KernelError(payload)


# glibc keeps freed memory instead of returning it to the OS, so swap restores reuse warm pages
# (docs/benchmarks.md, CPU swap: restore efficiency 0.18 -> 0.97 of a plain copy).
CPU_GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"


class LocalKernel:
    """A kernel started as a child process of the control plane, on loopback with a fresh key.

    `name` (default kernel-<group>) must be unique among live kernels: a kernel started under a name
    replaces the previous one of that name in the orchestrator's eyes (what it left on the device is gone)."""

    def __init__(self, group: str, home: Path, device: str = "cpu", log_dir: Path | None = None,
                 orchestrator: tuple[str, str] | None = None, name: str | None = None):
        self.group = group
        self.name = name or f"kernel-{group}"
        self.orchestrator = orchestrator
        self.home = home
        self.device = device
        self.log_path = (log_dir or home / "logs") / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.client: KernelClient | None = None
        self._lock = threading.Lock()

    def start(self, timeout: float = 120.0) -> KernelClient:
        authkey = secrets.token_hex(32)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OPENRL_KERNEL_AUTHKEY=authkey, PYTHONUNBUFFERED="1")
        if "GLIBC_TUNABLES" not in env and _runs_on_cpu(self.device):
            env["GLIBC_TUNABLES"] = CPU_GLIBC_TUNABLES  # keep freed memory: see CPU_GLIBC_TUNABLES
        if self.orchestrator:
            env.update(OPENRL_ORCHESTRATOR_TARGET=self.orchestrator[0], OPENRL_ORCHESTRATOR_KEY=self.orchestrator[1])
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openrl_lab.kernel", "--home", str(self.home), "--device", self.device,
             "--group", self.group, "--name", self.name],
            stdout=subprocess.PIPE, stderr=log, env=env,
        )
        port = self._read_port(timeout)
        self.client = KernelClient(("127.0.0.1", port), authkey.encode())
        return self.client

    def _read_port(self, timeout: float) -> int:
        result: list[int] = []

        def reader() -> None:
            assert self.proc and self.proc.stdout
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith("OPENRL_KERNEL_READY") and not result:
                    result.append(int(line.split()[1]))
                # keep draining stdout so the child never blocks on a full pipe

        threading.Thread(target=reader, daemon=True).start()
        deadline = threading.Event()
        for _ in range(int(timeout * 20)):
            if result:
                return result[0]
            if self.proc.poll() is not None:
                raise KernelError(f"kernel {self.group} exited with {self.proc.returncode}; see {self.log_path}")
            deadline.wait(0.05)
        self.stop()
        raise KernelError(f"kernel {self.group} did not start within {timeout:.0f}s; see {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _runs_on_cpu(device: str) -> bool:
    if device == "auto":  # the kernel picks CUDA if it finds a GPU; ask the same way, without torch
        from openrl_lab.orchestrator.config import discover_devices

        return discover_devices() == ["cpu"]
    return device.split(":")[0] == "cpu"
