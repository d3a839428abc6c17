"""A job sharded over 2 ranks with FSDP2 (`train/distributed.py`) against the same job on one device: real processes,
real gloo, the built-in tiny model. 10 steps of forward_backward(cross_entropy) + optim_step give the same losses,
per-datum logprobs come back in the datum order, checkpoints go both ways (saved on 2 loaded on 1 and on 2, saved on
1 loaded on 2) and a rank's eviction and restore are bit-exact.

Tolerance: losses within rtol 1e-5, logprobs within 1e-4 (absolute). The two runs add the same float32 numbers in
another order (the reduce-scatter sums two ranks' gradients; each rank's micro-batches have other shapes); measured
differences are ~1e-7 relative after 10 steps (LoRA and full fine-tuning), two orders of magnitude inside.
"""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

from openrl_lab.train.hparams import AdamSettings, LoraSettings

pytestmark = pytest.mark.server  # starts processes

STEPS = 10
ADAM = AdamSettings(learning_rate=1e-3, grad_clip_norm=1.0)
MICROBATCH = 16  # tokens: rank 1's two data take two passes, rank 0's one datum one (a zero-weighted pass pads it)
TEXTS = ["what is 12 + 7? the answer is 19.", "3*4=12", "the cat sat on the mat, then it slept."]
RTOL, ATOL = 1e-5, 1e-4


def _batch(tokenizer):
    from openrl_lab.train.trainer import Datum

    out = []
    for text in TEXTS:
        ids = np.array(tokenizer.encode(text), dtype=np.int64)
        out.append(Datum(tokens=ids[:-1], inputs={"target_tokens": ids[1:]}))
    return out


def _train(job, data) -> dict:
    """STEPS steps; the losses, the grad norms and the first step's logprobs."""
    losses, norms, first = [], [], None
    for _ in range(STEPS):
        out = job.forward_backward(data, "cross_entropy")
        first = first if first is not None else out.logprobs
        losses.append(out.metrics["loss:sum"])
        norms.append(job.optim_step(ADAM)["grad_norm:mean"])
    return {"losses": losses, "norms": norms, "logprobs": first}


def _next_loss(job, data) -> float:
    return job.forward_backward(data, "cross_entropy", backward=False).metrics["loss:sum"]


def _rank(rank: int, port: int, model_dir: str, lora, ckpt_one: str, ckpt_two: str, out: str) -> None:
    """One rank: train, evict/restore, save, load the 1-device checkpoint and its own; its results (or its
    traceback) pickled to `out`."""
    try:
        import torch.distributed as dist

        from openrl_lab.train.distributed import ShardedJob, init_gang

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
        init_gang(store, rank, 2, "cpu", timeout_s=60)
        job = ShardedJob(model_dir, "j", lora, seed=7, tokens_per_microbatch=MICROBATCH)
        data = _batch(job.host.tokenizer)
        got = _train(job, data)
        # evict/restore of this rank's shards, gradients (a pending forward_backward's) and AdamW moments
        job.forward_backward(data, "cross_entropy")
        before = [t.clone() for t in _rank_state(job)]
        moved = job.evict()
        emptied = _all_empty(job)
        job.restore()
        after = _rank_state(job)
        got["evict"] = (
            moved,
            emptied,
            len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)),
        )
        job.optimizer.zero_grad(set_to_none=True)
        got["next"] = _next_loss(job, data)
        got["size"] = job.save(ckpt_two)
        job.load(ckpt_one, include_optimizer=True)  # saved on 1, loaded on 2
        got["from_one"] = (_next_loss(job, data), job.step)
        for _ in range(2):
            job.forward_backward(data, "cross_entropy")
            job.optim_step(ADAM)
        got["from_one_stepped"] = _next_loss(job, data)
        job.load(ckpt_two, include_optimizer=True)  # saved on 2, loaded on 2
        got["from_two"] = _next_loss(job, data)
        got["state_bytes"] = job.state_bytes
        Path(out).write_bytes(pickle.dumps(got))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        Path(out).write_bytes(pickle.dumps(traceback.format_exc()))


def _rank_state(job) -> list[torch.Tensor]:
    from openrl_lab.train.distributed import _local

    out = []
    for p in job.module.parameters():
        out.append(_local(p))
        if p.grad is not None:
            out.append(_local(p.grad))
    for st in job.optimizer.state.values():
        out += [_local(v) for v in st.values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() if t.untyped_storage().nbytes() else t for t in out]


