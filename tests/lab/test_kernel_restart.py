"""A real notebook kernel (ipykernel via jupyter_client) restarted in the middle of a training loop; a fresh
kernel reattaches with `%openrl attach` and finds the run's state and metric history intact."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from jupyter_client.manager import start_new_kernel

from openrl_lab.lab import Lab
from tests.lab.helpers import datum, eval_loss, run_in_kernel

ROOT = Path(__file__).resolve().parents[2]

SETUP = """
%load_ext openrl_lab
%openrl connect
%openrl lease kr-run --rank 4 --seed 5
from tests.lab.helpers import datum, eval_loss, train_steps
data = [datum(run.tokenizer(), "a notebook kernel restarted mid-run")]
"""
LOOP = """
for step in range(100_000):  # runs until the kernel is restarted under it
    train_steps(run, data, 1, start=step)
"""
ATTACH = """
%load_ext openrl_lab
%openrl attach kr-run
from tests.lab.helpers import datum, eval_loss, train_steps
data = [datum(run.tokenizer(), "a notebook kernel restarted mid-run")]
h = run.history()
print("RESULT", json.dumps({"steps": h["step"].tolist(), "eval": eval_loss(run, data)}))
"""


@pytest.fixture
def kernel(lab):
    env = dict(os.environ, OPENRL_LAB_URL=lab.base_url, OPENRL_LAB_API_KEY=lab.api_key)
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT), env=env)
    yield km, kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_restart_mid_loop_then_attach_keeps_state_and_history(lab, kernel):
    km, kc = kernel
    run_in_kernel(kc, SETUP)
    kc.execute(LOOP)  # not awaited: the kernel is restarted while it runs
    me = Lab.connect(lab.base_url, api_key=lab.api_key)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(me.attach("kr-run").history()) < 4:
        time.sleep(0.5)  # waiting for the loop to get going (a condition, not an assertion on time)
    km.restart_kernel(now=True)  # SIGKILL mid-loop, a fresh kernel process
    kc.wait_for_ready(timeout=60)

    seen = me.attach("kr-run")  # the lab's view, from outside the notebook
    data = [datum(seen.tokenizer(), "a notebook kernel restarted mid-run")]
    # A request the dead kernel had in flight (a step, a logged row) may still land: wait until two readings a
    # second apart agree (a condition, however slow the machine), rather than sleep a fixed time.
    view, deadline = None, time.monotonic() + 120
    while time.monotonic() < deadline:
        now = (seen.history()["step"].tolist(), eval_loss(seen, data))
        if now == view:
            break
        view = now
        time.sleep(1.0)
    else:
        raise AssertionError(f"the run kept changing after its notebook kernel died: {view}")
    data_steps, expected = view
    assert len(data_steps) >= 4 and data_steps == list(range(len(data_steps)))

    result = run_in_kernel(kc, "import json\n" + ATTACH)
    got = json.loads(result.split("RESULT", 1)[1])
    assert got["steps"] == data_steps  # history replayed, nothing lost that was logged
    assert got["eval"] == pytest.approx(expected, rel=1e-6)  # the kernel job's trained state, not a fresh one
    fresh = me.lease("kr-fresh", rank=4, seed=5)
    assert eval_loss(fresh, data) > got["eval"]  # a fresh adapter with the same seed is untrained
    # Training goes on from the reattached handle.
    text = run_in_kernel(
        kc,
        f"train_steps(run, data, 2, start={len(data_steps)}); run.flush(); print('STEPS', run.history()['step'].max())",
    )
    assert f"STEPS {len(data_steps) + 1}" in text
    me.release("kr-fresh")
    me.release("kr-run")
    me.close()
