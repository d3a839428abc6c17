"""A kernel fixes torch's intra-op thread counts (they change float reductions, so seeded trajectories): a small
one for most work, a large one for large forward/backward passes."""

from __future__ import annotations

import os
import secrets
from typing import Protocol

import numpy as np
import pytest
import torch

from openrl_lab.kernel.api import LoraSettings, operations_of
from openrl_lab.kernel.client import KernelClient
from openrl_lab.kernel.engine import Engine
from openrl_lab.kernel.process import KernelServicer, _server
from openrl_lab.kernel.threads import (
    DEFAULT_KERNEL_THREADS,
    KERNEL_THREADS_ENV,
    LARGE_PASS_TOKENS,
    ThreadCounts,
    kernel_threads,
)
from openrl_lab.settings import SettingsError


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(KERNEL_THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return monkeypatch


def test_by_default_the_small_count_leaves_a_core_to_the_rest_and_both_are_capped(env):
    cores = len(os.sched_getaffinity(0))
    threads = kernel_threads()
    assert threads.large == max(1, min(cores, DEFAULT_KERNEL_THREADS))
    assert threads.small == max(1, min(cores - 1, DEFAULT_KERNEL_THREADS))
    if cores == 2:  # this machine kind: large passes on both cores, the rest (decoding too) on one
        assert threads == ThreadCounts(2, 1)


def test_pinned_cores_size_both(env):
    assert kernel_threads({0, 1, 2}) == ThreadCounts(3, 3)


def test_the_variable_wins(env):
    env.setenv(KERNEL_THREADS_ENV, "1")
    assert kernel_threads({0, 1, 2}) == ThreadCounts(1, 1)
    env.setenv(KERNEL_THREADS_ENV, "auto")
    assert kernel_threads() == ThreadCounts(None, None)


def test_omp_num_threads_is_left_to_torch(env):
    env.setenv("OMP_NUM_THREADS", "3")
    assert kernel_threads() == ThreadCounts(None, None)


def test_a_bad_value_is_named(env):
    env.setenv(KERNEL_THREADS_ENV, "0")
    with pytest.raises(SettingsError, match=f"{KERNEL_THREADS_ENV}='0'"):  # the kernel's start says it, one line
        kernel_threads()


class ThreadsApi(Protocol):
    def train(self) -> int: ...

    def sample(self) -> int: ...


class ThreadsEngine:
    """Each op answers torch's thread count on the thread it runs on; `sample` runs on the call's own thread."""

    concurrent_ops = frozenset({"sample"})

    def train(self) -> int:
        return torch.get_num_threads()

    def sample(self) -> int:
        return torch.get_num_threads()


@pytest.mark.server
def test_every_call_starts_with_the_small_count_on_whichever_thread_runs_it():
    key = secrets.token_hex(32)
    servicer = KernelServicer(
        ThreadsEngine(), key.encode(), operations=operations_of(ThreadsApi), threads=ThreadCounts(2, 1)
    )
    servicer.ready.set()
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the process-wide default new threads start from
    server, port = _server(servicer, "127.0.0.1", 0, None)
    client = KernelClient(("127.0.0.1", port), key)
    try:
        assert [client.call(op) for op in ("sample", "train", "sample", "train")] == [1, 1, 1, 1]
    finally:
        client.close()
        server.stop(0)
        torch.set_num_threads(before)


def test_a_large_pass_runs_with_the_large_count_and_a_small_one_with_the_callers(tmp_path):
    engine = Engine(tmp_path, threads=ThreadCounts(2, 1))
    engine.create_job("j", "openrl-lab/tiny-llama-1m", LoraSettings(rank=4, seed=0))
    job, seen = engine._jobs["j"], []
    real = job.forward_backward

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    job.forward_backward = spy

    def data(tokens: int) -> list:
        ids = np.arange(tokens, dtype=np.int64) % 200 + 5
        return [(ids, {"target_tokens": ids, "weights": np.ones(tokens, np.float32)})]

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for tokens in (24, LARGE_PASS_TOKENS, LARGE_PASS_TOKENS - 1):
            engine.forward_backward("j", data(tokens), "cross_entropy", None, True)
            assert torch.get_num_threads() == 1  # the caller's count again after the pass
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2, 1]
