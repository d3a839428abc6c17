"""The notebook layer's client library against a real control plane: leases, metric history, reattach."""

from __future__ import annotations

import math
import time

import pandas as pd
import pytest

from openrl_lab.lab import Lab, LabError
from tests.conftest import make_key, running_lab
from tests.lab.helpers import datum, eval_loss, train_steps
from tests.processes import lab_kernels

pytestmark = pytest.mark.server  # starts labs of its own (LabServer)


@pytest.fixture(scope="module")
def alice(lab):
    client = Lab.connect(lab.base_url, api_key=lab.api_key, home=lab.home)
    yield client
    client.close()


def test_lease_then_attach_from_a_fresh_client_keeps_state_and_history(lab, alice):
    run = alice.lease("reattach-1", rank=4, seed=1)
    data = [datum(run.tokenizer(), "the cat sat on the mat")]
    losses = train_steps(run, data, 3)
    assert losses[-1] < losses[0]
    run.flush()
    before = eval_loss(run, data)

    # A restarted notebook kernel: a new client, a new tinker session, the same kernel job.
    fresh = Lab.connect(lab.base_url, api_key=lab.api_key)
    again = fresh.attach("reattach-1")
    assert again.model_id != run.model_id
    assert eval_loss(again, data) == before  # the adapter and optimizer state are the kernel's, untouched
    history = again.history()
    assert list(history["step"]) == [0, 1, 2]
    assert history["loss"].tolist() == pytest.approx(losses)

    more = train_steps(again, data, 2, start=3)  # training goes on from where it was
    assert more[0] == pytest.approx(before, rel=1e-6)
    again.flush()
    assert list(fresh.attach("reattach-1").history()["step"]) == [0, 1, 2, 3, 4]
    fresh.release("reattach-1")
    fresh.close()


def test_user_mistakes_are_named(lab, alice):
    run = alice.lease("mistakes", rank=2)
    with pytest.raises(LabError, match=r"already exists.*attach"):
        alice.lease("mistakes")
    with pytest.raises(LabError, match=r"openrl_group 'nope' is not a group of this server.*trainer-group"):
        alice.lease("other", group="nope")
    with pytest.raises(LabError, match="openrl_weight '-1' must be a finite number > 0"):
        alice.lease("other", weight=-1)
    with pytest.raises(LabError, match="priority 'urgent' is not a priority class: one of interactive, batch"):
        alice.lease("other", priority="urgent")
    # a notebook's run is interactive unless asked otherwise (an SDK client's is batch)
    assert {L.name: L.priority for L in alice.orchestrator.leases()}["mistakes"] == "interactive"
    with pytest.raises(LabError, match="rank 0 is out of range"):
        alice.lease("other", rank=0)
    with pytest.raises(LabError, match=r"no lease named 'ghost'.*mistakes"):
        alice.attach("ghost")
    with pytest.raises(TypeError, match="metric 'reward' must be a number"):
        run.log(0, reward="high")
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        run.log(-1, reward=1.0)
    r = alice.http.put("/api/v1/lab/leases/bad name!", json={"base_model": "x", "model_id": "y"})
    assert r.status_code == 400 and "lease name 'bad name!' is not allowed" in r.json()["error"]
    r = alice.http.post("/api/v1/lab/leases/mistakes/metrics", json={"rows": [{"step": 0, "metrics": {"r": "x"}}]})
    assert r.status_code == 400 and "MetricRows" in r.json()["error"]
    r = alice.http.put("/api/v1/lab/leases/stolen", json={"base_model": "x", "model_id": "not-a-model"})
    assert r.status_code == 404
    run.log(0, reward=float("nan"), loss=1.5)  # NaN is kept as a missing value, not an error
    run.flush()
    row = alice.http.get("/api/v1/lab/leases/mistakes/metrics").json()["rows"][0]
    assert row["metrics"] == {"reward": None, "loss": 1.5}
    alice.release("mistakes")


def test_a_full_finetuning_lease_states_its_memory_trains_and_reattaches(lab, alice):
    with pytest.raises(LabError, match="full fine-tuning trains every weight: it takes no LoRA rank"):
        alice.lease("full-x", full=True, rank=8)
    run = alice.lease("full-1", full=True)
    assert run.rank is None and run.training.get_info().is_lora is False
    state = 16 * 1_115_264  # tiny-llama-1m's weights x (weight, gradient, two AdamW moments) x 4 bytes
    assert run.state_bytes == state
    assert "openrl-lab/tiny-llama-1m full fine-tuning on trainer-group" in repr(run)
    assert "17.0 MiB of device memory (weights, gradients, AdamW moments)" in repr(run)
    data = [datum(run.tokenizer(), "the cat sat on the mat")]
    losses = train_steps(run, data, 3, lr=1e-3)
    assert losses[-1] < losses[0]
    deadline = time.monotonic() + 10
    while (row := next(r for r in alice.status() if r["name"] == "full-1"))["state_bytes"] is None:
        assert time.monotonic() < deadline  # the fleet hears from its kernels each second
        time.sleep(0.2)
    assert row["state_bytes"] == state
    fresh = Lab.connect(lab.base_url, api_key=lab.api_key)
    again = fresh.attach("full-1")
    assert again.rank is None and again.state_bytes == state and eval_loss(again, data) == eval_loss(run, data)
    fresh.close()
    alice.release("full-1")


