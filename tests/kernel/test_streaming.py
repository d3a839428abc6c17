"""Large calls stream over the kernel protocol (real gRPC on loopback): past gRPC's one-message limit, and a
hostile stream is refused while the kernel keeps serving. The kernel here runs a table of its own (an echo
engine), so the test moves big payloads without a model."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np
import pytest

from openrl_lab.kernel import kernel_pb2 as pb
from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc
from openrl_lab.kernel.api import operations_of
from openrl_lab.kernel.client import KEY_METADATA, MAX_MESSAGE_BYTES, KernelClient
from openrl_lab.kernel.process import KernelServicer, _server

pytestmark = pytest.mark.server  # starts a kernel gRPC server in this process


@dataclass
class Echoed:
    value: Any
    nbytes: int | None  # an array's size in bytes, as the kernel got it


class EchoApi(Protocol):
    """The kernel's table here: one operation (`api.operations_of` derives it, as for `api.KernelApi`)."""

    def echo(self, *, value: Any) -> Echoed: ...


class EchoEngine:
    """An engine whose one operation sends back what it got (and how it got it)."""

    def echo(self, value: Any) -> Echoed:
        return Echoed(value, int(value.nbytes) if isinstance(value, np.ndarray) else None)


@pytest.fixture(scope="module")
def kernel():
    key = secrets.token_hex(32)
    servicer = KernelServicer(EchoEngine(), key.encode(), operations=operations_of(EchoApi))
    servicer.ready.set()
    server, port = _server(servicer, "127.0.0.1", 0, None)
    client = KernelClient(("127.0.0.1", port), key)
    yield client, port, key
    client.close()
    server.stop(0)


def test_a_payload_past_the_one_message_limit_streams_both_ways(kernel):
    client, _, _ = kernel
    big = np.arange((MAX_MESSAGE_BYTES >> 2) + (64 << 20 >> 2), dtype=np.float32)  # 576 MiB
    assert big.nbytes > MAX_MESSAGE_BYTES
    out = client.call("echo", value=big)
    assert out["nbytes"] == big.nbytes and np.array_equal(out["value"], big)
    small = client.call("echo", value=np.ones(3, np.int64))  # small calls stay unary
    assert small["value"].tolist() == [1, 1, 1]


def _stream(port: int, key: str, parts: list[pb.Piece]):
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return list(pb_grpc.KernelStub(channel).RunStream(iter(parts), timeout=30, metadata=((KEY_METADATA, key),)))


@pytest.mark.parametrize(
    "parts, code, message",
    [
        ([pb.Piece(data=b"x")], grpc.StatusCode.INVALID_ARGUMENT, "starts with its header"),
        (
            [
                pb.Piece(header=pb.Header(op="echo", json=b'{"value": {"__bytes__": 0}}', blob_sizes=[4])),
                pb.Piece(data=b"123456"),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "more than the 4 bytes",
        ),
        (
            [
                pb.Piece(header=pb.Header(op="echo", json=b'{"value": {"__bytes__": 0}}', blob_sizes=[8])),
                pb.Piece(data=b"1234"),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "ended after 4 of the 8",
        ),
        (
            [pb.Piece(header=pb.Header(op="echo", json=b"{}", blob_sizes=[1 << 62]))],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "at most",
        ),
        (
            [pb.Piece(header=pb.Header(op="echo", json=b"{}")), pb.Piece(header=pb.Header(op="echo"))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "one header",
        ),
        (
            [pb.Piece(header=pb.Header(op="drop_everything", json=b"{}"))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown operation",
        ),
    ],
)
def test_hostile_streams_are_refused_and_the_kernel_keeps_serving(kernel, parts, code, message):
    client, port, key = kernel
    with pytest.raises(grpc.RpcError) as err:
        _stream(port, key, parts)
    assert err.value.code() == code and message in err.value.details(), err.value.details()
    assert client.call("echo", value="still here")["value"] == "still here"


def test_a_stream_without_the_key_is_refused_before_it_is_read(kernel):
    _, port, _ = kernel
    with pytest.raises(grpc.RpcError) as err:
        _stream(port, "not-the-key", [pb.Piece(header=pb.Header(op="echo", json=b"{}"))])
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_streamed_bytes_value_comes_back_as_bytes(kernel):
    client, _, _ = kernel
    payload = secrets.token_bytes(40 << 20)  # over the streaming threshold
    assert client.call("echo", value=payload)["value"] == payload
