"""Primitives from the gateway run as phases through the orchestrator; jobs interleave, and a job's state
is swapped out when another job needs the device — without changing what the job computes."""

from __future__ import annotations

import itertools
import threading
import time

import tinker
from tinker import types

from openrl_lab.orchestrator import TimeSliceOrchestratorClient

from ..conftest import make_key
from ..gateway.helpers import TEXTS, new_trainer, sft_batch

STEPS = 4


def _run(trainer, batch, out: list, start: threading.Barrier | None = None) -> None:
    if start is not None:
        start.wait()
    for _ in range(STEPS):
        fb = trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        out.append(fb.result().metrics["loss:sum"])


def test_time_sliced_loss_curve_equals_solo_curve(lab, service):
    tok = new_trainer(service).get_tokenizer()
    batch = sft_batch(tok, TEXTS)
    solo: list[float] = []
    solo_trainer = new_trainer(service, seed=21)
    solo_start = time.time()
    _run(solo_trainer, batch, solo)
    solo_end = time.time()

    other_key = make_key(lab.home, "bob")
    other = tinker.ServiceClient(base_url=lab.base_url, api_key=other_key)
    trainers = [new_trainer(service, seed=21), new_trainer(service, seed=22), new_trainer(other, seed=23)]
    curves: list[list[float]] = [[] for _ in trainers]
    start = threading.Barrier(len(trainers))
    threads = [threading.Thread(target=_run, args=(t, batch, c, start)) for t, c in zip(trainers, curves)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(len(c) == STEPS for c in curves)
    assert curves[0] == solo  # bit-identical although its adapter and AdamW state were swapped out and back

    # every record (a page holds the oldest 1000 by default, and the session's lab has run many tests' phases)
    probe = TimeSliceOrchestratorClient(lab.grpc_target, api_key=lab.api_key, job="probe")
    timeline = probe.timeline("default", limit=100_000)
    df = timeline.to_dataframe()
    shared = df[df["kind"].isin(["forward_backward", "optim_step"])].tail(3 * 2 * STEPS)
    # the three jobs interleaved phase by phase (not one whole run after another) ...
    leases = shared["lease_ref"].tolist()
    switches = sum(a != b for a, b in itertools.pairwise(leases))
    assert switches >= STEPS, leases
    # ... and state moved only because someone was waiting
    assert (shared["evict_s"] > 0).sum() >= STEPS and shared["must_restore"].sum() >= STEPS
    # Lazy yield: once the solo job had the device to itself, nothing was evicted or restored. (Its first
    # phase may have had to evict an idle job of an earlier test that was still holding its state there.)
    alone = df[
        (df["requested_at"] >= solo_start)
        & (df["released_at"] <= solo_end)
        & df["kind"].isin(["forward_backward", "optim_step"])
    ]
    assert len(alone) == 2 * STEPS
    assert (alone["evict_s"].iloc[1:] == 0).all() and not alone["must_restore"].iloc[1:].any()
    other.close("success").result()


def test_full_finetunes_time_sliced_keep_their_solo_loss_curves(lab, service):
    """Two full fine-tuning runs (LoRA rank 0: each its own copy of the weights) on one group: each one's whole
    weights and AdamW moments leave the device when the other needs it, and come back bit-exact."""
    tok = new_trainer(service).get_tokenizer()
    batch = sft_batch(tok, TEXTS)
    solo: list[float] = []
    _run(new_trainer(service, rank=0), batch, solo)

    trainers = [new_trainer(service, rank=0) for _ in range(2)]
    assert not any(t.get_info().is_lora for t in trainers)
    curves: list[list[float]] = [[] for _ in trainers]
    start = threading.Barrier(len(trainers))
    since = time.time()
    threads = [threading.Thread(target=_run, args=(t, batch, c, start)) for t, c in zip(trainers, curves)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert curves == [solo, solo]  # bit-identical to the solo run: the same base weights, steps and data

    df = (
        TimeSliceOrchestratorClient(lab.grpc_target, api_key=lab.api_key, job="probe")
        .timeline("default", limit=100_000)  # all of them, not the oldest page
        .to_dataframe()
    )
    shared = df[(df["requested_at"] >= since) & df["kind"].isin(["forward_backward", "optim_step"])]
    leases = shared["lease_ref"].tolist()
    assert sum(a != b for a, b in itertools.pairwise(leases)) >= STEPS, leases  # interleaved, not one after the other
    assert (shared["evict_s"] > 0).sum() >= STEPS and shared["must_restore"].sum() >= STEPS  # whole states moved
