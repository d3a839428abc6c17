"""Service identities over real gRPC: leases created on a user's behalf (owned by the user, driven by the
service), processes that name themselves (a new incarnation drops what a dead one left on the device),
and evict requests that say whether the waiting job runs in the same process."""

from __future__ import annotations

import grpc
import pytest

from openrl_lab.orchestrator import (
    FailedPrecondition,
    InvalidArgument,
    OrchestratorGate,
    PermissionDenied,
    ResourceExhausted,
    ServiceOrchestratorClient,
    TimeSliceOrchestratorClient,
    serve_orchestrator,
)
from openrl_lab.orchestrator import orchestrator_pb2 as pb
from openrl_lab.orchestrator import orchestrator_pb2_grpc as pb_grpc
from tests.orchestrator.conftest import config, free_port

pytestmark = pytest.mark.server  # starts the orchestrator gRPC service

KEYS = {"key-alice": "alice", "key-bob": "bob", "key-svc": "svc"}


@pytest.fixture
def start(tmp_path):
    servers, clients = [], []

    def serve(port: int = 0, **overrides):
        s = serve_orchestrator(
            tmp_path / "orchestrator.db",
            port=port,
            authenticate=KEYS.get,
            service_users={"svc"},
            config=config(**overrides),
        )
        servers.append(s)
        return s

    def client(server, key: str, job: str = "job", **kw) -> TimeSliceOrchestratorClient:
        # a service's client whenever it names what only services may (the orchestrator checks the key)
        cls = ServiceOrchestratorClient if kw else TimeSliceOrchestratorClient
        c = cls(server.target, api_key=key, job=job, retry_timeout_s=5, **kw)
        clients.append(c)
        return c

    yield serve, client
    for c in clients:
        c.close()
    for s in servers:
        s.stop(0).wait(5)


