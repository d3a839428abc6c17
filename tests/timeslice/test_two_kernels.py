"""Two kernel processes with different base models share one accelerator group: their phases interleave,
and each kernel moves its jobs' state AND its base model's weights off when the other kernel's job waits,
but only adapters when the waiter is one of its own jobs — without changing what any job computes."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

from openrl_lab.cluster.local import LocalKernel
from openrl_lab.orchestrator import TimeSliceOrchestratorClient, serve_orchestrator

pytestmark = pytest.mark.server  # starts a lab with two kernel processes

SMALL, BIG = "openrl-lab/tiny-llama-1m", "openrl-lab/tiny-llama-10m"
KEY, KERNEL_USER = "kernel-key", "openrl-kernel"
STEPS = 3
DATA = [
    (
        np.arange(5, 21, dtype=np.int64),
        {"target_tokens": np.arange(6, 22, dtype=np.int64), "weights": np.ones(16, dtype=np.float32)},
    ),
    (
        np.arange(40, 52, dtype=np.int64),
        {"target_tokens": np.arange(41, 53, dtype=np.int64), "weights": np.ones(12, dtype=np.float32)},
    ),
]
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
GREEDY = {"max_tokens": 6, "temperature": 0.0, "top_k": -1, "top_p": 1.0, "seed": 0, "stop": []}


def _train(kernel, job: str, out: list, start: threading.Barrier | None = None) -> None:
    if start is not None:
        start.wait()
    for _ in range(STEPS):
        r = kernel.call(
            "forward_backward", job_id=job, data=DATA, loss_fn="cross_entropy", loss_fn_config=None, backward=True
        )
        kernel.call("optim_step", job_id=job, adam=ADAM)
        out.append(r["metrics"]["loss:sum"])


def _sample(kernel, sampler: str) -> tuple:
    r = kernel.call(
        "sample", sampler_id=sampler, prompt=[5, 6, 7, 8], num_samples=1, params=GREEDY, want_prompt_logprobs=True
    )
    return r["sequences"], r["prompt_logprobs"][1:]  # the first prompt token has no logprob (NaN)


@pytest.fixture
def two_kernels(tmp_path):
    orch = serve_orchestrator(
        tmp_path / "orchestrator.db",
        port=0,
        authenticate={KEY: KERNEL_USER}.get,
        service_users={KERNEL_USER},
        config={"groups": [{"id": "default", "devices": ["accel:0"], "aliases": ["trainer-group", "sampler-group"]}]},
    )
    kernels = [
        LocalKernel("default", tmp_path / "home", "cpu", orchestrator=(orch.target, KEY), name=name)
        for name in ("kernel-a", "kernel-b")
    ]
    try:
        yield orch, [k.start() for k in kernels]
    finally:
        for k in kernels:
            k.stop()
        orch.stop(0).wait(5)


def test_two_kernels_with_different_base_models_interleave_through_eviction(two_kernels):
    orch, (a, b) = two_kernels
    # Solo curves first (each kernel alone on the group; the other has nothing on it yet).
    a.call("create_job", job_id="solo-a", base_model=SMALL, lora={"rank": 8, "seed": 1})
    solo_a: list[float] = []
    _train(a, "solo-a", solo_a)
    a.call("drop_job", job_id="solo-a")
    b.call("create_job", job_id="solo-b", base_model=BIG, lora={"rank": 8, "seed": 2})
    solo_b: list[float] = []
    _train(b, "solo-b", solo_b)
    b.call("drop_job", job_id="solo-b")
    # B had to evict A's base (A's last job was resident when B's first phase came): start counting here.
    before_a = a.call("swap_counters")["base"][SMALL]

    # A tenant switch between two jobs of the SAME kernel moves their adapters, never the shared base.
    a.call("create_job", job_id="a1", base_model=SMALL, lora={"rank": 8, "seed": 3})
    a.call("create_job", job_id="a2", base_model=SMALL, lora={"rank": 8, "seed": 4})
    for job in ("a1", "a2", "a1", "a2"):
        a.call("forward_backward", job_id=job, data=DATA, loss_fn="cross_entropy", loss_fn_config=None, backward=True)
    own = a.call("swap_counters")
    assert own["jobs"]["a1"]["evictions"] >= 2 and own["jobs"]["a2"]["evictions"] >= 1
    assert own["base"][SMALL]["evictions"] == before_a["evictions"]  # the base stayed on the device
    assert own["base"][SMALL]["resident"]

    # Samplers made before the other kernel takes the device: a snapshot of a job, and the bare base model.
    a.call("snapshot_sampler", job_id="a1", sampler_id="snap-a1")
    a.call("open_sampler", sampler_id="base-a", base_model=SMALL, path=None)
    snap_before, base_before = _sample(a, "snap-a1"), _sample(a, "base-a")

    # Both kernels train at once.
    a.call("create_job", job_id="pair-a", base_model=SMALL, lora={"rank": 8, "seed": 1})
    b.call("create_job", job_id="pair-b", base_model=BIG, lora={"rank": 8, "seed": 2})
    curves: list[list[float]] = [[], []]
    start = threading.Barrier(2)
    threads = [
        threading.Thread(target=_train, args=(k, job, c, start))
        for k, job, c in ((a, "pair-a", curves[0]), (b, "pair-b", curves[1]))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert curves == [solo_a, solo_b]  # bit-identical, although weights and adapters left the device and came back

    # The phases interleaved on the group's timeline ...
    probe = TimeSliceOrchestratorClient(orch.target, api_key=KEY, job="probe")
    try:
        recs = [
            r
            for r in probe.timeline("default").records
            if r.job in ("pair-a", "pair-b") and r.kind in ("forward_backward", "optim_step")
        ]
    finally:
        probe.close()
    jobs = [r.job for r in recs]
    assert sorted(jobs) == ["pair-a"] * 2 * STEPS + ["pair-b"] * 2 * STEPS
    assert sum(x != y for x, y in itertools.pairwise(jobs)) >= STEPS, jobs
    # ... and each kernel moved its base weights off for the other one and back for its own next phase,
    # whole: every eviction and every restore moved exactly the base model's bytes.
    ca, cb = a.call("swap_counters"), b.call("swap_counters")
    for c, model in ((ca, SMALL), (cb, BIG)):
        base = c["base"][model]
        assert base["evictions"] >= 2 and base["restores"] >= 2, (model, base)
        assert base["bytes_evicted"] == base["evictions"] * base["nbytes"]
        assert base["bytes_restored"] == base["restores"] * base["nbytes"]
        assert base["nbytes"] > 4_000_000  # the whole base model (1.1M / 10.1M fp32 parameters), not an adapter
    assert ca["base"][SMALL]["evictions"] > own["base"][SMALL]["evictions"]
    assert ca["jobs"]["pair-a"]["evictions"] >= 1 and cb["jobs"]["pair-b"]["evictions"] >= 1

    # Samplers made before all that still answer the same, on the restored weights.
    assert _sample(a, "snap-a1") == snap_before
    assert _sample(a, "base-a") == base_before
