"""Talking to kernels from the control plane (torch-free): a connection pool and a local launcher."""

from __future__ import annotations

import os
import queue
import secrets
import subprocess
import sys
import threading
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any


class KernelError(RuntimeError):
    """The kernel failed (crashed, unreachable, or raised an internal error)."""


class KernelUserError(ValueError):
    """The kernel refused a request because of its content."""


class KernelNotFound(LookupError):
    """The kernel does not hold the job or sampler asked for."""


class KernelClient:
    def __init__(self, address: tuple[str, int], authkey: bytes):
        self.address = address
        self._authkey = authkey
        self._idle: queue.SimpleQueue[Connection] = queue.SimpleQueue()

    def call(self, op: str, **kwargs: Any) -> Any:
        """Runs one operation on the kernel; blocking, thread-safe (each caller borrows a connection)."""
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            try:
                conn = Client(self.address, authkey=self._authkey)
            except OSError as e:
                raise KernelError(f"kernel at {self.address[0]}:{self.address[1]} is unreachable: {e}") from None
        try:
            conn.send((op, kwargs))
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