def test_only_service_identities_create_leases_on_behalf_of_users(start):
    serve, client = start
    orch = serve(max_leases_per_user=2)
    with pytest.raises(PermissionDenied, match="'alice' may not create leases on behalf of another user"):
        client(orch, "key-alice", on_behalf_of="bob").lease("trainer-group", "sneaky")
    assert client(orch, "key-bob").leases() == []

    svc_for_alice = client(orch, "key-svc", on_behalf_of="alice")
    info = svc_for_alice.lease("trainer-group", "alice-run")
    assert (info.owner, info.driven_by, info.name) == ("alice", "svc", "alice-run")
    alice, bob = client(orch, "key-alice", job="probe"), client(orch, "key-bob", job="probe")
    assert [(L.name, L.owner, L.driven_by) for L in alice.leases()] == [("alice-run", "alice", "svc")]
    assert bob.leases() == []
    assert alice.get_status("trainer-group").slices == 0
    # The service drives it; the owner sees it as hers on the timeline, another user does not.
    with svc_for_alice.on_accelerators(group_id="trainer-group", kind="forward_backward", lease="alice-run"):
        assert alice.get_status("trainer-group").holder.job == "alice-run"
        assert bob.get_status("trainer-group").holder.job == ""
    assert [(r.job, r.mine) for r in alice.timeline("trainer-group").records] == [("alice-run", True)]
    assert [(r.job, r.mine) for r in bob.timeline("trainer-group").records] == [("", False)]
    # One lease has one driver: the owner cannot drive the service's lease by reattaching to its name.
    with pytest.raises(FailedPrecondition, match="driven by the service 'svc'"):
        alice.lease("trainer-group", "alice-run")
    # By id: another user cannot touch it at all, the owner can read it but not drive it.
    stub = pb_grpc.TimeSliceOrchestratorStub(grpc.insecure_channel(orch.target))
    for key, call, request in (
        ("key-bob", stub.GetLease, pb.GetLeaseRequest(lease_id=info.lease_id)),
        ("key-bob", stub.CloseLease, pb.CloseLeaseRequest(lease_id=info.lease_id)),
        ("key-alice", stub.CloseLease, pb.CloseLeaseRequest(lease_id=info.lease_id)),
        ("key-alice", stub.Acquire, pb.AcquireRequest(lease_id=info.lease_id, kind="x")),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call(request, metadata=(("x-api-key", key),), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, (key, call)
    assert (
        stub.GetLease(
            pb.GetLeaseRequest(lease_id=info.lease_id), metadata=(("x-api-key", "key-alice"),), timeout=10
        ).owner
        == "alice"
    )
    # The owner's limits apply to the leases made for her, not to the service's own.
    svc_for_alice.lease("trainer-group", "alice-run-2")
    with pytest.raises(ResourceExhausted, match="user 'alice' already has 2 leases"):
        svc_for_alice.lease("trainer-group", "alice-run-3")
    with pytest.raises(ResourceExhausted, match="user 'alice'"):
        alice.lease("trainer-group", "her-own")
    assert client(orch, "key-svc", on_behalf_of="bob").lease("trainer-group", "bob-run").owner == "bob"
    # A quota set on the lease counts the device time of the service's phases for her job.
    capped = svc_for_alice.lease("trainer-group", "alice-run-2", quota_s=1e-6)
    assert capped.reattached and capped.quota_s == 1e-6
    with svc_for_alice.on_accelerators(group_id="trainer-group", lease="alice-run-2"):
        pass
    with pytest.raises(ResourceExhausted, match="'alice-run-2' has used its quota"):
        svc_for_alice.acquire("trainer-group", lease="alice-run-2")


def test_a_new_incarnation_drops_what_a_dead_one_left_on_the_device(start):
    serve, client = start
    port = free_port()
    orch = serve(port=port, holder_timeout_s=10.0)
    # A kernel that keeps its job's state on the device between phases (raw calls: it will die without a word),
    stub = pb_grpc.TimeSliceOrchestratorStub(grpc.insecure_channel(orch.target))
    md = (("x-api-key", "key-svc"), ("x-openrl-instance", "kernel-x"), ("x-openrl-incarnation", "dead-one"))
    lease = stub.CreateLease(
        pb.CreateLeaseRequest(group_id="trainer-group", name="alice-job", on_behalf_of="alice"), metadata=md
    )
    grant = stub.Acquire(pb.AcquireRequest(lease_id=lease.lease_id, kind="forward_backward"), metadata=md)
    stub.Release(pb.ReleaseRequest(slice_id=grant.slice_id, keep_resident=True), metadata=md)
    # ... and a user's own script that keeps state on the other group and lives on across the restart.
    script = client(orch, "key-bob", job="notebook")
    script_evicts = []
    script.register("sampler-group", on_evict=lambda: script_evicts.append(1))
    with script.on_accelerators(group_id="sampler-group"):
        pass
    # The control plane restarts: the orchestrator comes back from SQLite; the kernel is replaced by a new one.
    orch.stop(0).wait(5)
    orch = serve(port=port, holder_timeout_s=10.0)
    alice = client(orch, "key-alice", job="probe")
    assert [L.resident for L in alice.leases()] == ["device"]  # recorded by the dead kernel
    new = client(orch, "key-svc", job="kernel-x", instance="kernel-x")
    assert new.drop_stale_residency() == (1, 0)
    assert new.drop_stale_residency() == (0, 0)
    assert alice.leases() == []  # the lease the dead kernel made for alice's job died with it
    # A job that comes next does not wait for the dead kernel to evict: no switch at all.
    waiter = client(orch, "key-alice", job="next")
    s = waiter.acquire("trainer-group", timeout=30)
    assert s.grant.switch_wait_s == 0.0 and s.grant.waited_s < orch.scheduler.config.holder_timeout_s
    waiter.release(s)
    rec = alice.timeline("trainer-group").records[-1]
    assert rec.job == "next" and rec.evict_s == 0.0 and alice.get_status("trainer-group").evictions == 0
    # The script named no instance: its residency is untouched, and once it has reconnected it is asked to
    # evict, as before.
    other = client(orch, "key-alice", job="sampler")
    with other.on_accelerators(group_id="sampler-group", timeout=60):
        pass
    assert script_evicts == [1]
    with pytest.raises(ValueError, match="instance="):  # a service client that named no process
        client(orch, "key-svc", job="nameless", on_behalf_of="alice").drop_stale_residency()
    with pytest.raises(InvalidArgument, match="incarnation must be a non-empty"):
        new._rpc("DropStaleResidency", pb.DropStaleResidencyRequest(instance="kernel-x"))


def test_evict_requests_tell_a_kernel_whether_the_waiter_is_its_own_job(start):
    serve, client = start
    orch = serve()
    evicted, shared = [], []
    incarnation = "inc-1"

    def client_for(owner=None):
        return client(orch, "key-svc", job="kernel-a", instance="kernel-a", incarnation=incarnation, on_behalf_of=owner)

    gate = OrchestratorGate(
        client_for(),
        "trainer-group",
        on_evict=evicted.append,
        on_restore=lambda job: None,
        on_evict_shared=lambda: shared.append(len(evicted)),
        client_for=client_for,
    )
    gate.bind("m1", owner="alice", lease="alice-exp")
    gate.bind("m2", owner="bob")
    with gate.phase("m1", "forward_backward"):
        pass
    with gate.phase("m2", "forward_backward"):  # the same kernel's job waits: adapters move, the base stays
        pass
    assert evicted == ["m1"] and shared == []
    assert [(L.name, L.owner) for L in client(orch, "key-alice", job="p").leases()] == [("alice-exp", "alice")]
    assert [(L.name, L.owner) for L in client(orch, "key-bob", job="p").leases()] == [("m2", "bob")]
    other = client(orch, "key-svc", job="kernel-b", instance="kernel-b")  # another kernel's job waits
    with other.on_accelerators(group_id="trainer-group", lease="b1"):
        pass
    assert evicted == ["m1", "m2"] and shared == [2]  # the base went too, after m2's own state
    gate.forget("m1")
    assert client(orch, "key-alice", job="p").leases() == []


def test_leases_made_for_users_end_with_the_process_that_made_them(start):
    """A kernel's jobs die with it: the leases it made on users' behalf must not pile up against the users'
    limit (or keep a share of the group) after it is replaced."""
    serve, client = start
    orch = serve(max_leases_per_user=3)
    alice = client(orch, "key-alice", job="probe")
    alice.lease("sampler-group", "her-own")  # a lease alice drives herself is not the kernel's
    old = client(orch, "key-svc", job="kernel-y", instance="kernel-y", on_behalf_of="alice")
    for i in range(2):
        old.lease("trainer-group", f"run-{i}")
    with pytest.raises(ResourceExhausted, match="already has 3 leases"):
        old.lease("trainer-group", "run-2")
    old.close()
    new = client(orch, "key-svc", job="kernel-y", instance="kernel-y")  # a new incarnation of kernel-y
    new.drop_stale_residency()
    assert sorted(L.name for L in alice.leases()) == ["her-own"]
    again = client(
        orch, "key-svc", job="kernel-y", instance="kernel-y", on_behalf_of="alice", incarnation=new.incarnation
    )
    for i in range(2):
        again.lease("trainer-group", f"run-{i}")
    assert sorted(L.name for L in alice.leases()) == ["her-own", "run-0", "run-1"]
    new.drop_stale_residency()  # the same incarnation again: its own leases stay
    assert len(alice.leases()) == 3


def test_a_users_client_has_no_service_calls():
    """The user API is llm-d's calls and what the notebook reads; acting for others is the service client's."""
    import inspect

    params = inspect.signature(TimeSliceOrchestratorClient).parameters
    assert not {"on_behalf_of", "instance", "incarnation"} & set(params)
    assert not hasattr(TimeSliceOrchestratorClient, "drop_stale_residency")
    assert {"on_behalf_of", "instance", "incarnation"} <= set(inspect.signature(ServiceOrchestratorClient).parameters)
