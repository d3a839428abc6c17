"""Runs end with their sessions: a finished, silent or killed client's runs leave the kernel (their
checkpoints stay and bring them back), and a killed client's long forward_backward stops early instead of
keeping the group busy for others."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import tinker
from tinker import types

from openrl_lab.server import LabServer
from tests.conftest import make_key
from tests.gateway.helpers import MODEL

pytestmark = pytest.mark.server  # starts labs of its own (LabServer) and a client process

DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([5, 6, 7]),
    loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
)

VICTIM = """
import sys, tinker
from tinker import types
service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
trainer = service.create_lora_training_client(base_model="openrl-lab/tiny-llama-10m", rank=8, seed=1).result()
tokens = list(range(5, 260))
batch = [types.Datum(model_input=types.ModelInput.from_ints(tokens),
                     loss_fn_inputs={"target_tokens": [t + 1 for t in tokens], "weights": [1.0] * len(tokens)})] * 512
print(trainer.model_id, flush=True)
trainer.forward_backward(batch, "cross_entropy").result()  # minutes of work on a CPU kernel
print("finished", flush=True)
"""


def _metric(lab: LabServer, name: str) -> float:
    text = httpx.get(f"{lab.base_url}/metrics", timeout=30).text  # loopback: no key needed
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
    assert len(values) == 1, (name, values)
    return values[0]


def _wait_for(condition, what: str, timeout: float = 120.0):
    """A liveness bound (the state must come about), not a performance figure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def _get_info(lab: LabServer, key: str, model_id: str) -> httpx.Response:
    return httpx.post(
        f"{lab.base_url}/api/v1/get_info",
        json={"model_id": model_id, "type": "get_info"},
        headers={"X-API-Key": key},
        timeout=30,
    )


def _lab(home, monkeypatch, session_timeout_s: float):
    monkeypatch.setenv("OPENRL_LAB_SESSION_TIMEOUT_S", str(session_timeout_s))
    monkeypatch.setenv("OPENRL_LAB_LOST_POLL_GRACE_S", "2")
    with LabServer(home) as lab:
        yield lab


@pytest.fixture
def quick_lab(tmp_path, monkeypatch):
    """A lab whose sessions end soon after their client goes quiet (the default is 2 minutes), yet not while an
    SDK client is alive: the SDK heartbeats every 10 s, and a call that takes long on a loaded machine sends
    nothing while it long-polls (25 s a poll). 30 s leaves the live clients of these tests alive whatever the
    machine's load; a killed client is still found within the 2 s lost-poll grace."""
    yield from _lab(tmp_path / "home", monkeypatch, 30)


@pytest.fixture
def silent_lab(tmp_path, monkeypatch):
    """Sessions end after 4 s of silence: for a raw client that heartbeats exactly as long as the test says."""
    yield from _lab(tmp_path / "home", monkeypatch, 4)


class Heartbeats:
    """A raw client's heartbeat, every 0.5 s from a thread until stop(): alive while its model is being made
    (which takes longer than the 4 s timeout on a loaded machine, and is watched by a 25 s long poll that sends
    nothing meanwhile), silent after."""

    def __init__(self, lab: LabServer, session_id: str):
        self._stop = threading.Event()
        body = {"session_id": session_id, "type": "session_heartbeat"}
        self._thread = threading.Thread(target=self._beat, args=(lab, body), daemon=True)
        self._thread.start()

    def _beat(self, lab, body):
        with httpx.Client(base_url=f"{lab.base_url}/api/v1", headers={"X-API-Key": lab.api_key}, timeout=60) as http:
            while not self._stop.wait(0.5):
                http.post("/session_heartbeat", json=body)

    def stop(self):
        self._stop.set()
        self._thread.join()