def _all_empty(job) -> bool:
    from openrl_lab.train.distributed import _local

    return all(_local(p).untyped_storage().nbytes() == 0 for p in job.module.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gang(model_dir, lora, ckpt_one, ckpt_two) -> dict:
    # Plain child processes (not multiprocessing's spawn, whose resource tracker would outlive the test)
    port = _free_port()
    outs = [Path(ckpt_two).parent / f"rank{r}.pickle" for r in range(2)]
    code = (
        "import pickle, sys; from tests.train.test_distributed import _rank; "
        "_rank(*pickle.loads(bytes.fromhex(sys.argv[1])))"
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                pickle.dumps((r, port, str(model_dir), lora, str(ckpt_one), str(ckpt_two), str(outs[r]))).hex(),
            ],
            cwd=Path(__file__).resolve().parents[2],
        )
        for r in range(2)
    ]
    try:
        for p in procs:
            p.wait(timeout=120)  # a liveness bound, not a performance figure
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {
        r: pickle.loads(outs[r].read_bytes()) if outs[r].exists() else f"no result (exit {procs[r].returncode})"
        for r in range(2)
    }
    for r, res in results.items():
        assert isinstance(res, dict), f"rank {r} failed:\n{res}"
    assert results[0]["losses"] == results[1]["losses"], "every rank returns the same, whole answer"
    return results


@pytest.mark.parametrize("lora", [LoraSettings(rank=4), None], ids=["lora", "full-finetune"])
def test_two_ranks_train_as_one_device_and_checkpoints_go_both_ways(tiny_dir, tmp_path, lora):
    from openrl_lab.train.trainer import BaseModelHost

    torch.set_num_threads(1)
    host = BaseModelHost(tiny_dir, tokens_per_microbatch=MICROBATCH)
    job = host.create_job("one", lora, seed=7)
    data = _batch(host.tokenizer)
    want = _train(job, data)
    ckpt_one, ckpt_two = tmp_path / "saved-on-1", tmp_path / "saved-on-2"
    job.save(ckpt_one)
    want_next = _next_loss(job, data)
    for _ in range(2):
        job.forward_backward(data, "cross_entropy")
        job.optim_step(ADAM)
    want_stepped = _next_loss(job, data)

    ranks = _gang(tiny_dir, lora, ckpt_one, ckpt_two)
    got = ranks[0]
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=RTOL)
    np.testing.assert_allclose(got["norms"], want["norms"], rtol=RTOL)
    assert len(got["logprobs"]) == len(data)
    for lp, w, d in zip(got["logprobs"], want["logprobs"], data):  # in the datum order
        assert lp.shape == d.tokens.shape
        np.testing.assert_allclose(lp, w, atol=ATOL)
    # each rank's eviction moved its state out, emptied its storages, and brought it back bit for bit
    for r in (0, 1):
        moved, emptied, exact = ranks[r]["evict"]
        assert moved > 0 and emptied and exact, (r, ranks[r]["evict"])
    # each rank holds about half the state
    assert abs(ranks[0]["state_bytes"] - ranks[1]["state_bytes"]) < 0.1 * ranks[0]["state_bytes"]

    # saved on 1, loaded on 2: the same next loss, step count and AdamW state (two more steps agree)
    next_one, step = got["from_one"]
    assert step == STEPS
    np.testing.assert_allclose(next_one, want_next, rtol=RTOL)
    np.testing.assert_allclose(got["from_one_stepped"], want_stepped, rtol=RTOL)
    # saved on 2, loaded on 2
    np.testing.assert_allclose(got["from_two"], got["next"], rtol=RTOL)

    # saved on 2, loaded on 1: the single-device format exactly (names, optimizer state), the same next loss
    from openrl_lab.train.checkpoint import read_checkpoint

    w1, meta1, opt1 = read_checkpoint(ckpt_one)
    w2, meta2, opt2 = read_checkpoint(ckpt_two)
    assert set(w1) == set(w2) and set(opt1 or {}) == set(opt2 or {})
    assert meta2["optimizer_param_groups"] == meta1["optimizer_param_groups"]
    assert {k: meta2[k] for k in ("lora", "is_lora", "optimizer_step")} == {
        k: meta1[k] for k in ("lora", "is_lora", "optimizer_step")
    }
    loaded = BaseModelHost(tiny_dir, tokens_per_microbatch=MICROBATCH).create_job("two", lora, seed=7)
    loaded.load(ckpt_two, include_optimizer=True)
    assert loaded.step == STEPS
    np.testing.assert_allclose(_next_loss(loaded, data), got["next"], rtol=RTOL)
