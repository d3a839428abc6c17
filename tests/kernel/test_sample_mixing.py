"""Concurrent sample calls on different samplers of one base model, in one lease, are one batch (in-process engine,
the built-in tiny Llama, a gate that says which lease each key runs under): two jobs' snapshots, an older snapshot
of one of them, a sampler on a saved checkpoint and one on the base model decode together, each row through its own
weights, bit for bit what it gives alone; a call of another lease keeps to its own phase."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from openrl_lab.kernel.api import AdamSettings, LoraSettings, SamplingParams
from openrl_lab.kernel.engine import Cancelled, Engine

MODEL = "openrl-lab/tiny-llama-1m"
PROMPTS = [[5 + i, 17, 42 + 2 * i, 9][: 2 + i % 3] for i in range(12)]  # lengths 2..4
SHARED = ["a-new", "a-old", "b-now", "b-file", "base"]  # samplers whose phases all run under one lease


class LeaseGate:
    """Counts the phases, can hold the group (as another job's phase would), and says which lease a key runs under:
    `OTHER` for the keys in it, one shared lease for the rest."""

    OTHER = frozenset({"solo"})

    def __init__(self):
        self.phases: list[tuple[str, str]] = []
        self.held = threading.Lock()

    @contextlib.contextmanager
    def phase(self, job_id: str, kind: str):
        with self.held:
            self.phases.append((job_id, kind))
            yield

    def lease_of(self, job_id: str) -> str:
        return "other" if job_id in self.OTHER else "shared"


def _train(engine: Engine, job: str, steps: int, seed: int) -> None:
    """Cross-entropy steps on random tokens: the adapter moves off its zero start."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = rng.integers(3, 200, size=12).astype(np.int64)
        datum = (tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(11, np.float32)})
        engine.forward_backward(job, [datum], "cross_entropy", None, True)
        engine.optim_step(job, AdamSettings(learning_rate=5e-2))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    home = tmp_path_factory.mktemp("kernel-home")
    e = Engine(home, gate=LeaseGate())
    for job, seed in (("a", 1), ("b", 2), ("solo", 3)):
        e.create_job(job, MODEL, LoraSettings(rank=4, seed=seed))
        _train(e, job, 2, seed)
    e.snapshot_sampler("a", "a-old")
    _train(e, "a", 1, 9)  # a-old is now an older snapshot than a's live weights
    e.snapshot_sampler("a", "a-new")
    e.snapshot_sampler("b", "b-now")
    e.snapshot_sampler("solo", "solo-now")
    path = str(home / "b-weights")
    e.save_sampler_weights("b", path, {})
    e.open_sampler("b-file", None, path)
    e.open_sampler("base", MODEL, None)
    return e


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=5 + i % 4, temperature=1.0, seed=300 + i, stop=[])


def _calls(samplers: list[str]) -> list[tuple[str, int]]:
    return [(s, i) for i in range(3) for s in samplers]


def _sample(engine, sampler: str, i: int, prompt_logprobs: bool = False):
    return engine.sample(sampler, PROMPTS[i], 4, _params(i), prompt_logprobs, 2 if prompt_logprobs else 0)


def _at_once(engine, calls, prompt_logprobs: bool = False, leader: tuple[str, int] | None = None):
    """All calls from their own threads, released together while another phase holds the group. `leader`: a call
    that starts first and leads the batch the others join."""
    gate, backend = engine.gate, engine.sampler_backends[0]
    with ThreadPoolExecutor(len(calls) + 1) as pool:
        with gate.held:
            first = pool.submit(_sample, engine, *leader, prompt_logprobs) if leader else None
            while leader and not backend._leading:
                threading.Event().wait(0.01)
            futures = [pool.submit(_sample, engine, s, i, prompt_logprobs) for s, i in calls]
            for _ in range(300):  # until every call waits in the batcher (the first may lead)
                if len(backend._queue) >= len(calls) - (0 if leader else 1):
                    break
                threading.Event().wait(0.01)
        got = [f.result() for f in futures]
        return (first.result() if first else None), got


def _same(got, want) -> None:
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    assert [s.logprobs for s in got.sequences] == [s.logprobs for s in want.sequences]


