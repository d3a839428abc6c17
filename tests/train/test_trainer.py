from __future__ import annotations

import numpy as np
import pytest
import torch

from openrl_lab.train.checkpoint import CheckpointError, read_meta, write_checkpoint
from openrl_lab.train.trainer import (
    AdamSettings,
    DataError,
    Datum,
    LoraSettings,
    load_snapshot,
    save_snapshot,
)

LR = AdamSettings(learning_rate=3e-3)


def _ids(host, text):
    return torch.tensor([host.tokenizer.encode(text)])


def _params(job):
    return {k: p.detach().clone() for k, p in job.params.items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train(job, data, steps, adam=LR):
    losses = []
    for _ in range(steps):
        losses.append(job.forward_backward(data, "cross_entropy").metrics["loss:sum"])
        job.optim_step(adam)
    return losses


# ------------------------------------------------------------------------------ forward semantics


def test_logprobs_are_next_token_logprobs(host, sft_data):
    job = host.create_job("s:train:0", LoraSettings(rank=4, seed=0))
    out = job.forward_backward(sft_data, "cross_entropy", backward=False)
    assert len(out.logprobs) == 2 and set(out.metrics) == {"loss:sum"}
    total = 0.0
    for datum, lp in zip(sft_data, out.logprobs):
        assert lp.dtype == np.float32 and lp.shape == datum.tokens.shape
        logits, _ = host.model_call()(torch.from_numpy(datum.tokens)[None], None)
        ref = logits[0].log_softmax(-1)[torch.arange(len(lp)), torch.from_numpy(datum.inputs["target_tokens"])]
        np.testing.assert_allclose(lp, ref.numpy(), rtol=1e-5, atol=1e-5)
        total -= float(ref.sum())
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert all(p.grad is None for p in job.params.values())  # forward() leaves no gradient


def test_padding_and_microbatching_do_not_change_results(host, sft_data):
    job = host.create_job("j", LoraSettings(rank=4, seed=0))
    together = job.forward_backward(sft_data, "cross_entropy", backward=False)
    host.tokens_per_microbatch = 1  # one datum per forward pass
    alone = job.forward_backward(sft_data, "cross_entropy", backward=False)
    for a, b in zip(together.logprobs, alone.logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_kv_cache_decoding_matches_full_forward(host):
    call = host.model_call()
    ids = _ids(host, "what is 2 + 2? the answer is 4.")
    full, _ = call(ids, None)
    logits, cache = call(ids[:, :5], None)
    steps = [logits[:, -1]]
    for t in range(5, ids.shape[1]):
        logits, cache = call(ids[:, t : t + 1], cache)
        steps.append(logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 4:], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------- training


def test_supervised_steps_lower_the_loss_lora(host, sft_data):
    job = host.create_job("s:train:0", LoraSettings(rank=8, seed=1))
    losses = _train(job, sft_data, 6)
    assert losses[-1] < 0.8 * losses[0], losses


def test_full_finetune_job(host, sft_data):
    job = host.create_job("full", None)
    assert not job.is_lora and job.lora_rank is None
    assert len(job.params) == sum(1 for _ in host.model.parameters())
    base_before = host.model_call()(_ids(host, "1+1=2"), None)[0]
    losses = _train(job, sft_data, 4, AdamSettings(learning_rate=1e-3))
    assert losses[-1] < 0.8 * losses[0], losses
    # the shared base is untouched; the job's own copy moved
    torch.testing.assert_close(host.model_call()(_ids(host, "1+1=2"), None)[0], base_before, rtol=0, atol=0)
    assert not torch.equal(job.model_call()(_ids(host, "1+1=2"), None)[0], base_before)


def test_lora_jobs_are_isolated(host, sft_data):
    ids = _ids(host, "what is 3 + 4? the answer is 7.")
    base_call = host.model_call()  # made before peft wraps the base model
    base0 = base_call(ids, None)[0]
    a = host.create_job("s:train:0", LoraSettings(rank=4, seed=0))
    b = host.create_job("s:train:1", LoraSettings(rank=8, seed=1, train_unembed=False))
    b0, b_params = b.model_call()(ids, None)[0], _params(b)
    torch.testing.assert_close(b0, base0, rtol=0, atol=0)  # LoRA B starts at zero: a fresh adapter is the base
    _train(a, sft_data, 3)
    assert not torch.equal(a.model_call()(ids, None)[0], base0)
    assert torch.equal(b.model_call()(ids, None)[0], b0)
    assert _same(_params(b), b_params)
    assert torch.equal(host.model_call()(ids, None)[0], base0)
    assert torch.equal(base_call(ids, None)[0], base0)
    host.drop_job("s:train:0")
    host.drop_job("s:train:1")
    assert torch.equal(base_call(ids, None)[0], base0)
    c = host.create_job("s:train:2", LoraSettings(rank=4, seed=0))  # a fresh adapter after all were dropped
    assert torch.equal(c.model_call()(ids, None)[0], base0)


def test_interleaved_jobs_accumulate_their_own_gradients(host, sft_data):
    def run(interleave: bool):
        a = host.create_job("a", LoraSettings(rank=4, seed=0))
        b = host.create_job("b", LoraSettings(rank=4, seed=0))
        a.forward_backward(sft_data[:1], "cross_entropy")
        if interleave:
            _train(b, sft_data, 2)
        a.forward_backward(sft_data[1:], "cross_entropy")  # accumulates onto the first call's grads
        a.optim_step(LR)
        result = _params(a)
        host.drop_job("a")
        host.drop_job("b")
        return result

    assert _same(run(False), run(True))


def test_an_adapter_added_or_dropped_between_steps_is_never_trained_by_another_job(host, sft_data):
    # A job sets its adapter only when something may have changed which parameters require grad: these are the
    # changes (a new job's adapter, a sampler slot, a dropped job) that must not leak gradients.
    a = host.create_job("a", LoraSettings(rank=4, seed=0))
    a.forward_backward(sft_data[:1], "cross_entropy")
    a.optim_step(LR)
    b = host.create_job("b", LoraSettings(rank=4, seed=1))
    b_params = _params(b)
    a.forward_backward(sft_data[:1], "cross_entropy")
    assert all(p.grad is None for p in b.params.values())
    assert all(p.grad is not None for p in a.params.values())
    a.optim_step(LR)
    assert _same(_params(b), b_params)
    host.create_job("c", LoraSettings(rank=4, seed=2))
    host.drop_job("c")
    a.forward_backward(sft_data[:1], "cross_entropy")
    assert all(p.grad is None for p in b.params.values())
    a.optim_step(LR)


def test_lora_seed_controls_init(host):
    p1 = _params(host.create_job("x", LoraSettings(rank=4, seed=7)))
    p2 = _params(host.create_job("y", LoraSettings(rank=4, seed=7)))
    p3 = _params(host.create_job("z", LoraSettings(rank=4, seed=8)))
    assert _same(p1, p2) and not _same(p1, p3)
    assert _same(p1, _params(host.create_job("w", LoraSettings(rank=4), seed=7)))


def test_lora_seed_none_draws_a_fresh_seed_and_records_it(host, tmp_path):
    jobs = []
    for name in ("a", "b"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the same global RNG state for both: it must not decide the init
            jobs.append(host.create_job(name, LoraSettings(rank=4)))
    a, b = jobs
    assert not _same(_params(a), _params(b))
    assert isinstance(a.lora.seed, int) and a.lora.seed != b.lora.seed
    assert _same(_params(host.create_job("again", LoraSettings(rank=4, seed=a.lora.seed))), _params(a))
    a.save(tmp_path / "ck")
    assert read_meta(tmp_path / "ck")["lora"]["seed"] == a.lora.seed  # a resume recreates the same adapter


def test_creating_jobs_leaves_the_global_rng_alone(host):
    before = torch.get_rng_state()
    host.create_job("seeded", LoraSettings(rank=4, seed=7))
    host.create_job("random", LoraSettings(rank=4))
    host.create_job("full", None)
    assert torch.equal(torch.get_rng_state(), before)


def test_lora_targets(host):
    job = host.create_job("attn-only", LoraSettings(rank=2, train_mlp=False, train_unembed=False))
    mods = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in job.params}
    assert mods == {"q_proj", "k_proj", "v_proj", "o_proj"}
    job = host.create_job("all", LoraSettings(rank=2))
    mods = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in job.params}
    assert mods == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}
    with pytest.raises(ValueError, match="at least one"):
        host.create_job("none", LoraSettings(rank=2, train_mlp=False, train_attn=False, train_unembed=False))


