"""What one user sees of another's jobs, over real gRPC: that slices ran (so duty cycles are whole), never
their lease, job or phase names (issue 9, 4a). Every message the other user receives is searched for them."""

from __future__ import annotations

import threading

import grpc
import pytest

from openrl_lab.orchestrator import orchestrator_pb2 as pb
from openrl_lab.orchestrator import orchestrator_pb2_grpc as pb_grpc
from tests.orchestrator.test_service import wait_for

SECRETS = ("alice-secret-job", "alice_secret_phase", "alice secret error")
BOB = (("x-api-key", "key-bob"),)


def leaks(messages) -> list[str]:
    """The secrets found anywhere in these protobuf messages (their text form covers every field)."""
    text = "\n".join(str(m) for m in messages)
    return [s for s in SECRETS if s in text]


@pytest.fixture
def bob_stub(orch):
    channel = grpc.insecure_channel(orch.target)
    yield pb_grpc.TimeSliceOrchestratorStub(channel)
    channel.close()


def test_another_user_sees_slices_and_busy_time_but_never_names(orch, make_client, bob_stub):
    alice = make_client("alice-secret-job")
    bob = make_client("bob-job", key="key-bob")
    bob_evicts = []
    bob.register("trainer-group", on_evict=bob_evicts.append)  # bob keeps state: he gets evict events
    seen = []  # every message bob receives

    watch = bob_stub.WatchTimeline(pb.WatchTimelineRequest(group_id="trainer-group"), metadata=BOB)

    def read_watch():
        try:
            for rec in watch:
                seen.append(rec)
        except grpc.RpcError:  # cancelled at the end of the test
            pass

    threading.Thread(target=read_watch, daemon=True).start()
    wait_for(lambda: len(orch.scheduler._timeline_subs) == 1, what="bob's watch to subscribe")

    # bob holds while alice waits with her chosen phase name: her queue entry is anonymous
    held = bob.acquire("trainer-group", kind="bob_phase")
    waiting = threading.Thread(target=lambda: alice.release(alice.acquire("trainer-group", kind="alice_secret_phase")))
    waiting.start()
    wait_for(lambda: len(bob.get_status("trainer-group").queue) == 1, what="alice to queue")
    status = bob_stub.GetStatus(pb.GetStatusRequest(group_id="trainer-group"), metadata=BOB)
    seen.append(status)
    (entry,) = status.groups[0].queue
    assert (entry.job, entry.kind, entry.mine) == ("", "", False) and entry.lease_ref
    bob.release(held)  # alice is waiting: bob evicts (an event on his session), then alice runs
    waiting.join(10)
    assert len(bob_evicts) == 1 and not leaks([pb.LeaseEvent(message=bob_evicts[0].message)])

    # alice holds with a user-chosen kind while bob waits; then a server kind; then a failed phase
    with alice.on_accelerators(group_id="trainer-group", kind="alice_secret_phase"):
        t = threading.Thread(target=lambda: bob.release(bob.acquire("trainer-group", kind="bob_phase")))
        t.start()
        wait_for(lambda: len(bob.get_status("trainer-group").queue) == 1, what="bob to queue")
        status = bob_stub.GetStatus(pb.GetStatusRequest(group_id="trainer-group"), metadata=BOB)
        seen.append(status)
        g = status.groups[0]
        assert (g.holder.job, g.holder.kind, g.holder.mine) == ("", "", False)
        assert g.queue[0].mine and "another user's job" in g.queue[0].reason
    t.join(10)
    with alice.on_accelerators(group_id="trainer-group", kind="forward_backward"):
        pass
    with pytest.raises(RuntimeError), alice.on_accelerators(group_id="trainer-group", kind="alice_secret_phase"):
        raise RuntimeError("alice secret error")

    timeline = bob_stub.GetTimeline(pb.GetTimelineRequest(group_id="trainer-group"), metadata=BOB)
    seen += [timeline, bob_stub.ListLeases(pb.ListLeasesRequest(), metadata=BOB)]
    wait_for(
        lambda: sum(r.outcome != "running" for r in seen if isinstance(r, pb.SliceRecord)) == 6,
        what="the watch to stream every slice's end",
    )
    watch.cancel()
    assert leaks(seen) == []

    # What bob may see of alice's slices is all there: when, how long, the outcome, a server-named kind
    theirs = [r for r in timeline.records if not r.mine]
    assert [(r.kind, r.outcome, r.error) for r in theirs] == [
        ("", "ok", ""),
        ("", "ok", ""),
        ("forward_backward", "ok", ""),
        ("", "failed", ""),
    ]
    assert len({r.lease_ref for r in theirs}) == 1 and all(r.job == "" and r.granted_at for r in theirs)
    # ... and alice sees her own in full
    own = [r for r in alice.timeline("trainer-group").records if r.mine]
    assert [r.kind for r in own][-2:] == ["forward_backward", "alice_secret_phase"]
    assert own[-1].job == "alice-secret-job" and "alice secret error" in own[-1].error
    # busy time counts everyone's slices, whoever looks: the duty cycle is the same for both
    since = timeline.records[0].granted_at
    mine = alice.timeline("trainer-group", since=since).duty
    other = bob.timeline("trainer-group", since=since).duty
    assert other.slices == mine.slices == 6 and other.busy_s == pytest.approx(mine.busy_s) and other.busy_s > 0
