"""Every waiting lease and queue entry carries `expected_wait_s`, a rough estimate of its wait (issue 12): the
holder's remaining phase plus the recent mean phase of each job ahead (plus the group's switch cost per
hand-off); None (-1 on the wire) when nothing is known. On the scheduler's fake clock, then over real gRPC."""

from __future__ import annotations

import threading
import time

import pytest

from openrl_lab.orchestrator.scheduler import Scheduler
from tests.orchestrator.conftest import FakeClock
from tests.orchestrator.test_service import wait_for


def make(**cfg):
    clock = FakeClock()
    s = Scheduler(
        {
            "groups": [{"id": "g", "devices": ["d0"], "policy": "fifo", "aliases": ["g-alias"]}],
            "holder_timeout_s": 1000.0,
            "max_phase_s": 0,
            **cfg,
        },
        clock=clock,
    )
    return s, clock


def phase(s, clock, owner, lease, seconds, kind="train"):
    """One phase of `seconds` on the fake clock, nobody else waiting."""
    g = s.acquire(owner, lease, kind, timeout=0)
    clock.advance(seconds)
    s.release(owner, g.slice_id)


def waits(s, viewer="alice"):
    (st,) = s.status(viewer, "g")
    return [e.expected_wait_s for e in st.queue]


def test_a_waiter_behind_a_holder_of_known_phase_length_gets_an_estimate_that_shrinks():
    s, clock = make()
    a = s.create_lease("alice", "g", "holder").lease_id
    b = s.create_lease("bob", "g", "first").lease_id
    c = s.create_lease("carol", "g", "second").lease_id
    for _ in range(3):
        phase(s, clock, "alice", a, 10.0)  # the holder's phases take 10 s
    for lease, owner, length in ((b, "bob", 4.0), (c, "carol", 6.0)):
        phase(s, clock, owner, lease, length)
    held = s.acquire("alice", a, "train", timeout=0)
    tb = s.request("bob", b, "sample")
    tc = s.request("carol", c, "sample")
    clock.advance(2.0)
    first, second = waits(s)
    assert first == pytest.approx(8.0)  # 10 s mean, 2 s run
    assert second == pytest.approx(8.0 + 4.0)  # plus bob's mean phase
    assert second > first > 0
    clock.advance(5.0)
    assert waits(s) == [pytest.approx(3.0), pytest.approx(7.0)]  # shrinks as the holder runs
    # the lease views carry the same numbers, for the waiting ones only
    assert s.get_lease("bob", b).expected_wait_s == pytest.approx(3.0)
    assert s.get_lease("carol", c).expected_wait_s == pytest.approx(7.0)
    assert s.get_lease("alice", a).expected_wait_s is None  # holding: not waiting
    clock.advance(10.0)  # the holder overran its mean (17 s): about as long again as it has run
    assert waits(s) == [pytest.approx(17.0), pytest.approx(21.0)]
    s.release("alice", held.slice_id)
    assert tb.grant is not None and tc.grant is None
    assert waits(s) == [pytest.approx(4.0)]  # carol now waits behind bob's 4 s phase


def test_unknown_phase_lengths_give_no_estimate_and_max_phase_s_bounds_it():
    s, clock = make()
    a = s.create_lease("alice", "g", "new-holder").lease_id
    b = s.create_lease("bob", "g", "waiter").lease_id
    s.acquire("alice", a, "train", timeout=0)
    s.request("bob", b, "sample")
    assert waits(s) == [None]  # nobody has finished a phase here yet: unknown
    assert s.get_lease("bob", b).expected_wait_s is None

    s, clock = make(max_phase_s=30.0)
    a = s.create_lease("alice", "g", "new-holder").lease_id
    b = s.create_lease("bob", "g", "waiter").lease_id
    s.acquire("alice", a, "train", timeout=0)
    s.request("bob", b, "sample")
    clock.advance(12.0)
    assert waits(s) == [pytest.approx(18.0)]  # the group's limit is the bound: 30 s less the 12 s run


def test_switch_costs_count_once_per_hand_off():
    s, clock = make()
    a = s.create_lease("alice", "g", "resident-job").lease_id
    b = s.create_lease("bob", "g", "other-job").lease_id
    for _ in range(2):  # alternate, each keeping state resident: every hand-off evicts (2 s), then restores (1 s)
        for owner, lease in (("alice", a), ("bob", b)):
            t = s.request(owner, lease, "train")
            if t.grant is None:
                other = "bob" if owner == "alice" else "alice"
                clock.advance(2.0)
                s.report_evicted(other, b if owner == "alice" else a)
            assert t.grant is not None
            restore = 1.0 if t.grant.must_restore else 0.0
            clock.advance(restore + 4.0)
            s.release(owner, t.grant.slice_id, keep_resident=True, restore_s=restore)
    assert s.status("alice", "g")[0].evictions >= 3
    t = s.request("alice", a, "train")  # bob is resident: alice waits for its eviction
    assert t.grant is None and s.status("alice", "g")[0].switching
    # the group's mean switch cost over the hand-offs that had one (bob's first: 2 s eviction wait; then 2 s + a
    # 1 s restore each), counted once, less the time the switch has run
    assert waits(s) == [pytest.approx(8 / 3)]
    clock.advance(1.0)
    assert waits(s) == [pytest.approx(5 / 3)]


def test_over_grpc_unknown_is_none_and_a_known_wait_arrives(make_client):
    holder = make_client("holder-job")
    waiter = make_client("waiter-job", key="key-bob")
    for _ in range(2):
        with holder.on_accelerators("trainer-group", kind="warm"):
            threading.Event().wait(0.2)
    with waiter.on_accelerators("trainer-group", kind="warm"):
        pass
    held = holder.acquire("trainer-group", kind="long")
    granted = time.monotonic()
    got = []
    t = threading.Thread(target=lambda: got.append(waiter.acquire("trainer-group", kind="wait", timeout=30)))
    t.start()
    try:
        wait_for(lambda: holder.get_status("trainer-group").queue, what="the waiter to queue")
        (entry,) = holder.get_status("trainer-group").queue
        # ~0.2 s mean phase; once the holder has run longer than that, the estimate is as long again as it has run
        # (a slow machine takes a while to get here), so the bound grows with the time since the grant
        assert entry.expected_wait_s is not None and 0 <= entry.expected_wait_s < 1.0 + (time.monotonic() - granted)
        (mine,) = [L for L in waiter.leases() if L.name == "waiter-job"]
        assert mine.state == "waiting" and mine.expected_wait_s is not None
        (lease,) = [L for L in holder.leases() if L.name == "holder-job"]
        assert lease.expected_wait_s is None  # holding: -1 on the wire, None here
    finally:
        holder.release(held)
        t.join(30)
    waiter.release(got[0])