def test_job_registry(host):
    job = host.create_job("s:train:0", LoraSettings(rank=2))
    assert host.get_job("s:train:0") is job
    with pytest.raises(ValueError, match="already exists"):
        host.create_job("s:train:0", LoraSettings(rank=2))
    host.drop_job("s:train:0")
    with pytest.raises(KeyError):
        host.get_job("s:train:0")


# ------------------------------------------------------------------------------------ optimizer


def _grads(job, data, weight=None):
    if weight is not None:
        data = [Datum(d.tokens, {**d.inputs, "weights": np.full(d.tokens.shape, weight, np.float32)}) for d in data]
    job.forward_backward(data, "cross_entropy")
    return {k: p.grad.clone() for k, p in job.params.items()}


def test_first_adamw_step_matches_formula(host, sft_data):
    job = host.create_job("j", LoraSettings(rank=4, seed=0))
    before, grads = _params(job), _grads(job, sft_data)
    adam = AdamSettings(learning_rate=1e-2, eps=1e-8, weight_decay=0.1)
    metrics = job.optim_step(adam)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert metrics["grad_norm:mean"] == pytest.approx(float(norm), rel=1e-5)
    assert metrics["learning_rate:mean"] == 1e-2
    for k, p in job.params.items():
        # step 1: bias-corrected m = g, v = g^2; decoupled decay scales the old weight
        g, lr = grads[k], adam.learning_rate
        expected = before[k] * (1 - lr * adam.weight_decay) - lr * g / (g.abs() + adam.eps)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-4, atol=1e-6)
        assert p.grad is None  # optim_step zeroes grads


