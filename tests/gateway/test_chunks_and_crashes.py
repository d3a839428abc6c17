"""The SDK's concurrent, out-of-order chunks; zstd bodies; a kernel that dies under the control plane."""

from __future__ import annotations

import os
import re

import numpy as np
import psutil
import pytest
import tinker
import zstandard
from tinker import types

from openrl_lab.server import LabServer
from tests.processes import lab_kernels

from .helpers import TEXTS, logprobs_of, new_trainer, sft_batch
from .test_wire_and_bad_input import Api, _datum

pytestmark = pytest.mark.server  # starts a lab of its own (LabServer)


@pytest.fixture(scope="module")
def chunked_lab(tmp_path_factory):
    """A server that tells the SDK to send one datum per forward_backward request (sent concurrently, first last)."""
    os.environ["OPENRL_LAB_FWDBWD_CHUNK_LEN"] = "1"
    try:
        with LabServer(tmp_path_factory.mktemp("chunked")) as lab:
            yield lab
    finally:
        del os.environ["OPENRL_LAB_FWDBWD_CHUNK_LEN"]


def _train(service, steps=3):
    trainer = new_trainer(service, seed=11)
    batch = sft_batch(trainer.get_tokenizer(), TEXTS)
    metrics = []
    for _ in range(steps):
        fb = trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        metrics.append(fb.result().metrics["loss:sum"])
    return metrics, logprobs_of(trainer.forward(batch, "cross_entropy").result())


def test_chunked_requests_equal_one_request(chunked_lab, service):
    chunked = tinker.ServiceClient(base_url=chunked_lab.base_url, api_key=chunked_lab.api_key)
    losses_c, lp_c = _train(chunked)
    losses_1, lp_1 = _train(service)
    np.testing.assert_allclose(losses_c, losses_1, rtol=1e-5)  # the SDK sums chunk losses
    assert len(lp_c) == len(TEXTS)
    for a, b in zip(lp_c, lp_1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    chunked.close("success").result()


def test_zstd_body(lab):
    api = Api(lab.base_url, lab.api_key)
    sid = api.session()
    model_id = api.model(sid, 0, {"rank": 2})
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[_datum([1, 2, 3], target_tokens=[2, 3, 4])], loss_fn="cross_entropy"
        ),
        model_id=model_id,
        seq_id=1,
    )
    body = zstandard.ZstdCompressor().compress(forward_backward_request_to_proto(req).SerializeToString())
    r = api.post(
        "/forward_backward",
        content=body,
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
    )
    assert r.status_code == 200, r.text
    assert api.result(r.json()["request_id"]).status_code == 200
    bad = api.post("/forward_backward", content=b"not zstd", headers={"Content-Encoding": "zstd"})
    assert bad.status_code == 400 and "zstd" in bad.json()["detail"]


def test_kernel_crash_leaves_control_plane_serving(tmp_path):
    with LabServer(tmp_path / "home") as lab:
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        trainer = new_trainer(service)
        batch = sft_batch(trainer.get_tokenizer(), TEXTS[:2])
        path = trainer.save_state("pre-crash").result().path
        snapshot = trainer.save_weights_and_get_sampling_client().result()
        kernels = lab_kernels(lab)
        assert len(kernels) == 1
        kernels[0].kill()
        psutil.wait_procs(kernels, timeout=10)  # a zombie until the control plane reaps it; that is enough
        with pytest.raises(Exception) as err:  # noqa: PT011 - the message is checked below
            trainer.forward_backward(batch, "cross_entropy").result()
        assert "resident" in str(err.value) or "lost the kernel" in str(err.value), err.value
        with pytest.raises(tinker.NotFoundError, match=re.escape("lost since (its process was killed by SIGKILL")):
            snapshot.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
        # a fresh kernel serves new work, and the acknowledged checkpoint is still there
        restored = service.create_training_client_from_state(path).result()
        assert len(logprobs_of(restored.forward(batch, "cross_entropy").result())) == 2
        alive = lab_kernels(lab)
        assert len(alive) == 1 and alive[0].pid != kernels[0].pid
        service.close("success").result()
