"""Talking to kernels from the control plane (torch-free): the protocol's client.

Callers use `KernelClient.api()`, the kernel's operations as typed methods (`api.KernelApi`). Underneath,
the protocol (`kernel.proto`) is gRPC: one unary `Run(op, args, blobs)` per operation of the kernel's
table, its arguments JSON with arrays as raw bytes (`codec.py`: nothing is unpickled), the kernel's key in
the call's metadata, a deadline on every call. gRPC gives each call its own stream on shared connections
(TCP_NODELAY on), so a slow or silent peer holds nobody else up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import grpc

from openrl_lab.kernel import codec
from openrl_lab.kernel import kernel_pb2 as pb
from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc
from openrl_lab.kernel.api import OPERATIONS, KernelApi, Operation
from openrl_lab.settings import settings

# Deadlines on the kernel protocol. Connecting (and the server's wait for a new connection's first bytes) is
# short; an operation may wait for its slice behind other users' phases, so its default deadline is long;
# past it ($OPENRL_KERNEL_CALL_TIMEOUT_S, default 1800 s) the caller gets KernelTimeout and the model's lane
# moves on.
HANDSHAKE_TIMEOUT_S = 10.0
KEY_METADATA = "x-openrl-kernel-key"
# "<lane> <number>": the kernel starts a lane's calls in their numbers' order (kernel/ordering.py), so a caller
# may send a model's next call before the previous one has finished.
ORDER_METADATA = "x-openrl-order"
MAX_MESSAGE_BYTES = 512 << 20  # one unary message; larger calls stream (below)
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Calls whose payload is larger than this go as a stream of PIECE_BYTES pieces (RunStream), and so do their
# replies; smaller ones are one unary message each way (cheaper: no per-piece overhead).
STREAM_ABOVE_BYTES = 32 << 20
PIECE_BYTES = 4 << 20
MAX_REPLY_STREAM_BYTES = 1 << 40  # the control plane takes what its own kernels send


def pieces(header: pb.Header, blobs: list) -> Iterator[pb.Piece]:
    """A streamed call or reply: the header, then every blob's bytes in order, PIECE_BYTES at a time."""
    yield pb.Piece(header=header)
    for blob in blobs:
        view = memoryview(blob).cast("B")
        for start in range(0, len(view), PIECE_BYTES):
            yield pb.Piece(data=bytes(view[start : start + PIECE_BYTES]))


class StreamError(ValueError):
    """A streamed call or reply that is malformed or over its size limit."""


def assemble(first: pb.Header, rest: Iterator[pb.Piece], limit: int) -> list[memoryview]:
    """The blobs of a stream whose header is `first`, checked against its declared sizes and `limit` bytes.
    Memory grows with the bytes that actually arrive, never with what a header claims."""
    sizes = list(first.blob_sizes)
    total = sum(sizes)
    if total > limit:
        raise StreamError(f"the stream declares {total} bytes of blobs: at most {limit}")
    buffer = bytearray()
    for piece in rest:
        if piece.WhichOneof("part") != "data":
            raise StreamError("a stream has one header, first")
        if len(buffer) + len(piece.data) > total:
            raise StreamError(f"the stream sent more than the {total} bytes its header declared")
        buffer += piece.data
    if len(buffer) != total:
        raise StreamError(f"the stream ended after {len(buffer)} of the {total} bytes its header declared")
    view, out, at = memoryview(buffer), [], 0
    for size in sizes:
        out.append(view[at : at + size])
        at += size
    return out