def test_learning_rate_zero_changes_nothing(host, sft_data):
    job = host.create_job("j", LoraSettings(rank=4, seed=0))
    _train(job, sft_data, 1)
    before = _params(job)
    _train(job, sft_data, 2, AdamSettings(learning_rate=0.0, weight_decay=0.5))
    assert _same(_params(job), before)


def test_weight_decay_with_zero_gradients(host, sft_data):
    job = host.create_job("full", None)
    before = _params(job)
    grads = _grads(job, sft_data, weight=0.0)
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())
    job.optim_step(AdamSettings(learning_rate=0.1, weight_decay=0.5))
    for k, p in job.params.items():
        torch.testing.assert_close(p.detach(), before[k] * 0.95, rtol=1e-6, atol=0)


def test_grad_clipping_limits_the_update(host, sft_data):
    def update(clip):
        job = host.create_job(f"clip{clip}", LoraSettings(rank=4, seed=0))
        before = _params(job)
        _grads(job, sft_data)
        metrics = job.optim_step(AdamSettings(learning_rate=1e-2, eps=1e-8, grad_clip_norm=clip))
        delta = sum(float((p.detach() - before[k]).abs().sum()) for k, p in job.params.items())
        return delta, metrics["grad_norm:mean"]

    free, norm_free = update(0.0)
    clipped, norm_clipped = update(1e-10)  # grads ~1e-11 each, far below eps: updates shrink ~1000x
    assert norm_free == pytest.approx(norm_clipped)  # the reported norm is the one before clipping
    assert clipped < free / 100


def test_bad_adam_settings(host, sft_data):
    job = host.create_job("j", LoraSettings(rank=2))
    with pytest.raises(ValueError):  # noqa: PT011 - the settings' own check
        job.optim_step(AdamSettings(learning_rate=-1))
    with pytest.raises(ValueError):  # noqa: PT011 - the settings' own check
        job.optim_step(AdamSettings(beta2=1.0))


# ----------------------------------------------------------------------------------- checkpoints


