"""Runs on two devices (gangs) through the real tinker SDK: `openrl-lab serve --cpu-kernels 2` gives two CPU
kernels in the groups cpu0 and cpu1; a run with `user_metadata={"openrl_devices": "2"}` is sharded over both
(FSDP2 over gloo, one rank worker per kernel) and time-sliced as a gang.

What a user can check: the same losses as on one device, checkpoints that move between device counts, sampling,
gangs and a single-device job sharing the groups without a deadlock, and a killed rank ending the whole gang with
the error that names its last checkpoint."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import numpy as np
import psutil
import pytest
import tinker
from tinker import types

from openrl_lab.orchestrator import TimeSliceOrchestratorClient
from openrl_lab.server import LabServer
from tests.cluster.helpers import forward_logprobs, kernel_pid, kernels, lost_within_s, sdk, wait_for
from tests.conftest import make_key
from tests.gateway.helpers import MODEL, TEXTS, raw_info, sft_batch

pytestmark = pytest.mark.server  # starts a control plane with kernel processes

TOKENS = [5, 17, 33, 2, 41, 9, 12, 7]
STEPS = 10
# Two ranks each sum the gradient of their half of the batch and FSDP2 sums the halves: the same sum as on one
# device, but added in another order, so float32 rounding differs (~1e-7 relative per step). Adam divides by
# the root of the second moment, which makes such differences grow a little each step: over 10 steps losses
# stay equal to ~1e-4 relative on this model; 2e-3 leaves room without hiding a real difference (a step with
# averaged instead of summed gradients is off by tens of percent).
RTOL = 2e-3


@pytest.fixture(scope="module")
def gang_lab(tmp_path_factory):
    home = tmp_path_factory.mktemp("gang-home")
    store = tmp_path_factory.mktemp("gang-store")
    with LabServer(home, args=("--cpu-kernels", "2", "--checkpoint-store", str(store))) as lab:
        yield lab


def trainer(service: tinker.ServiceClient, devices: int = 1, rank: int = 8, group: str | None = None):
    metadata = {"openrl_devices": str(devices)} if devices != 1 else {}
    if group:
        metadata["openrl_group"] = group
    return service.create_lora_training_client(
        base_model=MODEL, rank=rank, seed=0, user_metadata=metadata or None
    ).result()


def train(t, batch, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        out = t.forward_backward(batch, "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        t.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return losses


def kernel_children(lab, group: str) -> set[int]:
    return {c.pid for c in psutil.Process(kernel_pid(lab, group)).children(recursive=True)}


def test_lora_on_two_devices_gives_the_losses_of_one(gang_lab):
    service = sdk(gang_lab, gang_lab.api_key)
    one = trainer(service, group="cpu0")
    two = trainer(service, devices=2)
    info = raw_info(gang_lab, two.model_id)
    assert info["devices"] == 2
    assert [r["group"] for r in info["placement"]["ranks"]] in (["cpu0", "cpu1"], ["cpu1", "cpu0"]), info
    # the gang's rendezvous and gloo sockets listen where the kernels do: on loopback, not on every interface
    workers = [psutil.Process(pid) for g in ("cpu0", "cpu1") for pid in kernel_children(gang_lab, g)]
    assert len(workers) == 2, workers
    listening = [c.laddr for w in workers for c in w.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(a.ip in ("127.0.0.1", "::1") for a in listening), listening
    batch = sft_batch(one.get_tokenizer(), TEXTS)
    # per-datum outputs come back in the order they were sent, from both ranks' halves: equal before training
    out1 = one.forward(batch, "cross_entropy").result().loss_fn_outputs
    out2 = two.forward(batch, "cross_entropy").result().loss_fn_outputs
    assert len(out2) == len(batch)
    for a, b in zip(out1, out2):
        np.testing.assert_allclose(b["logprobs"].tolist(), a["logprobs"].tolist(), rtol=1e-5, atol=1e-6)
    single, gang = train(one, batch, STEPS), train(two, batch, STEPS)
    assert single[-1] < single[0] * 0.9, single  # it learned
    np.testing.assert_allclose(gang, single, rtol=RTOL)


def test_full_finetune_on_two_devices_gives_the_losses_of_one(gang_lab):
    service = sdk(gang_lab, gang_lab.api_key)
    one = trainer(service, rank=0, group="cpu1")
    two = trainer(service, devices=2, rank=0)
    assert raw_info(gang_lab, two.model_id)["is_lora"] is False
    batch = sft_batch(one.get_tokenizer(), TEXTS)
    single, gang = train(one, batch, STEPS), train(two, batch, STEPS)
    assert single[-1] < single[0] * 0.9, single
    np.testing.assert_allclose(gang, single, rtol=RTOL)


def test_a_checkpoint_saved_on_two_devices_loads_on_one_and_on_two(gang_lab):
    service = sdk(gang_lab, gang_lab.api_key)
    two = trainer(service, devices=2)
    batch = sft_batch(two.get_tokenizer(), TEXTS)
    train(two, batch, 2)
    saved = two.save_state("gang-2").result().path
    before = forward_logprobs(two, TOKENS)
    on_one = service.create_training_client_from_state_with_optimizer(saved).result()
    on_two = service.create_training_client_from_state_with_optimizer(
        saved, user_metadata={"openrl_devices": "2"}
    ).result()
    assert raw_info(gang_lab, on_one.model_id).get("devices", 1) == 1
    assert raw_info(gang_lab, on_two.model_id)["devices"] == 2
    for restored in (on_one, on_two):
        np.testing.assert_allclose(forward_logprobs(restored, TOKENS), before, rtol=1e-5, atol=1e-6)
    # the optimizer state came along: the next step is the same everywhere
    nexts = [train(t, batch, 2) for t in (two, on_one, on_two)]
    np.testing.assert_allclose(nexts[1], nexts[0], rtol=RTOL)
    np.testing.assert_allclose(nexts[2], nexts[0], rtol=RTOL)
    # and one device's checkpoint loads on two
    saved_one = on_one.save_state("from-one").result().path
    back_on_two = service.create_training_client_from_state(saved_one, user_metadata={"openrl_devices": "2"}).result()
    np.testing.assert_allclose(
        forward_logprobs(back_on_two, TOKENS), forward_logprobs(on_one, TOKENS), rtol=1e-5, atol=1e-6
    )


def test_a_run_on_two_devices_samples_its_latest_weights(gang_lab):
    service = sdk(gang_lab, gang_lab.api_key)
    two = trainer(service, devices=2)
    batch = sft_batch(two.get_tokenizer(), TEXTS)
    train(two, batch, 3)
    sampler = two.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(TOKENS[:-1])
    # the sampler scores the trained weights: its logprobs of a sequence are the trainer's
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    np.testing.assert_allclose(
        np.asarray(scored[1:], dtype=np.float64), forward_logprobs(two, TOKENS), rtol=1e-4, atol=1e-4
    )
    res = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
    assert len(res.sequences) == 2 and all(1 <= len(s.tokens) <= 4 for s in res.sequences)  # may stop at EOS


def test_two_gangs_and_a_single_device_job_share_the_groups(gang_lab):
    """Three users at once on cpu0 and cpu1: two gangs (each needs both groups for every phase) and a job on cpu1
    alone. Slices granted one group at a time in different orders would deadlock; all finish, and on each group
    no two slices ever overlap."""
    since = time.time()
    users = ["gang-a", "gang-b", "single"]
    services_keys = {u: make_key(gang_lab.home, u) for u in users}
    services = {u: sdk(gang_lab, services_keys[u]) for u in users}
    made = {
        "gang-a": trainer(services["gang-a"], devices=2),
        "gang-b": trainer(services["gang-b"], devices=2),
        "single": trainer(services["single"], group="cpu1"),
    }
    batch = sft_batch(made["single"].get_tokenizer(), TEXTS[:4])
    done: dict[str, list[float]] = {}
    errors: list[BaseException] = []

    def run(user: str) -> None:
        try:
            done[user] = train(made[user], batch, 4)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(u,), daemon=True) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert sorted(done) == sorted(users), f"not finished (a deadlock?): {sorted(set(users) - set(done))}"
    for group in ("cpu0", "cpu1"):  # one holder at a time on each group
        with TimeSliceOrchestratorClient(gang_lab.grpc_target, api_key=gang_lab.api_key) as orch:
            records = sorted(
                (r for r in orch.timeline(group, since=since).records if r.outcome != "running"),
                key=lambda r: r.granted_at,
            )
        assert records, group
        for a, b in itertools.pairwise(records):
            assert b.granted_at >= a.released_at - 1e-3, (group, a, b)
    # each of a gang's phases held both groups at once: its two slices share a key and were granted together
    with TimeSliceOrchestratorClient(gang_lab.grpc_target, api_key=services_keys["gang-a"]) as orch:
        mine = [r for g in ("cpu0", "cpu1") for r in orch.timeline(g, since=since).records if r.mine and r.gang]
    by_key: dict[str, list] = {}
    for r in mine:
        by_key.setdefault(r.gang, []).append(r)
    assert len(by_key) >= 8, by_key.keys()  # 4 steps of 2 phases
    for key, pair in by_key.items():
        assert sorted(r.group_id for r in pair) == ["cpu0", "cpu1"], (key, pair)
        assert abs(pair[0].granted_at - pair[1].granted_at) < 1.0, (key, pair)


def test_a_killed_rank_ends_the_gang_with_its_last_checkpoint(gang_lab):
    key = make_key(gang_lab.home, "victim")
    service = sdk(gang_lab, key)
    two = trainer(service, devices=2)
    batch = sft_batch(two.get_tokenizer(), TEXTS)
    train(two, batch, 1)
    saved = two.save_state("before-kill").result().path
    survivor = raw_info(gang_lab, two.model_id, key)["placement"]["ranks"][0]["group"]
    victim = "cpu1" if survivor == "cpu0" else "cpu0"
    assert kernel_children(gang_lab, survivor), "rank 0's worker process"
    bound = lost_within_s(gang_lab)
    os.kill(kernel_pid(gang_lab, victim), signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(Exception) as err:  # noqa: PT011 - the message is checked below
        two.forward_backward(batch, "cross_entropy").result()
    assert time.monotonic() - killed_at < bound + 60, "the gang's call must fail, not hang"
    assert "lost" in str(err.value) and saved in str(err.value), err.value
    # the survivor's rank worker goes too: nothing holds its memory for a gang that cannot run
    wait_for(lambda: not kernel_children(gang_lab, survivor), 60, "rank 0's worker to exit")
    # the run loads from its checkpoint once the killed kernel is back
    wait_for(
        lambda: all(k["state"] == "up" for k in kernels(gang_lab).values()) and len(kernels(gang_lab)) == 2,
        120,
        "the killed kernel to come back",
    )
    restored = service.create_training_client_from_state(saved, user_metadata={"openrl_devices": "2"}).result()
    restored.forward_backward(batch, "cross_entropy").result()


def test_bad_device_counts_are_refused_with_the_reason(gang_lab):
    service = sdk(gang_lab, gang_lab.api_key)
    for bad in ("two", "0", "-1", "65", "1.5"):
        with pytest.raises(tinker.BadRequestError, match="openrl_devices"):
            service.create_lora_training_client(
                base_model=MODEL, rank=8, user_metadata={"openrl_devices": bad}
            ).result()
    # three devices on a server with two kernels: it fails, naming what is up
    with pytest.raises(Exception, match=r"3 kernels.*cpu0"):
        trainer(service, devices=3)
