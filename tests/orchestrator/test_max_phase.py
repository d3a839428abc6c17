"""A phase may hold its group for at most the group's `max_phase_s` while another job waits (issue 9, item
9): then its slice is revoked, the waiter is granted, and the holder learns why. Alone, it runs as long as
it likes. On the scheduler's fake clock (counted, not timed), then once over real gRPC."""

from __future__ import annotations

import re

import pytest

from openrl_lab.orchestrator import TimeSliceOrchestratorClient
from openrl_lab.orchestrator.config import load_config
from openrl_lab.orchestrator.errors import FailedPrecondition, InvalidArgument
from openrl_lab.orchestrator.scheduler import Scheduler
from tests.orchestrator.conftest import KEYS, FakeClock, config
from tests.orchestrator.test_service import wait_for


def make(**cfg):
    clock = FakeClock()
    s = Scheduler(
        {
            "groups": [{"id": "g", "devices": ["d0"]}, {"id": "free", "devices": ["d1"], "max_phase_s": 0}],
            "holder_timeout_s": 1.0,
            "max_phase_s": 5.0,
            **cfg,
        },
        clock=clock,
    )
    return s, clock


def hold(s, clock, owner, lease, slice_id, seconds):
    """The holder heartbeats every 0.5 s for `seconds` (it is alive: only max_phase_s can take the slice)."""
    for _ in range(int(seconds / 0.5)):
        clock.advance(0.5)
        s.heartbeat(owner, [lease], [slice_id])
        s.tick()


def test_a_phase_past_max_phase_s_is_revoked_when_another_job_waits():
    s, clock = make()
    a = s.create_lease("alice", "g", "long-job").lease_id
    b = s.create_lease("bob", "g", "waiter").lease_id
    ga = s.acquire("alice", a, "train", timeout=0)
    tb = s.request("bob", b, "sample")
    assert "revoked at 5 s" in s.status("bob", "g")[0].queue[0].reason  # the waiter is told the bound
    hold(s, clock, "alice", a, ga.slice_id, 4.5)
    assert tb.grant is None and s.counters("g")["revocations"] == 0
    hold(s, clock, "alice", a, ga.slice_id, 1.0)  # 5.5 s: past the limit, heartbeats or not
    assert tb.grant is not None and tb.grant.must_restore is False
    assert s.status("alice", "g")[0].holder.job == ""  # bob holds it now
    rec = next(r for r in s.timeline("alice", "g").records if r.slice_id == ga.slice_id)
    assert rec.outcome == "revoked" and "max_phase_s 5 s" in rec.error and "another job waited" in rec.error
    assert s.status("alice", "g")[0].revocations == 1
    # the holder learns why: its heartbeat's event and its late release say so
    (event,) = s.heartbeat("alice", [a], [ga.slice_id])
    assert event.type == "revoked" and "max_phase_s" in event.message
    with pytest.raises(FailedPrecondition, match=r"not held any more: .*max_phase_s"):
        s.release("alice", ga.slice_id)
    # the waiter sees that the slice was revoked, not why (that is alice's)
    theirs = next(r for r in s.timeline("bob", "g").records if r.slice_id == ga.slice_id)
    assert (theirs.outcome, theirs.error, theirs.job) == ("revoked", "", "")


def test_without_a_waiter_a_long_phase_is_never_revoked():
    s, clock = make()
    a = s.create_lease("alice", "g", "long-job").lease_id
    ga = s.acquire("alice", a, timeout=0)
    hold(s, clock, "alice", a, ga.slice_id, 60.0)
    assert s.counters("g")["revocations"] == 0
    assert s.release("alice", ga.slice_id).run_s == pytest.approx(60.0)
    assert s.timeline("alice", "g").records[-1].outcome == "ok"


def test_a_waiter_that_comes_after_the_limit_gets_the_group_at_the_next_tick():
    s, clock = make()
    a = s.create_lease("alice", "g", "long-job").lease_id
    b = s.create_lease("bob", "g", "waiter").lease_id
    ga = s.acquire("alice", a, timeout=0)
    hold(s, clock, "alice", a, ga.slice_id, 30.0)
    tb = s.request("bob", b)
    assert tb.grant is None
    s.tick()
    assert tb.grant is not None and s.timeline("alice", "g").records[-2].outcome == "revoked"


def test_a_group_with_no_limit_and_the_limit_in_group_info():
    s, clock = make()
    assert {g.group_id: g.max_phase_s for g in s.list_groups()} == {"g": 5.0, "free": 0.0}
    a = s.create_lease("alice", "free", "long-job").lease_id
    b = s.create_lease("bob", "free", "waiter").lease_id
    ga = s.acquire("alice", a, timeout=0)
    tb = s.request("bob", b)
    hold(s, clock, "alice", a, ga.slice_id, 60.0)
    assert tb.grant is None and "revoked at" not in s.status("bob", "free")[0].queue[0].reason
    s.release("alice", ga.slice_id)
    assert tb.grant is not None


def test_max_phase_s_defaults_to_300_s_and_bad_values_are_refused():
    cfg = load_config({"groups": [{"id": "g", "devices": ["d0"]}, {"id": "h", "devices": ["d1"], "max_phase_s": 20}]})
    assert [cfg.max_phase_for(g) for g in cfg.groups] == [300.0, 20]
    for bad in (-1, float("inf"), "5", True):
        with pytest.raises(InvalidArgument, match="max_phase_s"):
            load_config({"groups": [{"id": "g", "devices": ["d0"], "max_phase_s": bad}]})
    with pytest.raises(InvalidArgument, match="max_phase_s"):
        load_config({"groups": [{"id": "g", "devices": ["d0"]}], "max_phase_s": -1})


@pytest.fixture
def short_phases(tmp_path):
    """A real orchestrator on loopback whose groups allow phases of 0.3 s while someone waits."""
    from openrl_lab.orchestrator import serve_orchestrator

    server = serve_orchestrator(tmp_path / "o.db", port=0, authenticate=KEYS.get, config=config(max_phase_s=0.3))
    yield server
    server.stop(grace=0)


@pytest.mark.server  # the orchestrator gRPC service
def test_over_grpc_an_overlong_phase_loses_the_group_to_a_waiter(short_phases):
    alice = TimeSliceOrchestratorClient(short_phases.target, api_key="key-alice", job="long-job", retry_timeout_s=5)
    bob = TimeSliceOrchestratorClient(short_phases.target, api_key="key-bob", job="waiter", retry_timeout_s=5)
    try:
        held = alice.acquire("trainer-group", kind="train")
        # alice's session keeps heartbeating and she never releases: only the limit can free the group
        got = bob.acquire("trainer-group", kind="sample", timeout=30)
        assert got.group_id == "trainer-group"
        wait_for(lambda: held.slice_id not in alice._held, what="alice's session to hear of the revocation")
        with pytest.raises(FailedPrecondition, match=re.escape("max_phase_s 0.3 s")):
            alice.release(held)
        rec = next(r for r in alice.timeline("trainer-group").records if r.slice_id == held.slice_id)
        assert rec.outcome == "revoked" and "max_phase_s" in rec.error
        status = alice.get_status("trainer-group")
        assert status.group.max_phase_s == pytest.approx(0.3) and status.revocations == 1
        bob.release(got)
    finally:
        alice.close()
        bob.close()