def test_another_users_key_never_reaches_my_leases(lab, alice):
    alice.lease("private", rank=2).log(0, loss=1.0)
    alice._leases["private"].flush()
    bob = Lab.connect(lab.base_url, api_key=make_key(lab.home, "bob-lab"))
    assert "private" not in bob.lease_names()
    with pytest.raises(LabError, match="no lease named 'private'"):
        bob.attach("private")
    assert bob.http.get("/api/v1/lab/leases/private/metrics").status_code == 404
    assert bob.http.delete("/api/v1/lab/leases/private").status_code == 404
    assert "private" in alice.lease_names()
    bob.close()
    alice.release("private")


def test_release_frees_the_kernel_job(lab, alice):
    run = alice.lease("released", rank=2)
    data = [datum(run.tokenizer(), "abc abc")]
    eval_loss(run, data)
    alice.release("released")
    assert "released" not in alice.lease_names()
    with pytest.raises(Exception, match="not resident"):
        eval_loss(run, data)
    with pytest.raises(LabError, match="no lease named 'released'"):
        alice.attach("released")


def test_history_during_a_flush_in_flight_still_has_every_row(lab, alice, monkeypatch):
    """The background flush has taken the rows from the pending list and its POST is not answered yet: a
    `history()` then must still show them (CI once saw 29 of 30 tutorial steps, the last one in flight)."""
    import threading

    run = alice.lease("in-flight", rank=2)
    run.log(0, reward=0.0)
    run.flush()
    for step in (1, 2):
        run.log(step, reward=step / 10)
    real, posting, answer = alice._request, threading.Event(), threading.Event()

    def slow_post(method, path, **kw):  # the real request, held until the test has read the history
        if method == "POST" and path.endswith("/metrics"):
            posting.set()
            assert answer.wait(30)
        return real(method, path, **kw)

    monkeypatch.setattr(alice, "_request", slow_post)
    flusher = threading.Thread(target=run.flush)
    flusher.start()
    assert posting.wait(30)
    assert run.history()["step"].tolist() == [0, 1, 2]
    run.log(3, reward=0.3)  # logged while the flush is in flight: waits for the next one
    answer.set()
    flusher.join(30)
    assert run.history()["step"].tolist() == [0, 1, 2, 3]
    assert run.flush() == 1
    server_rows = alice.http.get("/api/v1/lab/leases/in-flight/metrics").json()["rows"]
    assert [r["step"] for r in server_rows] == [0, 1, 2, 3]  # each row sent once, in order
    alice.release("in-flight")


def test_plot_replays_history_then_follows_the_loop(lab, alice):
    run = alice.lease("plotted", rank=2)
    for step in range(5):
        run.log(step, reward=step / 10, loss=1 - step / 10)
    run.flush()
    plot = Lab.connect(lab.base_url, api_key=lab.api_key).attach("plotted").plot(autostart=False)
    assert plot.dataframe["step"].tolist() == [0, 1, 2, 3, 4]
    mine = run.plot(["reward"], autostart=False)
    run.log(5, reward=0.5, loss=0.5)
    assert mine.dataframe["step"].tolist()[-1] == 5
    assert math.isclose(mine.dataframe["reward"].iloc[-1], 0.5)
    plot.close()
    mine.close()
    alice.release("plotted")


def _restart_scenario(home):
    gen = running_lab(home)
    next(gen)
    lab = Lab.connect(home=home)
    run = lab.lease("survivor", rank=4, seed=3)
    data = [datum(run.tokenizer(), "hello hello hello")]
    train_steps(run, data, 2)
    path = run.save("after-2")
    saved = eval_loss(run, data)
    train_steps(run, data, 1, start=2)  # not saved: lost with the kernel
    lab.lease("unsaved", rank=2)
    lab.close()
    gen.close()  # stops the control plane and its kernel
    return path, saved, data


def test_attach_after_a_control_plane_restart_restores_the_last_checkpoint(tmp_path):
    home = tmp_path / "lab"
    path, saved, data = _restart_scenario(home)
    for _ in running_lab(home):
        lab = Lab.connect(home=home)
        run = lab.attach("survivor")
        assert run.restored_from == path
        assert eval_loss(run, data) == pytest.approx(saved, rel=1e-6)
        assert list(run.history()["step"]) == [0, 1, 2]  # the history is the control plane's: nothing lost
        with pytest.raises(LabError, match=r"'unsaved' lost its state.*no checkpoint"):
            lab.attach("unsaved")
        lab.close()


