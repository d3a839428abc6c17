"""`ResidentState` on a CUDA device (`pytest -m cuda`; `make gpu-check` runs it): a real orchestrator (gRPC on
loopback, in this process) whose group is the GPU; eviction goes through the pinned host arena and gives the
device memory back (`torch.cuda.memory_allocated`), restore is bit-exact. Deselected by default, skipped without
a GPU."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from openrl_lab.lab.resident import ResidentState
from openrl_lab.orchestrator import serve_orchestrator
from tests.lab.test_resident import KEYS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

DEV = "cuda"


@pytest.fixture
def orch(tmp_path):
    """The orchestrator, its one group on the GPU (tests/lab/conftest.py's `clients` are its clients)."""
    groups = [{"id": "trainer-group", "devices": ["cuda:0"]}]
    server = serve_orchestrator(
        tmp_path / "o.db", port=0, authenticate=KEYS.get, config={"groups": groups, "holder_timeout_s": 2.0}
    )
    yield server
    server.stop(grace=0)


def make_model(seed: int = 0):
    """~48 MB on the device once trained: 4 x (1024 x 1024) fp32 weights, AdamW's two moments."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(DEV)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model, opt, step: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(1000 + step)
    x = torch.randn(32, 1024, device=DEV, generator=g)
    opt.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # the state between phases: weights and moments
    return loss.detach()


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out |= {f"o{i}.{k}": v.clone() for k, v in st.items()}
    return out


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_an_eviction_frees_the_device_memory_and_the_next_phase_restores_bit_exact(clients):
    model, opt = make_model()
    twin, twin_opt = copy.deepcopy(model), None
    state = ResidentState(clients("a"), "trainer-group", "gpu", announce=None)
    state.register(model, opt, names=["model", "optimizer"])
    with state.phase():
        train_step(model, opt, 0)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own moments: no alias holds the device memory
    before, held = snapshot(model, opt), allocated()
    assert state.nbytes >= 3 * 4 * sum(p.numel() for p in model.parameters())  # weights + two moments

    state._on_evict()  # what the orchestrator's request runs
    freed = held - allocated()
    assert not state.resident and state.swap.arena.pin and state.swap.arena.buffer.is_pinned()
    assert freed >= 0.99 * state.nbytes, f"evicted {state.nbytes} bytes but only {freed} were freed on the device"
    with state.phase() as report:
        assert report.restored is not None and allocated() >= held - (1 << 20)
        after = snapshot(model, opt)
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        assert all(p.is_cuda for p in model.parameters())
        loss = train_step(model, opt, 1)
    assert torch.equal(loss, train_step(twin, twin_opt, 1))  # the same numbers as a run never evicted


def test_a_waiting_job_has_the_gpu_state_moved_after_the_phase(clients):
    model, opt = make_model(1)
    state = ResidentState(clients("a"), "trainer-group", "gpu-wait", priority="batch", announce=None)  # as B
    state.register(model, opt, names=["model", "optimizer"])
    with state.phase():
        train_step(model, opt, 0)
    before, held = snapshot(model, opt), allocated()
    other = clients("b", key="key-bob")
    started = threading.Event()

    def hold():
        with other.on_accelerators("trainer-group", kind="other"):
            started.set()
            time.sleep(0.3)

    with state.phase() as report:
        t = threading.Thread(target=hold, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while not any(L.state == "waiting" for L in other.leases()):
            assert time.monotonic() < deadline, "the other job never queued"
            time.sleep(0.01)
    assert report.evicted is not None and not state.resident
    assert held - allocated() >= 0.99 * state.nbytes
    assert started.wait(10)
    with state.phase() as report:  # waits for b's phase, then restores onto the GPU
        assert report.restored is not None
        after = snapshot(model, opt)
    t.join(10)
    assert all(torch.equal(after[k], before[k]) for k in before)
