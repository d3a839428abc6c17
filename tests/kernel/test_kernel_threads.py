"""A kernel fixes torch's intra-op thread count (it changes float reductions, so seeded trajectories)."""

from __future__ import annotations

import os

import pytest

from openrl_lab.kernel.process import DEFAULT_KERNEL_THREADS, KERNEL_THREADS_ENV, kernel_threads
from openrl_lab.settings import SettingsError


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(KERNEL_THREADS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return monkeypatch


def test_the_default_leaves_a_core_to_the_rest_and_is_capped(env):
    cores = len(os.sched_getaffinity(0))
    assert kernel_threads() == max(1, min(cores - 1, DEFAULT_KERNEL_THREADS))
    if cores <= 2:
        assert kernel_threads() == 1


def test_pinned_cores_size_the_pool(env):
    assert kernel_threads({0, 1, 2}) == 3


def test_the_variable_wins(env):
    env.setenv(KERNEL_THREADS_ENV, "1")
    assert kernel_threads({0, 1, 2}) == 1
    env.setenv(KERNEL_THREADS_ENV, "auto")
    assert kernel_threads() is None


def test_omp_num_threads_is_left_to_torch(env):
    env.setenv("OMP_NUM_THREADS", "3")
    assert kernel_threads() is None


def test_a_bad_value_is_named(env):
    env.setenv(KERNEL_THREADS_ENV, "0")
    with pytest.raises(SettingsError, match=f"{KERNEL_THREADS_ENV}='0'"):  # the kernel's start says it, one line
        kernel_threads()
