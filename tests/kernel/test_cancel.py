"""Cancelling a run's calls in the kernel's engine (in-process): the running call stops at its next cancel
point, later calls are refused, and dropping the run clears the mark."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from openrl_lab.kernel.api import AdamSettings, LoraSettings, SamplingParams
from openrl_lab.kernel.engine import Cancelled, Engine, NotFound

MODEL = "openrl-lab/tiny-llama-1m"
DATA = [
    (
        np.arange(5, 37, dtype=np.int64),
        {"target_tokens": np.arange(6, 38, dtype=np.int64), "weights": np.ones(32, np.float32)},
    )
] * 8
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, stop=[])


class CancelInsidePhase:
    """A gate that cancels `victim` once its phase has begun: the call is then past every check made before
    the work, so only a cancel point inside the work can stop it."""

    def __init__(self):
        self.engine: Engine | None = None
        self.victim: str | None = None
        self.phases: list[str] = []

    @contextlib.contextmanager
    def phase(self, job_id: str, kind: str):
        self.phases.append(kind)
        if job_id == self.victim:
            self.engine.cancel([job_id])
        yield


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    gate = CancelInsidePhase()
    gate.engine = Engine(tmp_path_factory.mktemp("kernel-home"), gate=gate)
    return gate.engine


def test_a_running_forward_backward_stops_at_its_next_micro_batch(engine):
    engine.create_job("fb", MODEL, LoraSettings(rank=4, seed=1))
    engine._jobs["fb"].host.tokens_per_microbatch = 32  # one datum per micro-batch: eight cancel points
    engine.gate.victim = "fb"
    with pytest.raises(Cancelled, match="fb: cancelled"):
        engine.forward_backward("fb", DATA, "cross_entropy", None, True)
    assert engine.gate.phases[-1] == "forward_backward"  # it got as far as the work itself
    with pytest.raises(Cancelled):  # and later calls are refused before any phase
        engine.optim_step("fb", AdamSettings(learning_rate=1e-3))
    assert engine.gate.phases[-1] == "forward_backward"
    engine.drop_job("fb")
    with pytest.raises(NotFound):
        engine.optim_step("fb", AdamSettings(learning_rate=1e-3))


def test_a_running_sample_stops_and_other_jobs_are_untouched(engine):
    engine.gate.victim = None
    engine.create_job("keep", MODEL, LoraSettings(rank=4, seed=2))
    engine.create_job("gone", MODEL, LoraSettings(rank=4, seed=3))
    engine.snapshot_sampler("gone", "gone-s1")
    engine.gate.victim = "gone"  # sample phases run under the job the snapshot came from
    with pytest.raises(Cancelled, match="gone-s1 / gone: cancelled"):
        engine.sample("gone-s1", [5, 6, 7], 2, GREEDY, False)
    out = engine.forward_backward("keep", DATA[:2], "cross_entropy", None, True)
    assert np.isfinite(out.metrics["loss:sum"])
    engine.drop_job("gone")
    engine.gate.victim = None
    engine.create_job("gone", MODEL, LoraSettings(rank=4, seed=3))  # an id freed and used again starts clean
    assert np.isfinite(engine.forward_backward("gone", DATA[:1], "cross_entropy", None, True).metrics["loss:sum"])
