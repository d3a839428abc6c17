"""A lane's numbered calls run on the kernel in their numbers' order, whatever order they arrive in (real gRPC on
loopback, the real servicer with a table of its own): what lets the gateway send a model's next call while the
previous one runs. The order test never waits out the gap (its bound is raised far past the test's run)."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Protocol

import grpc
import pytest

from openrl_lab.kernel import kernel_pb2 as pb
from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc
from openrl_lab.kernel.api import operations_of
from openrl_lab.kernel.client import KEY_METADATA, ORDER_METADATA, KernelClient
from openrl_lab.kernel.ordering import CallOrder
from openrl_lab.kernel.process import KernelServicer, _server

pytestmark = pytest.mark.server  # starts a kernel gRPC server in this process


class StepApi(Protocol):
    def step(self, *, name: str) -> str: ...


class RecordingEngine:
    """Records the order its steps ran in; a step waits until the test lets it end."""

    def __init__(self):
        self.ran: list[str] = []
        self.finish = threading.Event()

    def step(self, name: str) -> str:
        self.ran.append(name)
        self.finish.wait(30)
        return name


@pytest.fixture
def kernel():
    key = secrets.token_hex(32)
    engine = RecordingEngine()
    servicer = KernelServicer(engine, key.encode(), operations=operations_of(StepApi))
    servicer.order = CallOrder(gap_s=600)
    servicer.ready.set()
    server, port = _server(servicer, "127.0.0.1", 0, None)
    client = KernelClient(("127.0.0.1", port), key)
    yield client, engine, servicer, port, key
    engine.finish.set()
    client.close()
    server.stop(0)


def _send(client: KernelClient, name: str, order: tuple[str, int] | None, out: dict) -> threading.Thread:
    def go():
        out[name] = client.call("step", order=order, name=name)

    t = threading.Thread(target=go)
    t.start()
    return t


def _until(check, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_calls_start_in_their_numbers_order_whatever_order_they_arrive_in(kernel):
    client, engine, servicer, _, _ = kernel
    engine.finish.set()
    out: dict = {}
    third = _send(client, "third", ("lane-a", 3), out)
    second = _send(client, "second", ("lane-a", 2), out)
    time.sleep(0.2)  # both are at the kernel now, waiting for call 1 (not a bound: they may wait longer)
    assert engine.ran == []
    first = _send(client, "first", ("lane-a", 1), out)
    for t in (first, second, third):
        t.join(30)
    assert engine.ran == ["first", "second", "third"]
    assert out == {"first": "first", "second": "second", "third": "third"}
    assert servicer.order.gaps == 0


def test_the_next_call_waits_for_its_predecessors_arrival_not_its_result(kernel):
    """The point of pipelining: call 2 is queued on the compute thread while call 1 still runs."""
    client, engine, servicer, _, _ = kernel
    out: dict = {}
    first = _send(client, "first", ("lane-b", 1), out)
    _until(lambda: engine.ran == ["first"], "call 1 never started")
    second = _send(client, "second", ("lane-b", 2), out)
    _until(lambda: servicer._compute._work_queue.qsize() == 1, "call 2 was not queued behind the running call 1")
    assert engine.ran == ["first"]  # it runs after call 1, on the one compute thread
    engine.finish.set()
    for t in (first, second):
        t.join(30)
    assert engine.ran == ["first", "second"]


def test_lanes_do_not_wait_for_each_other_and_unordered_calls_go_at_once(kernel):
    client, engine, _, _, _ = kernel
    engine.finish.set()
    out: dict = {}
    waiting = _send(client, "lane-c-2", ("lane-c", 2), out)  # its call 1 never comes (the gap is 600 s here)
    other = _send(client, "lane-d-1", ("lane-d", 1), out)
    plain = _send(client, "plain", None, out)
    for t in (other, plain):
        t.join(30)
    assert sorted(engine.ran) == ["lane-d-1", "plain"]
    assert waiting.is_alive()
    _send(client, "lane-c-1", ("lane-c", 1), out).join(30)
    waiting.join(30)
    assert engine.ran[-2:] == ["lane-c-1", "lane-c-2"]


def test_a_call_whose_predecessor_never_comes_goes_after_the_gap(kernel):
    client, engine, servicer, _, _ = kernel
    engine.finish.set()
    servicer.order.gap_s = 0.3
    out: dict = {}
    _send(client, "late", ("lane-e", 2), out).join(30)
    assert engine.ran == ["late"] and servicer.order.gaps == 1
    _send(client, "again", ("lane-e", 2), out).join(30)  # a number already let through goes at once
    assert engine.ran == ["late", "again"] and servicer.order.gaps == 1


@pytest.mark.parametrize(
    "value", ["", "lane", "lane x", "lane 0", "lane -1", " 3", "x" * 129 + " 1", "lane 1" + "0" * 20]
)
def test_a_malformed_order_is_refused_and_names_the_problem(kernel, value):
    _, engine, _, port, key = kernel
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.KernelStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Run(
                pb.Call(op="step", args=b'{"name": "x"}'),
                timeout=10,
                metadata=((KEY_METADATA, key), (ORDER_METADATA, value)),
            )
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "expected '<lane> <number>'" in e.value.details()
        assert engine.ran == []
    finally:
        channel.close()


def test_a_refused_numbered_call_still_passes_its_turn(kernel):
    client, engine, servicer, _, _ = kernel
    engine.finish.set()
    with pytest.raises(Exception, match="name"):
        client.call("step", order=("lane-f", 1), name=7)  # a bad argument: refused before it runs
    out: dict = {}
    _send(client, "next", ("lane-f", 2), out).join(30)
    assert engine.ran == ["next"] and servicer.order.gaps == 0  # it did not wait out the 600 s gap
