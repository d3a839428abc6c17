"""`ResidentState` (issue 15) without Jupyter: a process's own torch module, optimizer and tensors as one job of a
real orchestrator (gRPC on loopback, in this process), against another job that wants the same group."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from openrl_lab.lab.resident import ResidentState, job_name
from openrl_lab.orchestrator import TimeSliceOrchestratorClient, serve_orchestrator
from openrl_lab.swap import SwapStateError

KEYS = {"key-alice": "alice", "key-bob": "bob"}
GROUPS = [{"id": "trainer-group", "devices": ["cpu"], "aliases": ["default"]}]


@pytest.fixture
def orch(tmp_path):
    server = serve_orchestrator(
        tmp_path / "o.db",
        port=0,
        authenticate=KEYS.get,
        config={"groups": GROUPS, "holder_timeout_s": 1.0, "max_phase_s": 1.0},
    )
    yield server
    server.stop(grace=0)


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train_step(model, opt, step: int) -> float:
    x, y = batch(step)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def snapshot(model, opt, extra) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out |= {f"o{i}.{k}": v.clone() for k, v in st.items()}
    return out | {"extra": extra.clone()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit for bit


def solo_losses(steps: int) -> list[float]:
    model, opt = make_model()
    return [train_step(model, opt, i) for i in range(steps)]


def hold_group(client: TimeSliceOrchestratorClient, seconds: float, started: threading.Event) -> threading.Thread:
    """Another job's phase on the group, from a thread: it queues now and holds the group `seconds` once granted."""

    def run():
        with client.on_accelerators("trainer-group", kind="other"):
            started.set()
            time.sleep(seconds)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_alone_nothing_moves_and_nothing_is_said(clients):
    model, opt = make_model()
    notes = []
    state = ResidentState(clients("a"), "trainer-group", "solo", announce=notes.append)
    state.register(model, opt, names=["model", "optimizer"])
    for i in range(10):
        with state.phase() as report:
            train_step(model, opt, i)
    assert state.evictions == [] and state.restores == [] and state.swap.counters.bytes_moved == 0
    assert notes == [] and report.restored is None  # (no wait, no eviction: the counters above say so)
    info = {L.name: L for L in state.orchestrator.leases()}["notebook:solo"]
    assert info.slices == 10 and info.resident == "device" and info.owner == "alice"
    assert info.priority == "interactive"  # a notebook's state: someone waits on its cells
    batch = ResidentState(clients("a"), "trainer-group", "in-a-loop", priority="batch", announce=None)
    assert batch.lease.priority == "batch"
    batch.close()


def test_a_waiting_job_evicts_after_the_phase_and_the_next_phase_restores_bit_exact(clients):
    steps = 6
    expected = solo_losses(steps)
    model, opt = make_model()
    extra = torch.arange(1000, dtype=torch.float32)
    notes = []
    # batch, as B is: an interactive job that usually comes straight back would be held the group instead
    # (it is next anyway, within its share), and would evict later, on B's request, not after this phase
    state = ResidentState(clients("a"), "trainer-group", "trainer", priority="batch", announce=notes.append)
    state.register(model, opt, extra, names=["model", "optimizer", "extra"])
    weight_obj, moments_obj = model[0].weight, None
    losses = []
    for i in range(3):
        with state.phase():
            losses.append(train_step(model, opt, i))
    moments_obj = opt.state[model[0].weight]["exp_avg"]
    before = snapshot(model, opt, extra)

    other = clients("b", key="key-bob")
    started = threading.Event()
    with state.phase() as report:
        # B asks while A holds: A evicts after this phase. B's 1.5 s hold outlasts any stall of this thread between
        # B's grant and A's next request, so A measurably waits (with 0.3 s, a 0.2 s stall would leave A under 0.1 s)
        t = hold_group(other, 1.5, started)
        wait_until(lambda: other.leases() and any(L.state == "waiting" for L in other.leases()))
        losses.append(train_step(model, opt, 3))
    assert report.evicted is not None and not state.resident
    assert report.evicted.bytes_moved >= sum(v.nbytes for v in before.values()) - extra.nbytes
    with pytest.raises(SwapStateError):
        model(batch(0)[0])  # off the device: the module refuses to run rather than compute on placeholders
    started.wait(5)
    with state.phase() as report:  # waits for B's phase, then restores
        after_restore = snapshot(model, opt, extra)
        losses.append(train_step(model, opt, 4))
    t.join(5)
    assert report.waited_s > 0.1 and report.restored is not None
    assert report.waited_for == ("b (other)",) or report.waited_for == ("another user's job",)
    line = report.wait_line()
    assert line.startswith("phase on trainer-group: waited ") and "restored" in line and line in notes
    with state.phase():
        losses.append(train_step(model, opt, 5))
    assert model[0].weight is weight_obj and opt.state[model[0].weight]["exp_avg"] is moments_obj  # identity kept
    assert losses == expected  # the same numbers as a run that was never interrupted
    assert torch.equal(after_restore["extra"], torch.arange(1000, dtype=torch.float32))
    assert len(state.evictions) == 1 and len(state.restores) == 1


