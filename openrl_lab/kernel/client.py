"""Talking to kernels from the control plane (torch-free): the protocol's client and a local launcher.

The protocol (`kernel.proto`) is gRPC: one unary `Run(op, args, blobs)` per operation of the kernel's
table, its arguments JSON with arrays as raw bytes (`codec.py`: nothing is unpickled), the kernel's key in
the call's metadata, a deadline on every call. gRPC gives each call its own stream on shared connections
(TCP_NODELAY on), so a slow or silent peer holds nobody else up.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc

from openrl_lab.kernel import codec
from openrl_lab.kernel import kernel_pb2 as pb
from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc

# Deadlines on the kernel protocol. Connecting (and the server's wait for a new connection's first bytes) is
# short; an operation may wait for its slice behind other users' phases, so its default deadline is long;
# past it the caller gets KernelTimeout and the model's lane moves on.
HANDSHAKE_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = float(os.environ.get("OPENRL_KERNEL_CALL_TIMEOUT_S", 1800))
KEY_METADATA = "x-openrl-kernel-key"
MAX_MESSAGE_BYTES = 512 << 20  # a forward_backward request is at most 64 MiB of protobuf at the gateway
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


class KernelError(RuntimeError):
    """The kernel failed (crashed, unreachable, or raised an internal error)."""


class KernelUserError(ValueError):
    """The kernel refused a request because of its content."""


class KernelNotFound(LookupError):
    """The kernel does not hold the job or sampler asked for."""


class KernelTimeout(KernelError):
    """The kernel did not answer within the call's deadline; the call was abandoned."""


class KernelClient:
    def __init__(self, address: tuple[str, int], authkey: bytes | str):
        self.address = address
        host, port = address
        self._metadata = ((KEY_METADATA, authkey.decode() if isinstance(authkey, bytes) else authkey),)
        self._channel = grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                                              options=CHANNEL_OPTIONS)
        self._run = pb_grpc.KernelStub(self._channel).Run

    def call(self, op: str, timeout: float | None = None, **kwargs: Any) -> Any:
        """Runs one operation on the kernel; blocking, thread-safe. Raises KernelTimeout when no answer
        comes within `timeout` (default CALL_TIMEOUT_S)."""
        deadline = CALL_TIMEOUT_S if timeout is None else timeout
        args, blobs = codec.encode(kwargs)
        try:
            reply = self._run(pb.Call(op=op, args=args, blobs=blobs), timeout=deadline, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _kernel_error(e, op, deadline, self.address) from None
        try:
            payload = codec.decode(reply.result, list(reply.blobs))
        except codec.CodecError as e:
            raise KernelError(f"the kernel's answer to {op} is malformed: {e}") from None
        if reply.status == "ok":
            return payload
        if reply.status == "user":
            raise KernelUserError(payload)
        if reply.status == "not_found":
            raise KernelNotFound(payload)
        raise KernelError(payload)

    def close(self) -> None:
        self._channel.close()


def _kernel_error(e: grpc.RpcError, op: str, deadline: float, address: tuple[str, int]) -> KernelError:
    code, details = e.code(), e.details()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KernelTimeout(f"the kernel did not answer {op} within {deadline:.0f} s; the request was abandoned "
                             f"(the kernel may still finish it)")
    if code == grpc.StatusCode.UNAVAILABLE:
        return KernelError(f"kernel at {address[0]}:{address[1]} is unreachable or was lost while running {op}: "
                           f"{details}")
    return KernelError(f"the kernel refused {op}: {code.name}: {details}")


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
        if self.client is not None:
            self.client.close()
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