def _save_legacy(job, directory):
    """A checkpoint as written before optimizer state_dicts were saved: AdamW's tensors named
    '<state key>/<parameter name>', no param groups in meta.json."""
    optimizer = {
        f"{key}/{name}": value for name, p in job.params.items() for key, value in job.optimizer.state[p].items()
    }
    write_checkpoint(directory, job.snapshot(), {"kind": "training", **job._meta()}, optimizer)


@pytest.mark.parametrize("layout", ["state_dict", "legacy"])
@pytest.mark.parametrize("lora", [LoraSettings(rank=4, seed=3), None], ids=["lora", "full"])
def test_resume_after_save_load_is_bit_exact(host, sft_data, tmp_path, lora, layout):
    job = host.create_job("orig", lora)
    _train(job, sft_data, 2)
    if layout == "legacy":
        _save_legacy(job, tmp_path / "ck")
    else:
        assert job.save(tmp_path / "ck") > 0
    meta = read_meta(tmp_path / "ck")
    assert meta["has_optimizer"] and meta["optimizer_step"] == 2 and meta["base_model"] == host.card.name
    assert meta["is_lora"] is (lora is not None) and meta["kind"] == "training"
    assert meta["lora"] == (
        None if lora is None else {"rank": 4, "seed": 3, "train_mlp": True, "train_attn": True, "train_unembed": True}
    )
    if layout == "state_dict":  # the param groups, parameters named rather than numbered
        [group] = meta["optimizer_param_groups"]
        assert group["params"] == list(job.params) and group["lr"] == LR.learning_rate
    _train(job, sft_data, 2)
    expected = _params(job)

    other = LoraSettings(rank=4, seed=99) if lora else None  # different init: everything comes from the file
    resumed = host.create_job("resumed", other)  # and another adapter slot than the saved job's
    resumed.load(tmp_path / "ck", include_optimizer=True)
    assert resumed.step == 2
    _train(resumed, sft_data, 2)
    assert _same(_params(resumed), expected)


def test_optimizer_state_for_unknown_parameters_is_refused(host, sft_data, tmp_path):
    job = host.create_job("a", LoraSettings(rank=4, seed=0))
    _train(job, sft_data, 1)
    optimizer = {k.replace("lora_A", "lora_Z"): v for k, v in job._optimizer_tensors().items()}
    meta = {"kind": "training", **job._meta(), "optimizer_param_groups": job._optimizer_groups()}
    write_checkpoint(tmp_path / "ck", job.snapshot(), meta, optimizer)
    with pytest.raises(CheckpointError, match=r"optimizer state for parameters this job lacks: .*lora_Z"):
        host.create_job("b", LoraSettings(rank=4)).load(tmp_path / "ck", include_optimizer=True)


def test_load_without_optimizer_resets_it(host, sft_data, tmp_path):
    job = host.create_job("a", LoraSettings(rank=4, seed=0))
    _train(job, sft_data, 2)
    job.save(tmp_path / "ck", include_optimizer=False)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        host.create_job("b", LoraSettings(rank=4)).load(tmp_path / "ck", include_optimizer=True)
    c = host.create_job("c", LoraSettings(rank=4))
    c.load(tmp_path / "ck", include_optimizer=False)
    assert _same(_params(c), _params(job)) and c.optimizer.state == {} and c.step == 0


def test_load_rejects_mismatches(host, tmp_path):
    host.create_job("r4", LoraSettings(rank=4)).save(tmp_path / "r4")
    with pytest.raises(CheckpointError, match="lora_rank is 4 there and 8 here"):
        host.create_job("r8", LoraSettings(rank=8)).load(tmp_path / "r4", include_optimizer=False)
    with pytest.raises(CheckpointError, match="is_lora"):
        host.create_job("full", None).load(tmp_path / "r4", include_optimizer=False)
    with pytest.raises(CheckpointError, match="train_unembed"):
        host.create_job("nu", LoraSettings(rank=4, train_unembed=False)).load(tmp_path / "r4", include_optimizer=False)
    with pytest.raises(CheckpointError):
        host.create_job("x", LoraSettings(rank=4)).load(tmp_path / "absent", include_optimizer=False)


