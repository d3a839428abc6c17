"""Full fine-tuning through the unchanged tinker SDK (LoRA rank 0: no adapter, every weight trained), against a
real server on loopback: it trains, its checkpoints and samplers carry the trained weights, bad ranks are 400s,
and a job that does not fit the kernel's device memory is refused up front with the sizes."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from openrl_lab.lab import Lab, LabError
from openrl_lab.memory import fmt_bytes, full_finetune_bytes
from openrl_lab.train.checkpoint import read_checkpoint

from ..conftest import running_lab, sdk_client
from .helpers import MODEL, TEXTS, logprobs_of, raw_info, sft_batch

pytestmark = pytest.mark.server  # starts a lab of its own (LabServer)

PARAMS_1M = 1_115_264  # openrl-lab/tiny-llama-1m's weights (its safetensors, and the loaded model, agree)
LR = 1e-3


def full_trainer(service: tinker.ServiceClient, model: str = MODEL):
    return service.create_lora_training_client(base_model=model, rank=0).result()


def train(trainer, batch, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=LR)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_rank_0_trains_every_weight_and_lowers_the_loss(lab, service):
    trainer = full_trainer(service)
    info = trainer.get_info()
    assert info.is_lora is False and info.lora_rank is None
    trained = raw_info(lab, trainer.model_id)["trained"]
    assert trained["kind"] == "full" and trained["targets"] == {}, trained
    assert trained["parameters"] == trained["base_parameters"] > 0, trained
    batch = sft_batch(trainer.get_tokenizer(), TEXTS)
    losses = train(trainer, batch, 6)
    assert losses[-1] < 0.8 * losses[0], losses


def test_checkpoint_round_trips_weights_and_adamw_state_bit_exact(lab, service):
    trainer = full_trainer(service)
    batch = sft_batch(trainer.get_tokenizer(), TEXTS)
    train(trainer, batch, 2)
    path = trainer.save_state("full-round-trip").result().path
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    assert restored.get_info().is_lora is False
    again = restored.save_state("full-round-trip-again").result().path

    def files(tinker_path: str):
        (directory,) = lab.home.rglob(tinker_path.split("/", 3)[-1])  # <model_id>/weights/<name>
        return read_checkpoint(directory, with_optimizer=True)

    (w1, meta1, opt1), (w2, meta2, opt2) = files(path), files(again)
    assert meta1["is_lora"] is meta2["is_lora"] is False and sum(t.numel() for t in w1.values()) == PARAMS_1M
    assert w1.keys() == w2.keys() and opt1.keys() == opt2.keys() and len(opt1) >= 2 * len(w1)  # exp_avg, exp_avg_sq
    for a, b in [(w1[k], w2[k]) for k in w1] + [(opt1[k], opt2[k]) for k in opt1]:
        assert a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy())
    # ... and the restored run trains on exactly as the original does
    np.testing.assert_array_equal(train(trainer, batch, 1), train(restored, batch, 1))


def test_sampler_snapshot_samples_the_trained_weights(service):
    trainer = full_trainer(service)
    tok = trainer.get_tokenizer()
    batch = sft_batch(tok, TEXTS)
    train(trainer, batch, 4)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    base = service.create_sampling_client(base_model=MODEL).result()
    ids = tok.encode("7+7=14", add_special_tokens=False)
    seq = types.ModelInput.from_ints(ids)
    trained_lp = sampler.compute_logprobs(seq).result()[1:]
    assert not np.allclose(trained_lp, base.compute_logprobs(seq).result()[1:], atol=1e-3)
    # the trained weights' own forward (training client) gives the same numbers
    forward = trainer.forward(
        [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})],
        "cross_entropy",
    ).result()
    np.testing.assert_allclose(trained_lp, logprobs_of(forward)[0], atol=1e-5)
    # a later step does not move the snapshot
    train(trainer, batch, 1)
    assert sampler.compute_logprobs(seq).result()[1:] == trained_lp


@pytest.mark.parametrize(
    "rank, flags, message",
    [
        (-1, {}, "lora rank -1 is out of range: 1 to 1024 for LoRA, or 0 for full fine-tuning"),
        (0, {"train_unembed": False}, "rank 0 asks for full fine-tuning, which trains every weight"),
    ],
)
def test_bad_ranks_are_400s_naming_the_problem(service, rank, flags, message):
    with pytest.raises(tinker.BadRequestError, match=message):
        service.create_lora_training_client(base_model=MODEL, rank=rank, **flags).result()


# --- a kernel with a small memory budget -------------------------------------------------------------------

BUDGET = "30MiB"  # the base model (4.3 MiB) and one full fine-tune of it (17.0 MiB) fit; a second one does not


@pytest.fixture(scope="module")
def small_lab(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("OPENRL_KERNEL_MEMORY_BYTES", BUDGET)  # read by the kernel the lab starts
    try:
        yield from running_lab(tmp_path_factory.mktemp("small-lab-home"))
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def small_service(small_lab):
    yield from sdk_client(small_lab)


def _kernel(lab) -> dict:
    (kernel,) = httpx.get(f"{lab.base_url}/api/v1/lab/kernels", headers={"X-API-Key": lab.api_key}).json()["kernels"]
    return kernel


def test_a_fork_of_a_full_finetune_that_does_not_fit_is_refused_with_the_sizes(small_lab):
    lab_client = Lab.connect(small_lab.base_url, api_key=small_lab.api_key, home=small_lab.home)
    run = lab_client.lease("full-src", full=True)
    with pytest.raises(LabError, match=r"a copy of full fine-tuning job \S+ needs 17\.0 MiB of device memory") as e:
        lab_client.fork(run, ["full-copy"])
    assert "\n" not in str(e.value) and "budget 30.0 MiB" in str(e.value)
    assert lab_client.lease_names() == ["full-src"]  # nothing half-made
    lab_client.release("full-src")  # the next test counts this kernel's jobs
    lab_client.close()
    assert _kernel(small_lab)["jobs"] == 0  # counted no more at once, though made and dropped between reports


def test_a_full_finetune_that_does_not_fit_is_refused_with_the_sizes(small_lab, small_service):
    needed = full_finetune_bytes(PARAMS_1M)
    assert fmt_bytes(needed) == "17.0 MiB"
    first = full_trainer(small_service)
    deadline = time.monotonic() + 10
    while True:  # the fleet hears each second (None: not yet since the kernel started; the job counts at once)
        kernel = _kernel(small_lab)
        available = kernel["device_available_bytes"]
        if kernel["jobs"] == 1 and available is not None and available < needed:
            break
        assert time.monotonic() < deadline, kernel
        time.sleep(0.2)
    assert kernel["device_budget_bytes"] == 30 << 20
    assert kernel["device_available_bytes"] == (30 << 20) - 4 * PARAMS_1M - needed  # base weights, then the job's
    available = fmt_bytes(kernel["device_available_bytes"])

    # over plain HTTP: a 400 at once, no future
    r = httpx.post(
        f"{small_lab.base_url}/api/v1/create_model",
        headers={"X-API-Key": small_lab.api_key},
        json={
            "session_id": small_service.holder.get_session_id(),
            "model_seq_id": 99,
            "base_model": MODEL,
            "lora_config": {"rank": 0},
        },
    )
    assert r.status_code == 400, r.text
    said = r.json()["error"]
    assert "needs 17.0 MiB of device memory" in said and f"has {available} available" in said, said
    assert "budget 30.0 MiB" in said
    # through the SDK: its BadRequestError with the same message
    with pytest.raises(tinker.BadRequestError, match=f"needs 17.0 MiB .* has {available} available"):
        full_trainer(small_service)
    # a bigger model does not fit even alone
    with pytest.raises(tinker.BadRequestError, match=r"needs 154\.1 MiB"):
        full_trainer(small_service, "openrl-lab/tiny-llama-10m")
    # in the notebook layer (what `%openrl lease NAME --full` shows as a one-line UsageError)
    lab_client = Lab.connect(small_lab.base_url, api_key=small_lab.api_key, home=small_lab.home)
    with pytest.raises(LabError, match=f"needs 17.0 MiB .* has {available} available") as refused:
        lab_client.lease("too-big", full=True)
    assert "\n" not in str(refused.value)
    lab_client.close()
    # LoRA still fits beside it, and the first run trains on
    small_service.create_lora_training_client(base_model=MODEL, rank=4).result()
    train(first, sft_batch(first.get_tokenizer(), TEXTS[:2]), 1)