def test_a_finished_sessions_runs_leave_the_kernel_and_come_back_from_a_checkpoint(quick_lab):
    lab = quick_lab
    service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    trainer.forward_backward([DATUM], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = trainer.save_state("before-close").result().path
    trainer.save_weights_and_get_sampling_client()
    assert _metric(lab, "openrl_kernel_jobs") == 1 and _metric(lab, "openrl_kernel_samplers") >= 1
    expected = trainer.forward([DATUM], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    model_id = trainer.model_id
    service.close("success").result()

    _wait_for(lambda: _metric(lab, "openrl_kernel_jobs") == 0, "the run's job left the kernel")
    assert _metric(lab, "openrl_kernel_samplers") == 0
    answer = _get_info(lab, lab.api_key, model_id)
    assert answer.status_code == 404
    assert "was freed (session" in answer.text and "finished by its client" in answer.text and saved in answer.text

    again = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
    back = again.create_training_client_from_state(saved).result()
    assert back.forward([DATUM], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist() == expected
    again.close("success").result()


def test_a_silent_session_expires(silent_lab):
    """A client that stops heartbeating (here: raw HTTP that heartbeats until its model exists, then never
    again) loses its runs after the timeout."""
    lab = silent_lab
    http = httpx.Client(base_url=f"{lab.base_url}/api/v1", headers={"X-API-Key": lab.api_key}, timeout=60)
    sid = http.post(
        "/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "raw", "type": "create_session"}
    ).json()["session_id"]
    beats = Heartbeats(lab, sid)
    rid = http.post(
        "/create_model",
        json={
            "session_id": sid,
            "model_seq_id": 1,
            "base_model": MODEL,
            "lora_config": {"rank": 4},
            "type": "create_model",
        },
    ).json()["request_id"]
    try:
        model_id = _wait_for(
            lambda: http.post("/retrieve_future", json={"request_id": rid}).json().get("model_id"),
            "the model was created",
        )
        assert _get_info(lab, lab.api_key, model_id).status_code == 200
        assert _metric(lab, "openrl_kernel_jobs") == 1
    finally:
        beats.stop()  # silent from here on
    # Watched from outside (a request to the model would count as the client being alive):
    _wait_for(lambda: _metric(lab, "openrl_kernel_jobs") == 0, "the silent session expired")
    freed = _get_info(lab, lab.api_key, model_id)
    assert freed.status_code == 404
    assert "expired: no heartbeat or request for 4 s" in freed.text and "saved no checkpoint" in freed.text
    assert http.post("/session_heartbeat", json={"session_id": sid, "type": "session_heartbeat"}).status_code == 410


def test_a_killed_clients_forward_backward_stops_early_and_its_run_is_freed(quick_lab):
    lab = quick_lab
    victim_key, bob_key = make_key(lab.home, "victim"), make_key(lab.home, "bob")
    bob = tinker.ServiceClient(base_url=lab.base_url, api_key=bob_key)
    bobs = bob.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, lab.base_url, victim_key],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, TINKER_TELEMETRY="0"),
    )
    try:
        victims_model = victim.stdout.readline().strip()
        assert victims_model, "the victim did not start"
        _wait_for(lambda: _metric(lab, 'openrl_group_busy{group="default"}') == 1, "its forward_backward runs")
        time.sleep(1.0)  # well into its micro-batches (it needs minutes in all)
        killed_at = time.time()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    finally:
        victim.kill()
    # Bob's step is served once the victim's call stops at its next micro-batch.
    assert bobs.forward_backward([DATUM], "cross_entropy").result(timeout=120).metrics
    answer = _wait_for(
        lambda: (r := _get_info(lab, victim_key, victims_model)).status_code == 404 and r, "the victim's run was freed"
    )
    assert "its client went away" in answer.text
    assert _metric(lab, "openrl_kernel_jobs") == 1  # bob's
    # The timeline (as bob sees it: the victim's slice is anonymous) shows the victim's phase cut short.
    with tinker_free_orchestrator(lab, bob_key) as orch:
        records = orch.timeline("default", since=killed_at - 600).records
    theirs = [r for r in records if not r.mine and r.kind == "forward_backward"]
    assert theirs and theirs[-1].outcome == "failed" and theirs[-1].released_at > killed_at
    bob.close("success").result()


def tinker_free_orchestrator(lab: LabServer, key: str):
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient

    return TimeSliceOrchestratorClient(lab.grpc_target, api_key=key, job="probe")
