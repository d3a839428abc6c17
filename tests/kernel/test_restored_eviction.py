"""A job brought back from a checkpoint (weights and AdamW state, as `create_training_client_from_state_with_optimizer`
does after a control-plane restart) gives all its memory back when it is evicted, as a job made from scratch does
(issue 32): in-process, a real Engine on the built-in tiny model. On CPU the swap set's accounting says it (no byte
retained, no "still referenced" warning) and no storage of the job's state outlives the eviction; on CUDA
tests/kernel/test_engine_cuda.py checks `torch.cuda.memory_allocated` the same way."""

from __future__ import annotations

import gc
import warnings
import weakref

import numpy as np
import pytest
import torch

from openrl_lab.kernel.api import LoraSettings
from openrl_lab.kernel.engine import Engine
from tests.kernel.test_engine_cuda import MODEL, logprobs, step


@pytest.fixture
def engine(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return Engine(tmp_path / "home")


def _state_storages(engine: Engine, job_id: str) -> list[weakref.ref]:
    """Weak references to the storages of the job's trained tensors and AdamW moments."""
    job = engine._jobs[job_id]
    tensors = list(job.params.values())
    tensors += [v for st in job.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return [weakref.ref(t.untyped_storage()) for t in tensors if t.numel() > 1]


@pytest.mark.parametrize("lora", [LoraSettings(rank=4), None], ids=["lora", "full-finetune"])
def test_a_job_restored_from_a_checkpoint_frees_its_state_when_evicted(engine, tmp_path, lora):
    engine.create_job("a", MODEL, lora, seed=1)
    for i in range(2):
        step(engine, "a", i)
    path = str(tmp_path / "ckpt")
    engine.save_state("a", path, True, {})
    want = logprobs(engine, "a")
    engine.drop_job("a")
    engine.create_job_from_checkpoint("b", path, True)
    assert engine._jobs["b"].step == 2 and engine._jobs["b"].optimizer.state, "the AdamW state came back"
    storages = _state_storages(engine, "b")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "... still referenced ... stay allocated"
        engine.evict_job("b")
    gc.collect()
    row = engine.swap_counters().jobs["b"]
    assert row.bytes_evicted > 0 and row.bytes_retained == 0, row
    alive = [ref for ref in storages if ref() is not None and ref().nbytes() > 64]
    assert not alive, f"{len(alive)} storages of the evicted job are alive ({sum(r().nbytes() for r in alive)} bytes)"
    engine.restore_job("b")
    got = logprobs(engine, "b")
    assert all(np.array_equal(g, w) for g, w in zip(got, want)), "the restored job computes what the saved one did"
    step(engine, "b", 2)  # and trains on
