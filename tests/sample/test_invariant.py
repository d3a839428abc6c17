"""What `sample/invariant.py` relies on and what it changes: the CPU BLAS computes a row alike for any number of
rows from `MIN_ROWS` on; padded linears and the per-request attention give what the unpadded model gives alone;
training through a model with the per-request attention installed is unchanged, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.nn import functional

from openrl_lab.sample import invariant
from openrl_lab.sample.torch_sampler import Batch
from tests.sample.test_torch_sampler import JOINERS, VOCAB, _alone, _rows, model_caller, tiny_llama


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("k,n", [(64, 128), (896, 4864), (4864, 896)])
def test_the_blas_computes_a_row_alike_from_min_rows_on(threads, k, n):
    """The property the padding stands on, on this machine: row i of x @ W.T is the same bits whether it is
    computed among MIN_ROWS rows or among many, at any offset."""
    torch.manual_seed(0)
    w, x = torch.randn(n, k), torch.randn(300, k)
    every = functional.linear(x, w)
    for rows in (invariant.MIN_ROWS, invariant.MIN_ROWS + 1, 31, 64, 129, 256):
        for offset in (0, 3, 16):
            some = functional.linear(x[offset : offset + rows], w)
            assert torch.equal(some, every[offset : offset + rows]), (rows, offset)


_KERNEL_BLAS = """
import torch
from torch.nn import functional
from openrl_lab.kernel.process import _pin
from openrl_lab.sample import invariant

_pin(None)  # what a kernel does first
torch.manual_seed(0)
for k, n in ((896, 4864), (4864, 896)):
    w, x = torch.randn(n, k), torch.randn(300, k)
    alike = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        every = functional.linear(x, w)
        alike[threads] = every
        for rows in (invariant.MIN_ROWS, 31, 64, 96, 129):
            assert torch.equal(functional.linear(x[:rows], w), every[:rows]), (k, n, threads, rows)
    assert torch.equal(alike[1], alike[2]), (k, n, "1 and 2 threads differ")
print("alike")
"""


@pytest.mark.server  # a fresh process, as a kernel starts
def test_a_kernel_process_computes_rows_alike_at_any_row_and_thread_count():
    """A kernel sets the BLAS's reproducible mode itself (kernel/threads.py), not only where a test has: a fresh
    process without MKL_CBWR, as a kernel starts, computes rows alike from MIN_ROWS rows on, with 1 thread or 2
    (on an AVX-512 Xeon at 2 threads, without it, 16-96 rows of the 896-input product took another path)."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run(
        [sys.executable, "-c", _KERNEL_BLAS], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "alike", out.stderr[-2000:]


def test_a_linear_on_few_rows_inside_a_layout_runs_on_min_rows():
    torch.manual_seed(0)
    w, b, x = torch.randn(32, 24), torch.randn(32), torch.randn(3, 1, 24)
    padded = torch.cat([x.reshape(3, 24), torch.zeros(invariant.MIN_ROWS - 3, 24)])
    with invariant.layout([(0, 3, 1)], rows=3):
        got = functional.linear(x, w, b)
        vector = functional.linear(x[0, 0], w)  # a single vector has no rows to pad: left alone
    assert got.shape == (3, 1, 32)
    assert torch.equal(got.reshape(3, 32), functional.linear(padded, w, b)[:3])
    assert torch.equal(vector, functional.linear(x[0, 0], w))


def _three_together(call):
    """The first three JOINERS added at once to one batch and decoded to the end: (the batch, their rows)."""
    batch = Batch(call, vocab_size=VOCAB)
    requests = [_rows(p, kw["n"], **{k: v for k, v in kw.items() if k != "n"}) for _, p, kw in JOINERS[:3]]
    batch.add(*requests)
    while batch:
        batch.step()
    return batch, requests


def test_without_the_per_request_attention_a_batch_still_runs_and_says_it_is_not_exact():
    """A model outside transformers' attention interface (or not installed) still batches: the same tokens, and
    `Batch.exact` False since its padded rows compute in other shapes."""
    torch.manual_seed(0)
    plain = tiny_llama()
    plain.set_attn_implementation("sdpa")  # undo the fixture's install
    call = model_caller(plain)
    batch, requests = _three_together(call)
    assert batch.exact is False
    for (_, prompt, kw), r in zip(JOINERS[:3], requests):
        assert [s.tokens for s in r.out] == [s.tokens for s in _alone(call, prompt, kw)]


def test_install_wraps_eager_attention_too_and_refuses_what_it_cannot_reach():
    eager = tiny_llama()
    eager.set_attn_implementation("eager")
    assert invariant.install(eager) and eager.config._openrl_inner_attention == "eager"
    assert invariant.install(eager)  # twice is once
    assert not invariant.install(torch.nn.Linear(4, 4))
    call = model_caller(eager)
    batch, requests = _three_together(call)
    assert batch.exact is True
    for (_, prompt, kw), r in zip(JOINERS[:3], requests):
        alone = _alone(call, prompt, kw)
        assert [(s.tokens, s.logprobs) for s in r.out] == [(s.tokens, s.logprobs) for s in alone]


def test_training_through_the_installed_attention_is_unchanged_bit_for_bit():
    """The trainer's forward/backward (padded batches with a mask, and plain ones) on a model with the per-request
    attention installed: the same loss and gradients as the model without it."""
    ids = torch.tensor([[5, 17, 42, 99, 7, 250], [0, 0, 3, 9, 11, 12]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    got, want = [], []
    for model, out in ((tiny_llama(), got), (tiny_llama(), want)):
        if out is want:
            model.set_attn_implementation("sdpa")
        for kwargs in ({"attention_mask": mask}, {}):
            model.zero_grad()
            loss = model(input_ids=ids, labels=ids, **kwargs).loss
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for (loss_got, grads_got), (loss_want, grads_want) in zip(got, want):
        assert torch.equal(loss_got, loss_want)
        assert all(torch.equal(a, b) for a, b in zip(grads_got, grads_want))
