"""Issue 15 end to end: two real notebook kernels (ipykernel via jupyter_client, on CPU) with their own torch code,
time-sliced at cell boundaries through `%openrl resident` and `%%openrl phase` against a real control plane."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

from openrl_lab.lab import Lab
from tests.lab.helpers import run_in_kernel
from tests.lab.test_resident import solo_losses

ROOT = Path(__file__).resolve().parents[2]

SETUP = """
%load_ext openrl_lab
%openrl connect
import json, time, torch
from tests.lab.test_resident import make_model, train_step
model, optimizer = make_model({seed})
scale = torch.ones(4)
losses, step = [], 0
%openrl resident model optimizer scale --group trainer-group --name {name}
state = get_ipython().magics_manager.registry["OpenRLMagics"].resident
"""
STEP = "%%openrl phase\nlosses.append(train_step(model, optimizer, step)); step += 1"
REPORT = (
    "print('RESULT', json.dumps({'losses': losses, 'evictions': len(state.evictions), "
    "'restores': len(state.restores), 'resident': state.resident}))"
)


def result(kc) -> dict:
    return json.loads(run_in_kernel(kc, REPORT).split("RESULT", 1)[1])


@pytest.fixture
def kernels(lab):
    env = dict(
        os.environ,
        OPENRL_LAB_URL=lab.base_url,
        OPENRL_LAB_API_KEY=lab.api_key,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        OMP_NUM_THREADS="1",
    )
    started = []

    def start():
        km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT), env=env)
        started.append((km, kc))
        return km, kc

    yield start
    for km, kc in started:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


@pytest.fixture
def me(lab):
    lab_client = Lab.connect(lab.base_url, api_key=lab.api_key)
    yield lab_client
    lab_client.close()


def holder(me: Lab) -> str | None:
    h = me.orchestrator.get_status("trainer-group").holder
    return h.job if h is not None else None


def wait_until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_trains_in_phase_cells_while_bs_phase_waits_evicted_restored_same_losses(kernels, me):
    (_, a), (_, b) = kernels(), kernels()
    assert "notebook:ka on default" in run_in_kernel(a, SETUP.format(seed=0, name="ka"))
    run_in_kernel(b, SETUP.format(seed=1, name="kb"))
    for _ in range(3):
        run_in_kernel(a, STEP)
    first = result(a)
    assert first["evictions"] == 0 and first["resident"]  # alone: lazy yield, nothing moved

    b.execute("%%openrl phase\ntime.sleep(2.0); losses.append(train_step(model, optimizer, step))")  # not awaited
    wait_until(lambda: holder(me) == "notebook:kb")  # B has the group: A's state was moved off for it
    assert result(a)["evictions"] == 1 and not result(a)["resident"]
    out = run_in_kernel(a, STEP)  # waits for B's phase, then restores A's state before the cell runs
    assert "phase on trainer-group: waited " in out and "while notebook:kb (cell) held the group" in out
    assert "restored " in out and out.count("\n") == 1  # one line, only because it waited
    for _ in range(2):
        assert run_in_kernel(a, STEP) == ""  # nobody waits any more: nothing is said
    got = result(a)
    assert got["losses"] == solo_losses(6)  # bit-exact state: the same numbers as an uninterrupted run
    assert got["evictions"] == 1 and got["restores"] == 1 and got["resident"]

    # The job is in the views, as notebook:<name>: status, top, the timeline.
    status = run_in_kernel(a, "%openrl status --once")
    assert "notebook:ka" in status and "notebook:kb" in status
    assert "notebook:kb" in run_in_kernel(a, "%openrl top") or holder(me) is None
    tl = me.timeline("trainer-group")
    mine = tl[tl["job"] == "notebook:ka"]
    assert len(mine) == 6 and set(mine["kind"]) == {"cell"} and mine["must_restore"].sum() == 1
    rows = {r["name"]: r for r in me.status()}
    assert rows["notebook:ka"]["state"] in ("idle", "running") and rows["notebook:ka"]["resident"]


def test_a_raising_cell_releases_and_autophase_makes_cells_phases(kernels, me):
    ((_, a),) = (kernels(),)
    run_in_kernel(a, SETUP.format(seed=0, name="kr"))
    out = []
    a.execute_interactive("%%openrl phase\nmodel(torch.ones(1, 16)); 1/0", timeout=60, output_hook=out.append)
    assert "ZeroDivisionError" in json.dumps([m["content"] for m in out])  # shown to the user as usual
    assert holder(me) is None  # released
    last = me.timeline("trainer-group")
    last = last[last["job"] == "notebook:kr"].iloc[-1]
    assert last["outcome"] == "failed" and "ZeroDivisionError" in last["error"]

    run_in_kernel(a, "%openrl autophase on")
    # the slices recorded since: by their sequence number (the timeline is a window of the last 300 s, so counting
    # its rows drops the slices that age out of it in between: the flake issue 50 quotes)
    seen = int(me.timeline("trainer-group")["seq"].max())

    def since() -> list[str]:
        tl = me.timeline("trainer-group")
        return list(tl.loc[tl["seq"] > seen, "job"])

    run_in_kernel(a, "losses.append(train_step(model, optimizer, step)); step += 1")  # names model: a phase
    run_in_kernel(a, "x = 1 + 1")  # names nothing registered: not a phase
    assert since() == ["notebook:kr"]
    run_in_kernel(a, "%openrl autophase off")
    run_in_kernel(a, "losses.append(train_step(model, optimizer, step)); step += 1")
    assert since() == ["notebook:kr"]


def test_a_killed_kernel_frees_the_group_within_the_holder_timeout(kernels, me):
    (km_a, a), (_, b) = kernels(), kernels()
    run_in_kernel(a, SETUP.format(seed=0, name="kdead"))
    run_in_kernel(b, SETUP.format(seed=1, name="kalive"))
    t0 = time.monotonic()
    run_in_kernel(b, STEP)  # what a step in b costs on this machine now, with nobody in the way: the margin below
    step_s = time.monotonic() - t0
    a.execute("%%openrl phase\ntime.sleep(600)")  # holds the group until it dies
    wait_until(lambda: holder(me) == "notebook:kdead")
    timeout_s = next(L.holder_timeout_s for L in me.orchestrator.leases() if L.name == "notebook:kdead")
    km_a.signal_kernel(signal.SIGKILL)  # no release, no goodbye
    t0 = time.monotonic()
    out = run_in_kernel(b, STEP, timeout=timeout_s + 30)
    waited = time.monotonic() - t0
    assert waited < timeout_s + 3.0 + 2 * step_s, (waited, timeout_s, step_s)  # the timeout, not the session's
    assert "phase on trainer-group: waited" in out
    revoked = me.timeline("trainer-group")
    revoked = revoked[revoked["job"] == "notebook:kdead"].iloc[-1]
    assert revoked["outcome"] == "revoked" and "heartbeat" in revoked["error"]
