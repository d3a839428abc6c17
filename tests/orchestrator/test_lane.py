"""The hand-off lane (`orchestrator/lane.py`): a phase's Acquire and Release go on it, one round trip each and
none over gRPC; the waiter is woken by the grant; it keeps the gRPC calls' identity rules and errors; hostile
input closes only its own connection; a caller that goes away (or is interrupted) is withdrawn; and a client
falls back to gRPC when there is no lane."""

from __future__ import annotations

import collections
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import pytest

from openrl_lab.orchestrator import FailedPrecondition, NotFound, TimeSliceOrchestratorClient, Unauthenticated, service
from openrl_lab.orchestrator import client as client_mod
from openrl_lab.orchestrator import lane as lane_mod
from openrl_lab.orchestrator import orchestrator_pb2 as pb
from openrl_lab.orchestrator import orchestrator_pb2_grpc as pb_grpc
from openrl_lab.orchestrator import scheduler as scheduler_mod
from tests.orchestrator.conftest import config
from tests.orchestrator.test_service import wait_for

pytestmark = pytest.mark.server  # starts the orchestrator gRPC service and its lane

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls each path makes: gRPC handlers by name, lane requests by servicer method. (Ask for it
    before `orch`: a server registers its handlers when it starts.)"""
    calls = collections.Counter()
    for name in ("Acquire", "Release", "ReportEvicted"):
        grpc_handler = getattr(service.OrchestratorServicer, name)

        def counting(self, request, context, _h=grpc_handler, _n=name):
            calls["grpc." + _n] += 1
            return _h(self, request, context)

        monkeypatch.setattr(service.OrchestratorServicer, name, counting)
    serve = lane_mod.LaneServer._serve

    def serve_counting(self, conn):
        calls["lane.connections"] += 1
        return serve(self, conn)

    monkeypatch.setattr(lane_mod.LaneServer, "_serve", serve_counting)
    for name in ("acquire", "release", "report_evicted"):
        core = getattr(service.OrchestratorServicer, name)

        def counting_core(self, user, request, process, context=None, alive=None, _c=core, _n=name):
            calls[("lane." if alive is not None else "core.") + _n] += 1  # only the lane passes `alive`
            kw = {"context": context} if _n == "acquire" else {}
            return _c(self, user, request, process, alive=alive, **kw)

        monkeypatch.setattr(service.OrchestratorServicer, name, counting_core)
    return calls


def token(server, key: str = "key-alice") -> bytes:
    with grpc.insecure_channel(server.target) as channel:
        r = pb_grpc.TimeSliceOrchestratorStub(channel).GetLane(pb.GetLaneRequest(), metadata=(("x-api-key", key),))
    assert (r.host, r.port) == (server.lane.host, server.lane.port) and len(r.token) == 32
    return r.token


def raw_lane(server, key: str = "key-alice") -> socket.socket:
    sock = socket.create_connection((server.lane.host, server.lane.port), timeout=10)
    lane_mod.send_frame(sock, lane_mod.HELLO, pb.LaneHello(token=token(server, key)).SerializeToString())
    assert lane_mod.recv_frame(sock, 10, 10)[0] == lane_mod.HELLO | lane_mod.ANSWER
    return sock


def test_a_phase_is_one_lane_round_trip_each_way_and_no_grpc_call(counted, tmp_path):
    keys = {"key-alice": "alice"}
    server = service.serve_orchestrator(tmp_path / "o.db", port=0, authenticate=keys.get, config=config())
    try:
        c = TimeSliceOrchestratorClient(server.target, api_key="key-alice", job="fast")
        with c.on_accelerators(group_id="trainer-group"):
            pass
        counted.clear()

        @c.on_accelerators(group_id="trainer-group")
        def step():
            return 1

        assert [step() for _ in range(5)] == [1] * 5
        assert counted == {"lane.acquire": 5, "lane.release": 5}  # no gRPC Acquire/Release, no new connection
        # A client told not to use the lane makes the same calls over gRPC.
        slow = TimeSliceOrchestratorClient(server.target, api_key="key-alice", job="slow", lane=False)
        with slow.on_accelerators(group_id="trainer-group"):
            pass
        assert counted["grpc.Acquire"] == counted["grpc.Release"] == 1 and counted["lane.acquire"] == 5
        # The key is checked at every lane request, as at every gRPC call: a revoked key stops at once.
        del keys["key-alice"]
        with pytest.raises(Unauthenticated, match="not recognized"):
            step()
        slow.close()
        c.close()
    finally:
        server.stop(0)


def test_the_waiter_is_woken_by_the_grant_not_by_a_poll(orch, make_client, monkeypatch):
    # The lane's only poll (is the caller still there?) is made useless: a hand-off must still happen at once.
    monkeypatch.setattr(scheduler_mod, "ALIVE_CHECK_S", 3600.0)
    a, b = make_client("a"), make_client("b")
    held = a.acquire("trainer-group")
    got = []
    t = threading.Thread(target=lambda: got.append(b.acquire("trainer-group")))
    t.start()
    wait_for(lambda: orch.scheduler.counters("trainer-group")["waiting"] == 1, what="b to queue")
    a.release(held)
    t.join(20)  # a poll would leave it waiting an hour
    assert not t.is_alive() and got and got[0].slice_id
    b.release(got[0])


def test_lane_errors_are_the_grpc_errors(orch, make_client):
    c = make_client("errs")
    s = c.acquire("trainer-group")
    assert c._lane is not None  # the calls below go on the lane
    with pytest.raises(FailedPrecondition, match="already holds slice"):
        c.acquire("trainer-group")
    bob = make_client("errs", key="key-bob")
    with pytest.raises(NotFound, match="not held by any of your leases"):
        bob.release(s.slice_id)
    c.release(s)
    with pytest.raises(FailedPrecondition, match="not held any more"):
        c.release(s.slice_id)
    with pytest.raises(FailedPrecondition, match="no eviction"):
        c.report_evicted(s.lease_id, switch_id=7)


def test_hostile_lane_input_closes_only_that_connection(orch, make_client, monkeypatch):
    monkeypatch.setattr(lane_mod, "HELLO_TIMEOUT_S", 0.2)
    monkeypatch.setattr(lane_mod, "FRAME_TIMEOUT_S", 0.2)
    host, port = orch.lane.host, orch.lane.port

    def closed(payload: bytes | None, hello: bool = False) -> bool:
        sock = raw_lane(orch) if hello else socket.create_connection((host, port), timeout=10)
        try:
            if payload is not None:
                sock.sendall(payload)
            while True:  # an error frame may come first; then the end
                if not sock.recv(4096):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
        finally:
            sock.close()

    assert closed(b"\xff\xff\xff\xff\x02")  # a frame over the limit
    assert closed(b"\x00\x00\x00\x05\x02abcd")  # a request before the hello
    assert closed(b"\x00\x00\x00\x04\x01\xff\xfe\xfd")  # a hello that does not parse
    hello = pb.LaneHello(token=b"x" * 32).SerializeToString()
    assert closed(lane_mod._HEAD.pack(1 + 3, lane_mod.HELLO) + hello[:3])  # a truncated hello
    assert closed(lane_mod._HEAD.pack(1 + len(hello), lane_mod.HELLO) + hello[:3])  # one that stalls half-way
    assert closed(None)  # no hello at all
    assert closed(b"\x00\x00\x00\x01\x09", hello=True)  # an unknown request type
    assert closed(b"\x00\x00\x00\x04\x02\xff\xff\xff", hello=True)  # a request that does not parse
    # A token GetLane never gave: an UNAUTHENTICATED answer, then the end. (The hello never carries a key.)
    bad = socket.create_connection((host, port), timeout=10)
    lane_mod.send_frame(bad, lane_mod.HELLO, pb.LaneHello(token=token(orch)[::-1]).SerializeToString())
    kind, body = lane_mod.recv_frame(bad, 10, 10)
    assert kind == lane_mod.ERROR and pb.LaneError.FromString(body).code == "UNAUTHENTICATED"
    assert bad.recv(1) == b""
    bad.close()
    with pytest.raises(grpc.RpcError) as e:  # and GetLane gives tokens to known keys only
        token(orch, "wrong")
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # and the lane still serves everyone else
    c = make_client("after")
    with c.on_accelerators(group_id="trainer-group") as s:
        assert s.slice_id
    assert c._lane is not None


def test_a_caller_that_goes_away_while_waiting_is_withdrawn(orch, make_client, monkeypatch):
    monkeypatch.setattr(scheduler_mod, "ALIVE_CHECK_S", 0.02)
    holder, waiter = make_client("holder"), make_client("waiter")
    held = holder.acquire("trainer-group")
    lease = waiter.lease("trainer-group")
    sock = raw_lane(orch)
    lane_mod.send_frame(
        sock, lane_mod.ACQUIRE, pb.AcquireRequest(lease_id=lease.lease_id, kind="x").SerializeToString()
    )
    wait_for(lambda: orch.scheduler.counters("trainer-group")["waiting"] == 1, what="the raw waiter to queue")
    sock.close()
    wait_for(lambda: orch.scheduler.counters("trainer-group")["waiting"] == 0, what="the waiter to be withdrawn")
    holder.release(held)
    with waiter.on_accelerators(group_id="trainer-group") as s:  # the lease is free to ask again
        assert s.slice_id


def test_an_interrupted_acquire_is_withdrawn_on_the_server(orch, make_client):
    holder = make_client("holder")
    held = holder.acquire("trainer-group")
    script = textwrap.dedent(f"""
        import signal, sys, time
        # Ctrl-C raises KeyboardInterrupt, as in a terminal or a notebook kernel, even when this test runs in a
        # background job (`make test &`, nohup), whose children inherit SIGINT ignored and would never see it
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from openrl_lab.orchestrator import TimeSliceOrchestratorClient
        c = TimeSliceOrchestratorClient({orch.target!r}, api_key="key-alice", job="interrupted")
        c.lease("trainer-group")
        print("waiting", flush=True)
        try:
            c.acquire("trainer-group")
        except KeyboardInterrupt:
            print("interrupted", c._lane is not None, flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    try:
        assert p.stdout.readline().strip() == "waiting"
        wait_for(lambda: orch.scheduler.counters("trainer-group")["waiting"] == 1, what="the child to queue")
        p.send_signal(signal.SIGINT)
        line = p.stdout.readline().strip()
        assert line == "interrupted True", (line, p.poll(), "" if p.poll() is None else p.stderr.read()[-3000:])
        # withdrawn while the child process still lives (not because it exited)
        wait_for(lambda: orch.scheduler.counters("trainer-group")["waiting"] == 0, what="the withdrawal")
        assert p.poll() is None
    finally:
        p.kill()
        p.wait(10)
        holder.release(held)


def test_without_a_lane_the_client_uses_grpc(counted, tmp_path):
    server = service.serve_orchestrator(None, port=0, config=config(), lane=False)
    try:
        c = TimeSliceOrchestratorClient(server.target, job="plain")
        for _ in range(2):
            with c.on_accelerators(group_id="trainer-group"):
                pass
        assert c._lane is None
        assert counted["grpc.Acquire"] == counted["grpc.Release"] == 2 and not counted["lane.connections"]
        c.close()
    finally:
        server.stop(0)


def test_a_lane_that_breaks_falls_back_to_grpc(counted, orch, make_client, monkeypatch):
    monkeypatch.setattr(client_mod, "LANE_RETRY_S", 0.0)  # look for the lane again at the next call
    c = make_client("breaks")
    with c.on_accelerators(group_id="trainer-group"):
        pass
    lane = c._lane
    for sock in lane._idle:  # as if the orchestrator had dropped the connection
        sock.shutdown(socket.SHUT_RDWR)
    counted.clear()
    with c.on_accelerators(group_id="trainer-group") as s:
        assert s.slice_id
    # the broken lane's acquire went over gRPC, and the lane was found again for the release
    assert counted == {"grpc.Acquire": 1, "core.acquire": 1, "lane.connections": 1, "lane.release": 1}
    assert c._lane is not None and c._lane is not lane
    # A token the orchestrator forgot: the hello is refused, the call goes over gRPC, and a new token is asked for.
    orch.lane._tokens.clear()
    for sock in c._lane._idle:
        sock.close()
    c._lane._idle.clear()
    counted.clear()
    with c.on_accelerators(group_id="trainer-group"):
        pass
    assert counted == {"grpc.Acquire": 1, "core.acquire": 1, "lane.connections": 2, "lane.release": 1}