def test_status_rows_a_lease_whose_kernel_was_lost_has_no_share(tmp_path):
    """SIGKILL the kernel under a lab lease: `Lab.status()` (what %openrl status, the LeasePanel and the server
    extension show) says `lost`, not resident, with no share; the user's live lease on the group has it all."""
    import os
    import signal
    import time

    for server in running_lab(tmp_path / "lab"):
        lab = Lab.connect(server.base_url, api_key=server.api_key)
        run = lab.lease("doomed", group="trainer-group", rank=2)
        run.log(0, reward=0.5)
        run.flush()
        group = lab.orchestrator.canonical_group("trainer-group")
        with lab.orchestrator.on_accelerators(group, kind="script"):  # the user's own script: a live lease
            pass
        before = {r["name"]: r for r in lab.status()}
        assert before["doomed"]["state"] != "lost" and before["doomed"]["kernel"]
        assert before["doomed"]["share"] == pytest.approx(0.5)
        (kernel,) = lab_kernels(server)
        os.kill(kernel.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = {r["name"]: r for r in lab.status()}
            if rows["doomed"]["state"] == "lost":
                break
            time.sleep(0.25)
        doomed = rows["doomed"]
        assert (doomed["state"], doomed["resident"], doomed["share"]) == ("lost", False, 0.0)
        assert doomed["last_reward"] == 0.5 and doomed["group"] == group  # what it was, still shown
        (script,) = [r for r in rows.values() if r["name"] not in ("doomed", "samplers")]
        assert script["share"] == pytest.approx(1.0) and script["group"] == group
        lab.close()


def test_a_fork_carries_on_bit_for_bit_and_compare_overlays_the_variants(lab, alice):
    run = alice.lease("fork-src", rank=4, seed=7)
    data = [datum(run.tokenizer(), "the quick brown fox jumps")]
    train_steps(run, data, 3)
    run.training.forward_backward(data, "cross_entropy").result()  # a gradient pending: it goes with the fork
    slow, fast = alice.fork(run, ["fork-slow", "fork-fast"], learning_rate=[1e-3, 1e-2], note="lr sweep")
    assert (slow.variant["forked_from"], slow.variant["step"]) == ("fork-src", 2)
    assert slow.variant["settings"] == {"learning_rate": 1e-3, "note": "lr sweep"}
    assert fast.variant["settings"]["learning_rate"] == 1e-2 and run.variant is None
    assert list(fast.history()["step"]) == [0, 1, 2]  # the common past comes along
    # the same next step on the same data: the parent and a fork give the same loss, bit for bit
    adam = __import__("tinker").AdamParams(learning_rate=1e-2)
    for r in (run, fast):
        r.training.optim_step(adam).result()
    assert eval_loss(fast, data) == eval_loss(run, data)
    assert eval_loss(slow, data) != eval_loss(fast, data)  # slow has not stepped its pending gradient yet
    # the forks are leases of their own, interactive, on the parent's group
    leases = {L.name: L for L in alice.orchestrator.leases()}
    assert leases["fork-slow"].priority == "interactive" and leases["fork-fast"].group_id == leases["fork-src"].group_id
    # compare: one series per metric and run, live as they log, and a summary table
    cmp = alice.compare([run, slow, fast], ["loss"])
    for step, r in enumerate((slow, fast)):
        r.log(3, loss=0.5 + step)
    frame = cmp.plot.dataframe
    assert {"loss fork-src", "loss fork-slow", "loss fork-fast"} <= set(frame.columns)
    last = frame.dropna(subset=["loss fork-fast"]).iloc[-1]
    assert (last["step"], last["loss fork-fast"]) == (3, 1.5)
    # a run driven from another notebook (another Lab client) shows up too: followed through the control plane
    elsewhere = Lab.connect(lab.base_url, api_key=lab.api_key, home=lab.home)
    other = elsewhere.attach("fork-slow")
    other.log(4, loss=0.25)
    other.flush()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = cmp.plot.dataframe.dropna(subset=["loss fork-slow"])
        if got["step"].max() == 4:
            break
        time.sleep(0.1)
    assert list(got["step"]) == [0, 1, 2, 3, 4] and got["loss fork-slow"].iloc[-1] == 0.25  # each step once
    elsewhere.close()
    summary = cmp.summary()
    assert summary.loc["fork-slow", "learning_rate"] == 1e-3 and pd.isna(summary.loc["fork-src", "forked_from"])
    assert summary.loc["fork-fast", "loss last"] == 1.5 and summary.loc["fork-fast", "steps"] == 3
    # mistakes are named
    with pytest.raises(LabError, match="lease 'fork-fast' already exists"):
        alice.fork(run, ["fork-fast"])
    with pytest.raises(LabError, match="setting 'learning_rate' has 1 values for 2 names"):
        alice.fork(run, ["a", "b"], learning_rate=[1e-3])
    with pytest.raises(LabError, match="lease 'ghost'"):
        alice.fork("ghost", ["c"])
    bob = Lab.connect(lab.base_url, api_key=make_key(lab.home, "bob-forker"))
    with pytest.raises(LabError, match="lease 'fork-src' not found"):  # another user's run is not there for bob
        bob.fork("fork-src", ["stolen"])
    bob.close()
    cmp.plot.close()
    for name in ("fork-src", "fork-slow", "fork-fast"):
        alice.release(name)
