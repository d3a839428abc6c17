"""The kernel's Engine on a CUDA device (`pytest -m cuda`; `make gpu-check` runs it), in-process, on the built-in
tiny model (built in the temporary home, no downloads): evicting a job gives `torch.cuda.memory_allocated` back
to what the base model alone holds (also for a job loaded from a checkpoint with its AdamW state), a restored job
computes the same numbers, the base model's own eviction frees its weights, and the torch sampler samples a
snapshot on the GPU. Deselected by default, skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from openrl_lab.kernel.api import AdamSettings, LoraSettings, SamplingParams
from openrl_lab.kernel.engine import Engine

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

MODEL = "openrl-lab/tiny-llama-1m"
ADAM = AdamSettings(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
SLACK = 1 << 20  # evicted tensors stay as one-element placeholders (a 512-byte block each in the allocator)


def data(seed: int):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(4):
        tokens = rng.integers(3, 200, size=24).astype(np.int64)
        out.append((tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(23, np.float32)}))
    return out


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def step(engine: Engine, job: str, seed: int) -> None:
    engine.forward_backward(job, data(seed), "cross_entropy", None, True)
    engine.optim_step(job, ADAM)


def logprobs(engine: Engine, job: str) -> list[np.ndarray]:
    return [np.asarray(x) for x in engine.forward_backward(job, data(99), "cross_entropy", None, False).logprobs]


@pytest.fixture
def engine(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    e = Engine(tmp_path / "home", device="cuda")
    # the base model, and what the first steps allocate for good (cuBLAS workspaces), before any job is counted
    e.create_job("warm", MODEL, LoraSettings(rank=4), seed=0)
    step(e, "warm", 0)
    e.drop_job("warm")
    return e


@pytest.mark.parametrize("lora", [LoraSettings(rank=16), None], ids=["lora", "full-finetune"])
def test_evicting_a_job_gives_the_device_memory_back_to_the_base(engine, lora):
    base = allocated()
    engine.create_job("a", MODEL, lora, seed=1)
    for i in range(2):
        step(engine, "a", i)
    want = logprobs(engine, "a")
    held = allocated()
    job_bytes = held - base
    assert job_bytes > 0
    engine.evict_job("a")
    row = engine.swap_counters().jobs["a"]
    assert not row.resident and row.bytes_evicted > 0
    assert allocated() <= base + SLACK, (
        f"after evicting job a ({row['nbytes']} bytes registered) {allocated() - base} bytes are still allocated "
        f"above the base model's {base}"
    )
    assert engine.memory()["used_bytes"] < engine.memory()["budget_bytes"]
    engine.restore_job("a")
    assert allocated() >= held - SLACK
    got = logprobs(engine, "a")
    assert all(np.array_equal(g, w) for g, w in zip(got, want)), "a restored job computes other numbers"
    step(engine, "a", 2)  # and trains on


@pytest.mark.parametrize("lora", [LoraSettings(rank=16), None], ids=["lora", "full-finetune"])
def test_a_job_restored_from_a_checkpoint_gives_its_device_memory_back_when_evicted(engine, tmp_path, lora):
    """Issue 32: a run loaded with its AdamW state (a control-plane restart) frees all of it, as a fresh one does."""
    base = allocated()
    engine.create_job("a", MODEL, lora, seed=1)
    for i in range(2):
        step(engine, "a", i)
    engine.save_state("a", str(tmp_path / "ckpt"), True, {})
    engine.drop_job("a")
    assert allocated() <= base + SLACK
    engine.create_job_from_checkpoint("b", str(tmp_path / "ckpt"), True)
    assert allocated() > base + SLACK
    engine.evict_job("b")
    row = engine.swap_counters().jobs["b"]
    assert row.bytes_retained == 0 and allocated() <= base + SLACK, (row, allocated() - base)
    engine.restore_job("b")
    step(engine, "b", 2)


def test_evicting_the_base_model_frees_its_weights_and_the_next_phase_brings_them_back(engine):
    engine.create_job("a", MODEL, LoraSettings(rank=8), seed=2)
    step(engine, "a", 0)
    want = logprobs(engine, "a")
    engine.evict_job("a")
    held = allocated()
    engine.evict_shared()
    base = engine.swap_counters().base[MODEL]
    assert not base.resident and held - allocated() >= 0.99 * base.nbytes
    engine.restore_job("a")
    got = logprobs(engine, "a")  # its phase restores the base model first
    assert engine.swap_counters().base[MODEL].resident
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_the_torch_sampler_samples_a_snapshot_on_the_gpu(engine):
    engine.create_job("a", MODEL, LoraSettings(rank=8), seed=3)
    step(engine, "a", 0)
    engine.snapshot_sampler("a", "snap")
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, stop=[])
    out = engine.sample("snap", [5, 17, 42, 99], 8, params, True)
    again = engine.sample("snap", [5, 17, 42, 99], 8, params, False)
    assert len(out.sequences) == 8 and all(len(s.tokens) == 12 for s in out.sequences)
    assert [s.tokens for s in out.sequences] == [s.tokens for s in again.sequences]  # seeded on the GPU too
    assert all(lp <= 0 for s in out.sequences for lp in s.logprobs)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 4