def test_save_refuses_to_overwrite_and_keeps_extra_meta(host, tmp_path):
    job = host.create_job("a", LoraSettings(rank=2))
    job.save(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="exists"):
        job.save(tmp_path / "ck")
    job.save(tmp_path / "ck", overwrite=True, extra_meta={"owner": "alice", "kind": "sampler", "lora_rank": 99})
    meta = read_meta(tmp_path / "ck")
    assert meta["owner"] == "alice" and meta["kind"] == "sampler"
    assert meta["lora_rank"] == 2  # what load() checks cannot be overridden


def test_snapshots_for_sampling(host, sft_data, tmp_path):
    job = host.create_job("s:train:0", LoraSettings(rank=4, seed=0))
    _train(job, sft_data, 2)
    snap = job.snapshot()
    ids = _ids(host, "what is 5 + 5?")
    at_snap = job.model_call()(ids, None)[0]
    _train(job, sft_data, 2)  # live weights move on; the snapshot does not
    assert torch.equal(job.model_call(snap)(ids, None)[0], at_snap)
    assert not torch.equal(job.model_call()(ids, None)[0], at_snap)

    save_snapshot(snap, tmp_path / "sampler", host.card.name)
    assert not (tmp_path / "sampler" / "optimizer.safetensors").exists()
    meta = read_meta(tmp_path / "sampler")
    assert meta["kind"] == "sampler" and meta["lora_rank"] == 4 and meta["is_lora"]
    assert meta["lora"] == {"rank": 4, "seed": None, "train_mlp": True, "train_attn": True, "train_unembed": True}
    loaded = load_snapshot(tmp_path / "sampler", base_model=host.card.name)
    torch.testing.assert_close(host.model_call(loaded)(ids, None)[0], at_snap, rtol=0, atol=0)
    host.drop_job("s:train:0")  # a loaded snapshot needs no live job
    torch.testing.assert_close(host.model_call(loaded)(ids, None)[0], at_snap, rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="base model"):
        load_snapshot(tmp_path / "sampler", base_model="other/model")


@pytest.mark.parametrize("lora", [LoraSettings(rank=4, seed=0), None], ids=["lora", "full"])
def test_a_snapshot_runs_on_the_live_weights_only_until_they_change(host, sft_data, tmp_path, monkeypatch, lora):
    from openrl_lab.train import trainer

    swaps = []
    real = trainer.functional_call
    monkeypatch.setattr(trainer, "functional_call", lambda *a, **kw: swaps.append(1) or real(*a, **kw))
    job = host.create_job("j", lora)
    _train(job, sft_data, 1, AdamSettings(learning_rate=1e-3))
    job.save(tmp_path / "ckpt", include_optimizer=True)
    ids = _ids(host, "what is 5 + 5?")
    call = job.model_call(job.snapshot())
    at_snap = call(ids, None)[0]
    assert swaps == []  # nothing changed since the snapshot: the live weights, read in place
    _train(job, sft_data, 1, AdamSettings(learning_rate=1e-3))
    assert torch.equal(call(ids, None)[0], at_snap) and len(swaps) == 1  # the snapshot's own tensors now
    job.load(tmp_path / "ckpt", include_optimizer=True)  # the same values again, but written: still swapped
    assert torch.equal(call(ids, None)[0], at_snap) and len(swaps) == 2
    other = host.create_job("other", LoraSettings(rank=4, seed=0)) if lora else None
    if other is not None:  # another job's snapshot never reads this job's weights
        assert torch.equal(other.model_call(job.snapshot())(ids, None)[0], at_snap) and len(swaps) == 3


def test_full_weight_snapshot_on_the_host(host, sft_data):
    job = host.create_job("full", None)
    _train(job, sft_data, 1, AdamSettings(learning_rate=1e-3))
    ids = _ids(host, "7*6=42")
    call = host.model_call(job.snapshot())
    expected = job.model_call()(ids, None)[0]
    torch.testing.assert_close(call(ids, None)[0], expected, rtol=0, atol=0)
    lora = host.create_job("lora", LoraSettings(rank=2))  # base layers are now wrapped by peft
    _train(lora, sft_data, 1)
    torch.testing.assert_close(call(ids, None)[0], expected, rtol=0, atol=0)
    torch.testing.assert_close(host.model_call(job.snapshot())(ids, None)[0], expected, rtol=0, atol=0)
    lora_call = lora.model_call()
    host.drop_job("lora")
    with pytest.raises(RuntimeError, match="dropped"):
        lora_call(ids, None)


