"""Talking to kernels from the control plane (torch-free): the protocol's client.

The protocol (`kernel.proto`) is gRPC: one unary `Run(op, args, blobs)` per operation of the kernel's
table, its arguments JSON with arrays as raw bytes (`codec.py`: nothing is unpickled), the kernel's key in
the call's metadata, a deadline on every call. gRPC gives each call its own stream on shared connections
(TCP_NODELAY on), so a slow or silent peer holds nobody else up.
"""

from __future__ import annotations

import os
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


class KernelLost(KernelError):
    """The kernel that held the job or sampler is gone (it died, stopped answering, or left the fleet)."""


class NoKernel(KernelError):
    """No live kernel serves the group asked for."""


def grpc_target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class KernelClient:
    """The kernel protocol's client. `tls`: the kernel serves TLS; its certificate is checked against
    `root_certificates` (PEM bytes; None: the system's roots) for its address, or for `tls_name`."""

    def __init__(self, address: tuple[str, int], authkey: bytes | str, tls: bool = False,
                 root_certificates: bytes | None = None, tls_name: str | None = None):
        self.address = address
        self._metadata = ((KEY_METADATA, authkey.decode() if isinstance(authkey, bytes) else authkey),)
        target = grpc_target(*address)
        # tls_name: the name the kernel's certificate must carry, whatever address it is reached at (kernels
        # whose addresses are not known in advance, e.g. Pods, share one certificate for that name).
        options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", tls_name)] if tls and tls_name else [])
        self._channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=options)
                         if tls else grpc.insecure_channel(target, options=options))
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
