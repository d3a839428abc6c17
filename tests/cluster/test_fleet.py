"""Two CPU kernels in two groups behind one control plane (`openrl-lab serve --cpu-kernels 2`), driven by the
real tinker SDK: placement, parallel groups, a sampler on the other kernel, and a kernel killed mid-step."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
import tinker

from openrl_lab.orchestrator import TimeSliceOrchestratorClient
from openrl_lab.server import LabServer
from tests.cluster.helpers import (
    datum,
    forward_logprobs,
    kernel_pid,
    kernels,
    lost_within_s,
    new_trainer,
    placement,
    sdk,
    wait_for,
)
from tests.conftest import make_key
from tests.gateway.helpers import TEXTS, sft_batch

pytestmark = pytest.mark.server  # starts a control plane with kernel processes

TOKENS = [5, 17, 33, 2, 41, 9, 12, 7]


@pytest.fixture(scope="module")
def fleet_lab(tmp_path_factory):
    home = tmp_path_factory.mktemp("fleet-home")
    store = tmp_path_factory.mktemp("checkpoint-store")
    with LabServer(home, args=("--cpu-kernels", "2", "--checkpoint-store", str(store))) as lab:
        lab.checkpoint_store = store
        yield lab


def test_two_groups_two_kernels_pinned(fleet_lab):
    ks = kernels(fleet_lab)
    assert sorted(ks) == ["kernel-cpu0", "kernel-cpu1"]
    assert {k["group"] for k in ks.values()} == {"cpu0", "cpu1"}
    assert all(k["state"] == "up" and k["origin"] == "local" for k in ks.values())
    cores = [set(psutil.Process(kernel_pid(fleet_lab, g)).cpu_affinity()) for g in ("cpu0", "cpu1")]
    assert cores[0] and cores[1] and not cores[0] & cores[1], cores  # each on its own cores


def test_two_users_jobs_land_on_different_kernels_and_step_concurrently(fleet_lab):
    bob_key = make_key(fleet_lab.home, "bob")
    alice, bob = sdk(fleet_lab, fleet_lab.api_key), sdk(fleet_lab, bob_key)
    ta, tb = new_trainer(alice).result(), new_trainer(bob, seed=1).result()
    pa, pb = placement(fleet_lab, fleet_lab.api_key, ta.model_id), placement(fleet_lab, bob_key, tb.model_id)
    assert {pa["kernel"], pb["kernel"]} == {"kernel-cpu0", "kernel-cpu1"}, (pa, pb)
    batch = sft_batch(ta.get_tokenizer(), TEXTS * 4)
    since = time.time()

    start = threading.Barrier(2)  # both begin together, however long a thread takes to start

    def train(t):
        start.wait(30)
        for _ in range(6):
            t.forward_backward(batch, "cross_entropy").result()

    threads = [threading.Thread(target=train, args=(t,)) for t in (ta, tb)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    with TimeSliceOrchestratorClient(fleet_lab.grpc_target, api_key=fleet_lab.api_key) as orch:
        slices = {
            g: [r for r in orch.timeline(g, since=since).records if r.kind == "forward_backward"]
            for g in ("cpu0", "cpu1")
        }
    assert len(slices["cpu0"]) >= 6 and len(slices["cpu1"]) >= 6, slices
    overlap = sum(
        max(0.0, min(a.released_at, b.released_at) - max(a.granted_at, b.granted_at))
        for a in slices["cpu0"]
        for b in slices["cpu1"]
    )
    # against the less busy kernel's time, the most the two can overlap (a kernel slowed by other work is busier)
    busy = min(sum(r.released_at - r.granted_at for r in slices[g]) for g in ("cpu0", "cpu1"))
    assert overlap > 0.3 * busy, f"phases on the two groups overlapped only {overlap:.2f} s of {busy:.2f} s"
    alice.close("success").result()
    bob.close("success").result()


def test_sampler_on_the_other_kernel_samples_the_trainers_latest_weights(fleet_lab):
    service = sdk(fleet_lab, fleet_lab.api_key)
    trainer = new_trainer(service, group="trainer-group").result()  # cpu0; samplers go to sampler-group, cpu1
    assert placement(fleet_lab, fleet_lab.api_key, trainer.model_id)["group"] == "cpu0"
    batch = sft_batch(trainer.get_tokenizer(), TEXTS)
    for _ in range(3):  # move the weights away from their initial values
        trainer.forward_backward(batch, "cross_entropy").result()
        trainer.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    got = sampler.compute_logprobs(tinker.types.ModelInput.from_ints(TOKENS)).result()
    want = forward_logprobs(trainer, TOKENS)
    np.testing.assert_allclose(np.asarray(got[1:], dtype=np.float64), want, rtol=1e-4, atol=1e-4)
    # ... and it really lives on the other kernel
    r = httpx.get(
        f"{fleet_lab.base_url}/api/v1/samplers/{sampler._sampling_session_id}",
        headers={"X-API-Key": fleet_lab.api_key},
        timeout=30,
    )
    assert r.json()["placement"]["kernel"] == "kernel-cpu1", r.json()
    wait_for(lambda: kernels(fleet_lab)["kernel-cpu1"]["samplers"] >= 1, 5, "the sampler kernel to report it")
    stale = forward_logprobs(trainer, TOKENS)
    trainer.forward_backward(batch, "cross_entropy").result()
    trainer.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    newer = trainer.save_weights_and_get_sampling_client().result()
    fresh = newer.compute_logprobs(tinker.types.ModelInput.from_ints(TOKENS)).result()
    np.testing.assert_allclose(
        np.asarray(fresh[1:], dtype=np.float64), forward_logprobs(trainer, TOKENS), rtol=1e-4, atol=1e-4
    )
    assert not np.allclose(np.asarray(fresh[1:], dtype=np.float64), stale, atol=1e-4)  # the latest, not the first
    service.close("success").result()


def test_kernel_killed_mid_step(fleet_lab):
    """SIGKILL one kernel during a step: its job fails within 10 s naming its last checkpoint, the other kernel's
    job goes on, the job restored from its checkpoint continues with identical logprobs, the kernel comes back."""
    bob_key = make_key(fleet_lab.home, "carol")
    alice, carol = sdk(fleet_lab, fleet_lab.api_key), sdk(fleet_lab, bob_key)
    victim = new_trainer(alice, group="cpu0").result()
    other = new_trainer(carol, group="cpu1").result()
    batch = sft_batch(victim.get_tokenizer(), TEXTS)
    victim.forward_backward(batch, "cross_entropy").result()
    victim.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    saved = victim.save_state("before-kill").result().path
    before = forward_logprobs(victim, TOKENS)
    old_incarnation = kernels(fleet_lab)["kernel-cpu0"]["incarnation"]
    big = [datum((TOKENS * 24)[:160]) for _ in range(1000)]  # seconds of work on one core
    since = time.time()
    running = victim.forward_backward(big, "cross_entropy")
    with TimeSliceOrchestratorClient(fleet_lab.grpc_target, api_key=fleet_lab.api_key) as orch:
        wait_for(
            lambda: any(
                r.kind == "forward_backward" and r.outcome == "running"
                for r in orch.timeline("cpu0", since=since).records
            ),
            60,
            "the big step to run",
        )
    bound = lost_within_s(fleet_lab)  # the fleet's rule plus a margin measured now
    os.kill(kernel_pid(fleet_lab, "cpu0"), signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(Exception) as err:  # noqa: PT011 - the message is checked below
        running.result()
    assert time.monotonic() - killed_at < bound, bound
    assert "lost" in str(err.value) and saved in str(err.value), err.value
    # the other kernel's job is unaffected
    other.forward_backward(batch, "cross_entropy").result()
    other.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    # restored from its checkpoint (onto the surviving kernel if the killed one is not back yet): same weights
    restored = alice.create_training_client_from_state(saved).result()
    np.testing.assert_allclose(forward_logprobs(restored, TOKENS), before, rtol=1e-5, atol=1e-5)
    restored.forward_backward(batch, "cross_entropy").result()
    restored.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    # the killed kernel comes back under a new incarnation
    back = wait_for(
        lambda: (k := kernels(fleet_lab)["kernel-cpu0"])["state"] == "up" and k["incarnation"] != old_incarnation and k,
        120,
        "kernel-cpu0 to come back",
    )
    assert back["jobs"] == 0
    with pytest.raises(tinker.NotFoundError, match="before-kill"):
        victim.forward_backward(batch, "cross_entropy").result()  # a 404 that names the checkpoint to load
    alice.close("success").result()
    carol.close("success").result()


def test_kernel_list_shows_the_fleet(fleet_lab):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "openrl_lab.cli", "kernel", "list", "--home", str(fleet_lab.home)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "STATE", "GROUP", "DEVICE"]
    assert any(line.split()[:4] == ["kernel-cpu0", "up", "cpu0", "cpu"] for line in lines[1:]), out.stdout
    assert any(line.split()[:4] == ["kernel-cpu1", "up", "cpu1", "cpu"] for line in lines[1:]), out.stdout
