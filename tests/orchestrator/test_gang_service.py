"""Gang acquisition over real gRPC: real clients in threads acquire gang slices through a real orchestrator
server on loopback (the hand-off lane included), with a single-device job in between; all finish, no gang is
ever held in part, and a gang phase that cannot be granted fails every rank with the gang's error."""

from __future__ import annotations

import threading

import pytest

from openrl_lab.orchestrator.errors import FailedPrecondition

pytestmark = pytest.mark.server

GANG_GROUPS = [
    {"id": "cpu0", "devices": ["accel:0"]},
    {"id": "cpu1", "devices": ["accel:1"]},
    {"id": "cpu2", "devices": ["accel:2"], "policy": "lrs"},
]


@pytest.mark.parametrize("orch", [{"groups": GANG_GROUPS, "holder_timeout_s": 30.0}], indirect=True)
def test_two_gangs_and_a_single_job_share_three_groups_and_all_finish(orch, make_client):
    lock = threading.Lock()
    holders: dict[str, str] = {}  # group -> job holding it, as the clients see it
    partial: list[str] = []
    done: dict[str, int] = {}
    errors: list[BaseException] = []

    def hold(job: str, groups: list[str]) -> None:
        with lock:
            for g in groups:
                assert g not in holders, f"{g} held by {holders[g]} and granted to {job}"
                holders[g] = job

    def unhold(groups: list[str]) -> None:
        with lock:
            for g in groups:
                holders.pop(g)

    def gang_job(name: str, groups: list[str], key: str) -> None:
        try:
            c = make_client(name, key=key)
            for _ in range(6):
                with c.on_accelerators_gang(groups, kind="forward_backward") as slices:
                    assert [s.group_id for s in slices] == groups
                    hold(name, groups)
                    with lock:
                        if len({s.grant.granted_at for s in slices}) != 1:
                            partial.append(name)  # granted at different moments: a partial grant
                    threading.Event().wait(0.005)
                    unhold(groups)
            done[name] = 6
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    def single_job(name: str, group: str) -> None:
        try:
            c = make_client(name, key="key-bob")
            for _ in range(10):
                with c.on_accelerators(group, kind="forward"):
                    hold(name, [group])
                    threading.Event().wait(0.002)
                    unhold([group])
            done[name] = 10
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [
        threading.Thread(target=gang_job, args=("gang-a", ["cpu0", "cpu1"], "key-alice")),
        threading.Thread(target=gang_job, args=("gang-b", ["cpu1", "cpu2"], "key-bob")),
        threading.Thread(target=single_job, args=("single", "cpu1")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a job never finished (deadlock?)"
    assert errors == []
    assert done == {"gang-a": 6, "gang-b": 6, "single": 10}
    assert partial == []
    a = make_client("viewer")
    recs = [r for g in ("cpu0", "cpu1") for r in a.timeline(g).records if r.job == "gang-a"]
    assert len(recs) == 12 and all(r.gang_size == 2 and r.gang.startswith("gang-a/gang-") for r in recs)
    assert {r.gang for r in recs if r.group_id == "cpu0"} == {r.gang for r in recs if r.group_id == "cpu1"}


@pytest.mark.parametrize(
    "orch", [{"groups": GANG_GROUPS, "holder_timeout_s": 30.0, "gang_assemble_s": 0.5}], indirect=True
)
def test_a_gang_whose_other_rank_never_asks_fails_with_the_gangs_error(orch, make_client):
    c = make_client("lonely")
    with pytest.raises(FailedPrecondition, match=r"gang 'lonely/1' of 2 ranks failed: only 1 of 2 ranks asked"):
        c.acquire("cpu0", kind="forward_backward", gang="lonely/1", gang_size=2)
    # the orchestrator keeps serving: the group is not left reserved
    with c.on_accelerators("cpu0", kind="forward") as s:
        assert s.group_id == "cpu0"


@pytest.mark.parametrize("orch", [{"groups": GANG_GROUPS, "holder_timeout_s": 30.0}], indirect=True)
def test_kernel_gates_run_one_gang_phase_per_rank_with_the_same_key(orch, make_client):
    """What each rank's kernel engine does: `gate.phase(job, kind, gang=(key, n))` on its own group's gate."""
    from openrl_lab.orchestrator.gate import OrchestratorGate

    evicted: list[str] = []
    gates = [
        OrchestratorGate(make_client(f"kernel{i}"), g, on_evict=evicted.append, on_restore=lambda job: None)
        for i, g in enumerate(("cpu0", "cpu1"))
    ]
    grants: list = []

    def rank(gate: OrchestratorGate, step: int) -> None:
        with gate.phase("model-1", "forward_backward", gang=(f"model-1/{step}", 2)) as s:
            grants.append(s.grant)

    for step in range(3):
        threads = [threading.Thread(target=rank, args=(gate, step)) for gate in gates]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert len(grants) == 6
    by_step = [grants[i : i + 2] for i in range(0, 6, 2)]
    assert all({g.group_id for g in pair} == {"cpu0", "cpu1"} for pair in by_step)
    assert all(pair[0].granted_at == pair[1].granted_at for pair in by_step)
    # a single-device job's phase on cpu1 evicts the gang rank's state there (lazy yield works per group)
    with make_client("other").on_accelerators("cpu1", kind="forward"):
        pass
    assert evicted == ["model-1"]
