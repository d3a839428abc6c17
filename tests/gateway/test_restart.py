"""Acknowledged state survives a control-plane restart; lost resident state is reported, not faked."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from openrl_lab.orchestrator import TimeSliceOrchestratorClient
from openrl_lab.server import LabServer

from .helpers import TEXTS, logprobs_of, new_trainer, sft_batch

pytestmark = pytest.mark.server  # starts labs it stops and starts again


def test_a_second_serve_on_the_same_home_is_refused_and_the_first_keeps_serving(tmp_path):
    """Two `make demo`s at once once shared a home: the second start revoked the first's kernel keys, and the
    first run failed mid-way with "API key not recognized". Now the second stops at start, saying why."""
    with LabServer(tmp_path / "home") as lab:
        with pytest.raises(
            RuntimeError, match=r"another openrl-lab serve \(pid \d+, http://127\.0\.0\.1:\d+\) is using"
        ):
            LabServer(tmp_path / "home").start()
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        trainer = new_trainer(service, seed=1)  # its kernel acts with its key: still valid
        trainer.forward_backward(sft_batch(trainer.get_tokenizer(), TEXTS), "cross_entropy").result()
        service.close("success").result()
    with LabServer(tmp_path / "home"):  # the lock went with the process
        pass


def test_checkpoint_survives_restart(tmp_path):
    home = tmp_path / "home"
    with LabServer(home) as lab:
        key = lab.api_key
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=key)
        trainer = new_trainer(service, seed=5)
        batch = sft_batch(trainer.get_tokenizer(), TEXTS)
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = trainer.save_state("before-restart").result().path
        expected = logprobs_of(trainer.forward(batch, "cross_entropy").result())
        old_model = trainer.model_id
        service.close("success").result()
    with LabServer(home, port=lab.port) as lab2:
        assert lab2.api_key == key  # the same key keeps working across restarts
        service = tinker.ServiceClient(base_url=lab2.base_url, api_key=key)
        rest = tinker.RestClient(base_url=lab2.base_url, api_key=key)
        assert path in {c.tinker_path for c in rest.list_checkpoints(old_model).result().checkpoints}
        restored = service.create_training_client_from_state_with_optimizer(path).result()
        got = logprobs_of(restored.forward(batch, "cross_entropy").result())
        for x, y in zip(expected, got):
            np.testing.assert_array_equal(x, y)
        # the model that lived only in the old kernel is reported gone, with what to do about it
        stale = service.create_training_client_from_state(path).result()  # a fresh client works...
        assert stale.model_id != old_model
        import httpx

        r = httpx.post(
            f"{lab2.base_url}/api/v1/get_info",
            headers={"X-API-Key": key},
            json={"model_id": old_model, "type": "get_info"},
        )
        assert r.status_code == 404 and "checkpoint" in r.json()["detail"]
        service.close("success").result()
    assert oct((home / "api_key").stat().st_mode & 0o777) == "0o600"
    assert oct((home / "connection.json").stat().st_mode & 0o777) == "0o600"


def test_the_first_phase_after_a_restart_does_not_wait_for_the_dead_kernel(tmp_path):
    """The old kernel's job was the group's resident when the control plane stopped; the orchestrator keeps
    that in SQLite. The new kernel tells it at start that its predecessor's state is gone, so nobody waits
    for a dead process to evict (before: the first phase waited out the 10 s holder timeout)."""
    home = tmp_path / "home"
    with LabServer(home) as lab:
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        trainer = new_trainer(service, seed=5)
        batch = sft_batch(trainer.get_tokenizer(), TEXTS[:2])
        trainer.forward_backward(batch, "cross_entropy").result()
        path = trainer.save_state("before-restart").result().path
        old_job = trainer.model_id
        service.close("success").result()
    with LabServer(home, port=lab.port) as lab2:
        probe = TimeSliceOrchestratorClient(lab2.grpc_target, api_key=lab2.api_key, job="probe")
        try:
            before = probe.timeline("default").last_seq
            service = tinker.ServiceClient(base_url=lab2.base_url, api_key=lab2.api_key)
            restored = service.create_training_client_from_state(path).result()
            leases = {L.name: L for L in probe.leases()}
            assert old_job not in leases  # closed with the kernel that made it, never asked to evict
            first = next(r for r in probe.timeline("default").records if r.seq > before)
            assert (first.job, first.kind) == (restored.model_id, "create_model")
            assert first.switch_s == 0.0 and first.evict_s == 0.0
            assert first.wait_s < leases[restored.model_id].holder_timeout_s
            assert probe.get_status("default").evictions == 0
            service.close("success").result()
        finally:
            probe.close()