class KernelError(RuntimeError):
    """The kernel failed (crashed, unreachable, or raised an internal error)."""

    op = "a call"  # the operation that failed, when the client raised it


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

    def __init__(
        self,
        address: tuple[str, int],
        authkey: bytes | str,
        tls: bool = False,
        root_certificates: bytes | None = None,
        tls_name: str | None = None,
    ):
        self.address = address
        self._call_timeout_s = settings().kernel_call_timeout_s
        self._metadata = ((KEY_METADATA, authkey.decode() if isinstance(authkey, bytes) else authkey),)
        target = grpc_target(*address)
        # tls_name: the name the kernel's certificate must carry, whatever address it is reached at (kernels
        # whose addresses are not known in advance, e.g. Pods, share one certificate for that name).
        options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", tls_name)] if tls and tls_name else [])
        self._channel = (
            grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=options)
            if tls
            else grpc.insecure_channel(target, options=options)
        )
        stub = pb_grpc.KernelStub(self._channel)
        self._run, self._run_stream = stub.Run, stub.RunStream

    def api(self, timeout: float | None = None, order: tuple[str, int] | None = None) -> KernelApi:
        """The kernel's operations as typed methods (blocking, thread-safe), each call with this deadline
        (default $OPENRL_KERNEL_CALL_TIMEOUT_S): `client.api().sample(sampler_id=..., ...)` returns a `SampleOutput`.
        `order`: (lane, number) of the one call made through it (ORDER_METADATA)."""
        return cast(KernelApi, _RemoteKernel(self, timeout, order))

    def ping(self, timeout: float) -> None:
        """Whether the kernel answers at all (KernelError if not): the fleet's liveness check."""
        self.call("ping", timeout=timeout)

    def call(self, op: str, timeout: float | None = None, order: tuple[str, int] | None = None, **kwargs: Any) -> Any:
        """Runs one operation on the kernel and returns its answer as decoded JSON, untyped: the transport under
        `api()`, and what tests of hostile or malformed calls use. Blocking, thread-safe. Raises KernelTimeout
        when no answer comes within `timeout` (default $OPENRL_KERNEL_CALL_TIMEOUT_S). A call over
        STREAM_ABOVE_BYTES streams. `order`: see `api`."""
        metadata = self._metadata if order is None else (*self._metadata, (ORDER_METADATA, f"{order[0]} {order[1]}"))
        try:
            return self._call(op, timeout, kwargs, metadata)
        except KernelError as e:
            e.op = op
            raise

    def _call(self, op: str, timeout: float | None, kwargs: dict[str, Any], metadata: tuple) -> Any:
        deadline = self._call_timeout_s if timeout is None else timeout
        args, blobs = codec.encode(kwargs)
        try:
            if len(args) + sum(len(b) for b in blobs) > STREAM_ABOVE_BYTES:
                status, result, got = self._streamed(op, args, blobs, deadline, metadata)
            else:
                reply = self._run(pb.Call(op=op, args=args, blobs=blobs), timeout=deadline, metadata=metadata)
                status, result, got = reply.status, reply.result, list(reply.blobs)
        except grpc.RpcError as e:
            raise _kernel_error(e, op, deadline, self.address) from None
        try:
            payload = codec.decode(result, got)
        except codec.CodecError as e:
            raise KernelError(f"the kernel's answer to {op} is malformed: {e}") from None
        if status == "ok":
            return payload
        if status == "user":
            raise KernelUserError(payload)
        if status == "not_found":
            raise KernelNotFound(payload)
        raise KernelError(payload)

    def _streamed(
        self, op: str, args: bytes, blobs: list[bytes], deadline: float, metadata: tuple
    ) -> tuple[str, bytes, list]:
        replies = self._run_stream(
            pieces(pb.Header(op=op, json=args, blob_sizes=[len(b) for b in blobs]), blobs),
            timeout=deadline,
            metadata=metadata,
        )
        first = next(replies, None)
        if first is None or first.WhichOneof("part") != "header":
            raise KernelError(f"the kernel's streamed answer to {op} has no header")
        try:
            return first.header.status, first.header.json, assemble(first.header, replies, MAX_REPLY_STREAM_BYTES)
        except StreamError as e:
            raise KernelError(f"the kernel's streamed answer to {op} is malformed: {e}") from None

    def close(self) -> None:
        self._channel.close()


class _RemoteKernel:
    """`KernelApi` over a client: each method sends its keyword arguments and checks the answer against the
    method's result type (a kernel that answers something else is a KernelError, not a KeyError later)."""

    def __init__(self, client: KernelClient, timeout: float | None, order: tuple[str, int] | None = None):
        self._client, self._timeout, self._order = client, timeout, order

    def __getattr__(self, name: str):
        op = OPERATIONS.get(name)
        if op is None:
            raise AttributeError(f"the kernel has no operation {name!r}")
        return lambda **kwargs: self._run(op, kwargs)

    def _run(self, op: Operation, kwargs: dict[str, Any]) -> Any:
        raw = self._client.call(op.name, timeout=self._timeout, order=self._order, **kwargs)
        try:
            return op.parse_result(raw)
        except ValueError as e:
            err = KernelError(f"the kernel's answer to {op.name} does not fit its result type: {e}")
            err.op = op.name
            raise err from None


def _kernel_error(e: grpc.RpcError, op: str, deadline: float, address: tuple[str, int]) -> KernelError:
    code, details = e.code(), e.details()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KernelTimeout(
            f"the kernel did not answer {op} within {deadline:.0f} s; the request was abandoned "
            f"(the kernel may still finish it)"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return KernelError(
            f"kernel at {address[0]}:{address[1]} is unreachable or was lost while running {op}: {details}"
        )
    return KernelError(f"the kernel refused {op}: {code.name}: {details}")