# ---------------------------------------------------------------------------------- bad input


def _datum(n=6, **inputs):
    tokens = np.arange(3, 3 + n, dtype=np.int64)
    base = {"target_tokens": tokens + 1}
    return Datum(tokens=tokens, inputs={**base, **inputs})


BAD = {
    "token out of range": (
        Datum(np.array([3, 600]), {"target_tokens": np.array([1, 2])}),
        "token id 600, outside the vocabulary",
    ),
    "negative token": (Datum(np.array([3, -1]), {"target_tokens": np.array([1, 2])}), "token id -1"),
    "target out of range": (Datum(np.array([3, 4]), {"target_tokens": np.array([1, 512])}), "target_tokens has token"),
    "length mismatch": (Datum(np.array([3, 4, 5]), {"target_tokens": np.array([1, 2])}), "has shape"),
    "weights length": (_datum(weights=np.ones(5, np.float32)), r"\['weights'\] has shape"),
    "nan weights": (_datum(weights=np.array([1, 1, np.nan, 1, 1, 1], np.float32)), "NaN or infinity"),
    "too long": (Datum(np.full(513, 3), {"target_tokens": np.full(513, 3)}), "max context length 512"),
    "empty tokens": (Datum(np.array([], np.int64), {"target_tokens": np.array([], np.int64)}), "non-empty"),
    "float tokens": (Datum(np.array([3.0, 4.0]), {"target_tokens": np.array([1, 2])}), "integer token ids"),
    "missing target": (Datum(np.array([3, 4]), {}), "needs loss_fn_inputs target_tokens"),
    "unknown input": (_datum(mask=np.ones(6, np.float32)), "does not take loss_fn_inputs mask"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_data_errors_name_the_datum(host, case):
    job = host.create_job("j", LoraSettings(rank=2))
    bad, message = BAD[case]
    with pytest.raises(DataError, match=message) as err:
        job.forward_backward([_datum(), bad], "cross_entropy")
    assert "datum 1" in str(err.value)
    assert all(p.grad is None for p in job.params.values())


def test_rl_data_errors(host):
    job = host.create_job("j", LoraSettings(rank=2))
    ok = _datum(logprobs=np.zeros(6, np.float32), advantages=np.ones(6, np.float32))
    job.forward_backward([ok], "ppo", backward=False)
    with pytest.raises(DataError, match="datum 0: loss_fn ppo needs loss_fn_inputs advantages"):
        job.forward_backward([_datum(logprobs=np.zeros(6, np.float32))], "ppo")
    inf = _datum(logprobs=np.zeros(6, np.float32), advantages=np.array([1, 1, np.inf, 1, 1, 1], np.float32))
    with pytest.raises(DataError, match=r"\['advantages'\] contains NaN or infinity"):
        job.forward_backward([inf], "importance_sampling")
    with pytest.raises(DataError, match="empty"):
        job.forward_backward([], "cross_entropy")
    with pytest.raises(ValueError, match="unknown loss_fn"):
        job.forward_backward([ok], "nope")


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_rl_losses_train(host, loss_fn):
    """One RL step on positive advantages raises the logprob of the chosen tokens."""
    job = host.create_job("j", LoraSettings(rank=4, seed=0))
    sft = _datum(n=8)
    lp = job.forward_backward([sft], "cross_entropy", backward=False).logprobs[0]
    d = _datum(n=8, logprobs=lp, advantages=np.ones(8, np.float32))  # on-policy
    job.forward_backward([d], loss_fn)
    job.optim_step(AdamSettings(learning_rate=1e-3))
    after = job.forward_backward([sft], "cross_entropy", backward=False).logprobs[0]
    assert after.sum() > lp.sum()