def test_restore_is_bit_exact_for_parameters_optimizer_state_and_tensors(clients):
    model, opt = make_model(3)
    extra = torch.randn(300)
    state = ResidentState(clients("a"), "trainer-group", "exact", announce=None)
    state.register(model, opt, extra, {"k": torch.ones(5)}, names=["model", "optimizer", "extra", "cache"])
    with state.phase():
        for i in range(2):
            train_step(model, opt, i)
    before = snapshot(model, opt, extra)
    state._on_evict()  # what the orchestrator's request runs
    assert not state.resident and all(p.untyped_storage().nbytes() <= 8 for p in model.parameters())
    with state.phase():
        assert_same(snapshot(model, opt, extra), before)
        assert torch.equal(state.objects["cache"]["k"], torch.ones(5))


def test_a_phase_that_raises_still_releases(clients):
    model, _opt = make_model()
    state = ResidentState(clients("a"), "trainer-group", "raiser", announce=None)
    state.register(model, name="model")
    with pytest.raises(ZeroDivisionError), state.phase() as report:
        _ = 1 / 0
    assert report.error.startswith("ZeroDivisionError")
    other = clients("b", key="key-bob")
    s = other.acquire("trainer-group", timeout=2.0)  # free at once
    other.release(s)
    rec = [r for r in state.orchestrator.timeline("trainer-group").records if r.mine][-1]
    assert rec.outcome == "failed" and "ZeroDivisionError" in rec.error


def test_eviction_between_phases_waits_for_the_cell_that_uses_the_state(clients):
    model, opt = make_model()
    state = ResidentState(clients("a"), "trainer-group", "cells", announce=None)
    state.register(model, name="model")
    with state.phase():
        train_step(model, opt, 0)
    other = clients("b", key="key-bob")
    with state.cell():  # a cell using the model outside a phase; B arrives meanwhile
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("s", other.acquire("trainer-group", timeout=10)))
        t.start()
        time.sleep(0.5)
        assert state.resident and "s" not in got  # not in the middle of the cell
        model(batch(0)[0])
    t.join(10)
    assert not state.resident and "s" in got  # right after it
    other.release(got["s"])


def test_a_phase_past_max_phase_s_is_reported_to_its_user_and_revoked_for_the_waiter(clients):
    model, opt = make_model()
    notes = []
    state = ResidentState(clients("a"), "trainer-group", "long", announce=notes.append)
    state.register(model, opt, names=["model", "optimizer"])
    assert state.max_phase_s == 1.0
    other = clients("b", key="key-bob")
    started = threading.Event()
    with state.phase() as report:
        train_step(model, opt, 0)
        before = snapshot(model, opt, torch.zeros(1))
        t = hold_group(other, 0.1, started)
        wait_until(lambda: any(e.reason for e in other.get_status("trainer-group").queue))
        reason = other.get_status("trainer-group").queue[0].reason
        assert "revoked at 1 s" in reason  # the waiter is told the bound
        assert started.wait(5)  # granted while A's phase still runs
    t.join(5)
    assert report.revoked and report.ran_s > 1.0
    assert notes and notes[-1].startswith("warning: this phase ran ") and "max_phase_s (1 s)" in notes[-1]
    assert not state.resident  # moved off at once: nobody would ask for it
    with state.phase():
        assert_same(snapshot(model, opt, torch.zeros(1)), before)


def test_bad_input_is_one_clear_error(clients):
    state = ResidentState(clients("a"), "trainer-group", "bad", announce=None)
    from openrl_lab.lab.connection import LabError

    with pytest.raises(LabError, match="cannot register 'x': a str"):
        state.register("hello", name="x")
    with pytest.raises(LabError, match="group"):
        ResidentState(clients("c"), "no-such-group", "bad2")
    assert job_name("my run!") == "notebook:my-run-"