def test_calls_on_five_samplers_of_one_lease_are_one_batch_and_each_row_its_own(engine):
    calls = _calls(SHARED)
    alone = [_sample(engine, s, i) for s, i in calls]
    backend = engine.sampler_backends[0]
    before, mixed = len(engine.gate.phases), backend.mixed
    _, together = _at_once(engine, calls)
    phases = [p for p in engine.gate.phases[before:] if p[1] == "sample"]
    assert 1 <= len(phases) <= 2, phases  # one for all (two when the first call started alone)
    assert backend.mixed > mixed
    for got, want in zip(together, alone):
        _same(got, want)
    by = dict(zip(calls, together))
    # Each row ran through its own weights: an older snapshot, another job and the base sample other tokens; the
    # checkpoint of b's weights samples what b's snapshot does.
    assert by["a-new", 0].sequences[0].logprobs != by["a-old", 0].sequences[0].logprobs
    assert by["a-new", 0].sequences[0].logprobs != by["b-now", 0].sequences[0].logprobs
    assert by["a-new", 0].sequences[0].logprobs != by["base", 0].sequences[0].logprobs
    _same(by["b-file", 1], by["b-now", 1])


def test_prompt_logprobs_and_top_k_in_a_mixed_batch_are_each_samplers_own(engine):
    calls = _calls(["a-new", "b-now", "base"])
    alone = [_sample(engine, s, i, True) for s, i in calls]
    _, together = _at_once(engine, calls, prompt_logprobs=True)
    for got, want in zip(together, alone):
        _same(got, want)
        np.testing.assert_array_equal(got.prompt_logprobs, want.prompt_logprobs)
        np.testing.assert_array_equal(got.topk_prompt_logprobs.logprobs, want.topk_prompt_logprobs.logprobs)
        np.testing.assert_array_equal(got.topk_prompt_logprobs.token_ids, want.topk_prompt_logprobs.token_ids)
    assert together[0].prompt_logprobs[1:] != together[1].prompt_logprobs[1:]


def test_a_joining_job_whose_state_is_evicted_samples_its_snapshot(engine):
    """A call of job b that joins a batch led by job a's call runs in a's phase, where b's state need not be on the
    device (the gate restores only a's): it runs on b's snapshot, never on b's evicted live weights."""
    want = [_sample(engine, "b-now", i) for i in range(3)]
    lead_want = _sample(engine, "a-new", 0)
    engine.evict_job("b")
    try:
        lead, got = _at_once(engine, [("b-now", i) for i in range(3)], leader=("a-new", 0))
    finally:
        engine.restore_job("b")
    _same(lead, lead_want)
    for g, w in zip(got, want):
        _same(g, w)


def test_a_call_of_another_lease_keeps_to_its_own_phase(engine):
    calls = _calls(["a-new", "solo-now"])
    alone = [_sample(engine, s, i) for s, i in calls]
    backend = engine.sampler_backends[0]
    before, mixed = len(engine.gate.phases), backend.mixed
    _, together = _at_once(engine, calls)
    keys = [k for k, kind in engine.gate.phases[before:] if kind == "sample"]
    assert set(keys) == {"a", "solo"} and backend.mixed == mixed, keys
    for got, want in zip(together, alone):
        _same(got, want)


def test_a_cancelled_sampler_in_a_mixed_batch_ends_alone(engine):
    engine.open_sampler("doomed", MODEL, None)
    want = [_sample(engine, "b-now", i) for i in range(3)]
    long = SamplingParams(max_tokens=120, seed=7, stop=[])
    out: dict[str, object] = {}

    def call(name, sampler, i, params):
        try:
            out[name] = engine.sample(sampler, PROMPTS[i], 4, params, False)
        except Cancelled as e:
            out[name] = e

    threads = [threading.Thread(target=call, args=(f"doomed{i}", "doomed", i, long)) for i in range(3)]
    threads += [threading.Thread(target=call, args=(f"b{i}", "b-now", i, _params(i))) for i in range(3)]
    with engine.gate.held:
        for t in threads:
            t.start()
        while len(engine.sampler_backends[0]._queue) < len(threads) - 1:
            threading.Event().wait(0.01)
    engine.cancel(["doomed"])
    for t in threads:
        t.join(timeout=120)
    assert all(isinstance(out[f"doomed{i}"], Cancelled) for i in range(3)), out
    for i in range(3):
        _same(out[f"b{i}"], want[i])
    engine.drop_sampler("doomed")


def test_mixing_off_keeps_each_sampler_to_its_own_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENRL_KERNEL_SAMPLE_MIX", "0")
    e = Engine(tmp_path, gate=LeaseGate())
    e.create_job("a", MODEL, LoraSettings(rank=4, seed=1))
    e.snapshot_sampler("a", "a-now")
    e.open_sampler("base", MODEL, None)
    backend = e.sampler_backends[0]
    _at_once(e, _calls(["a-now", "base"]))
    assert backend.mixed == 0
    assert {k for k, kind in e.gate.phases if kind == "sample"} == {"a", "base"}
