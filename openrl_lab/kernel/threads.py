"""torch's intra-op thread counts in a kernel: a small count for most work, a large one for large passes.

$OPENRL_KERNEL_THREADS sets both (a number, or "auto" for torch's own choice, one per physical core), else one
per pinned core (--cores), else $OMP_NUM_THREADS if set (torch reads it). Else the large count is the cores this
process may use and the small one the cores but one (left to the control plane and the client on the same
machine), each at least 1 and at most DEFAULT_KERNEL_THREADS.

Why two (docs/benchmarks.md, issue 27). Decoding and small steps are many tiny ops, each ending in a barrier that
waits for the slowest thread: on 2 busy cores a 2-thread kernel sampled at 0.2-0.3 of a 1-thread one, and a small
SDK step (4 x 24 tokens) took 46 ms with 2 threads against 39 with 1, its threads competing with the gateway and
the client for the same cores. A forward/backward pass over LARGE_PASS_TOKENS tokens or more is a few large
matrix products, which more threads speed up (a 128-datum GRPO step trained in 0.24 s on 2 threads against 0.37
on 1) and a busy machine slows in proportion, whatever the count.

Fixed counts, chosen by the call's size only: the count can change how float reductions are split, so a seeded
run gives the same numbers on every machine with at least that many cores, loaded or not (docs/benchmarks.md,
"Tutorial checks"). OpenMP keeps the count per thread: each thread that runs torch work sets its own.

The BLAS in strict reproducible mode (`reproducible_blas`, MKL's `MKL_CBWR=AUTO,STRICT`): without it, MKL may
split a matrix product's sums another way for another thread count, or for fewer rows. On an AVX-512 Xeon at 2
threads, a product with 896 inputs (Qwen2.5-0.5B's width) took one path up to 96 rows and another from 128, so a
row batched with many others differed from the row alone (what the sampler's batching stands on: sample/invariant.py),
and 1 and 2 threads differed with 4864 inputs. In strict mode both agree there, bit for bit, at no measured cost
for 16 rows or more (docs/benchmarks.md).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

from openrl_lab.settings import settings

KERNEL_THREADS_ENV = "OPENRL_KERNEL_THREADS"
REPRODUCIBLE_BLAS = ("MKL_CBWR", "AUTO,STRICT")
DEFAULT_KERNEL_THREADS = 2
LARGE_PASS_TOKENS = 512  # where 2 threads began to win over 1 on 2 shared cores (docs/benchmarks.md)


@dataclass(frozen=True)
class ThreadCounts:
    """torch intra-op threads (None: torch's default) for large forward/backward passes and for all else."""

    large: int | None
    small: int | None

    def for_pass(self, tokens: int) -> int | None:
        """The count for a forward(/backward) pass over `tokens` tokens in all."""
        return self.large if tokens >= LARGE_PASS_TOKENS else self.small


NO_CHOICE = ThreadCounts(None, None)


def kernel_threads(cores: set[int] | None = None) -> ThreadCounts:
    """The thread counts a kernel uses; see the module's docstring."""
    env = settings().kernel_threads
    if env == "auto":
        return NO_CHOICE
    if env is not None:
        return ThreadCounts(env, env)
    if cores:
        return ThreadCounts(len(cores), len(cores))
    if os.environ.get("OMP_NUM_THREADS"):  # the user's own setting, which torch reads
        return NO_CHOICE
    usable = len(os.sched_getaffinity(0))
    return ThreadCounts(max(1, min(usable, DEFAULT_KERNEL_THREADS)), max(1, min(usable - 1, DEFAULT_KERNEL_THREADS)))


def reproducible_blas() -> None:
    """MKL's strict reproducible mode for this process and the ones it starts (rank workers); see the module's
    docstring. MKL reads it at its first call, so this runs before any torch work; a user's own MKL_CBWR stays."""
    os.environ.setdefault(*REPRODUCIBLE_BLAS)


def use_threads(n: int | None) -> None:
    """Sets torch's intra-op thread count for the calling thread (None: leaves it)."""
    if n is None:
        return
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@contextmanager
def threads_for(n: int | None):
    """`n` threads for the calling thread while the block runs, then the count it had."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    use_threads(n)
    try:
        yield
    finally:
        use_threads(before)
