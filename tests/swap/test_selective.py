"""Selective snapshots: two LoRA adapters on one shared base; each job swaps only its own state."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import numpy as np
import pytest
import torch

from openrl_lab.swap import SwapSet, SwapStateError, switch


def _tiny_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    base = LlamaForCausalLM(config).eval()
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, lora, adapter_name="a")
        model.add_adapter("b", lora)
    for name, p in model.named_parameters():  # B starts at zero in peft: make every adapter matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _mine(adapter):
    return lambda name: ".lora_" in name and f".{adapter}." in name


def _step(model, adapter, opt, seed):
    model.set_adapter(adapter)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _adapter_params(model, adapter):
    return [p for n, p in model.named_parameters() if _mine(adapter)(n)]


def _logits(model, adapter):
    model.set_adapter(adapter)
    with torch.no_grad():
        return model(input_ids=torch.arange(10)[None]).logits


def test_evicting_one_adapter_moves_only_its_bytes_and_the_other_keeps_working():
    model = _tiny_peft()
    opts = {a: torch.optim.AdamW(_adapter_params(model, a), lr=1e-2) for a in "ab"}
    for a in "ab":
        _step(model, a, opts[a], seed=1)
    sets = {}
    for a in "ab":
        sets[a] = SwapSet(a, "cpu")
        assert sets[a].add_module(model, _mine(a)) == 2 * 2 * 7  # A and B matrices of 7 layers x 2 blocks
        sets[a].add_optimizer(opts[a])
    mine = list(sets["a"].named_tensors().values())
    expected = sum(t.nbytes for t in mine)
    assert expected == sum(p.nbytes for p in _adapter_params(model, "a")) * 3 + 4 * 28  # + AdamW step counters
    logits_a = _logits(model, "a")
    logits_b = _logits(model, "b")
    base_ptrs = {n: p.data_ptr() for n, p in model.named_parameters() if ".lora_" not in n}
    b_ptrs = {id(p): p.data_ptr() for p in _adapter_params(model, "b")}
    a_storages = [weakref.ref(t.untyped_storage()) for t in mine]

    stats = sets["a"].evict()
    gc.collect()
    assert stats.bytes_moved == expected and stats.retained_bytes == 0
    assert all(r() is None for r in a_storages)
    assert {n: p.data_ptr() for n, p in model.named_parameters() if ".lora_" not in n} == base_ptrs
    assert {id(p): p.data_ptr() for p in _adapter_params(model, "b")} == b_ptrs  # B untouched
    torch.testing.assert_close(_logits(model, "b"), logits_b, rtol=0, atol=0)
    _step(model, "b", opts["b"], seed=2)  # B trains while A is away
    with pytest.raises(SwapStateError, match="'a' is evicted"):
        _logits(model, "a")
    with pytest.raises(SwapStateError):
        opts["a"].step()

    sets["b"].evict()  # now both are away; the base stays
    sets["a"].restore()
    torch.testing.assert_close(_logits(model, "a"), logits_a, rtol=0, atol=0)
    sets["b"].restore()
    assert sets["a"].counters.bytes_moved == 2 * expected


def test_selective_swaps_continue_training_bit_exact_against_a_twin():
    model = _tiny_peft()
    twin = copy.deepcopy(model)
    opts = {a: torch.optim.AdamW(_adapter_params(model, a), lr=1e-2) for a in "ab"}
    twin_opts = {a: torch.optim.AdamW(_adapter_params(twin, a), lr=1e-2) for a in "ab"}
    sets = {}
    for a in "ab":
        sets[a] = SwapSet(a, "cpu")
        sets[a].add_module(model, _mine(a))
        sets[a].add_optimizer(opts[a])
    sets["b"].evict()
    losses, twin_losses = [], []
    for step in range(6):  # A and B take turns on the device, as two tenants would
        for a, other in (("a", "b"), ("b", "a")):
            if not sets[a].resident:
                sets[other].evict()
                sets[a].restore()
            losses.append(_step(model, a, opts[a], seed=step))
            twin_losses.append(_step(twin, a, twin_opts[a], seed=step))
    sets["a"].restore() if not sets["a"].resident else sets["b"].restore()
    assert losses == twin_losses
    for (n, p), (tn, tp) in zip(model.named_parameters(), twin.named_parameters()):
        assert n == tn and torch.equal(p, tp), n
    for a in "ab":
        for p, tp in zip(_adapter_params(model, a), _adapter_params(twin, a)):
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opts[a].state[p][k], twin_opts[a].state[tp][k])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from openrl_lab.train.models import resolve_model_dir

    return resolve_model_dir("openrl-lab/tiny-llama-1m", tmp_path_factory.mktemp("home"))


def test_trainer_jobs_on_a_shared_base(tiny_dir):
    """The real thing: two LoRA jobs of one BaseModelHost, swapped between primitives, match a twin host."""
    from openrl_lab.train.trainer import AdamSettings, BaseModelHost, Datum, LoraSettings

    def make():
        host = BaseModelHost(tiny_dir)
        return host, [host.create_job(j, LoraSettings(rank=4, seed=i)) for i, j in enumerate(("a", "b"))]

    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 300, size=17) for _ in range(3)]
    data = [Datum(tokens=r[:-1], inputs={"target_tokens": r[1:], "weights": np.ones(16, np.float32)}) for r in rows]
    adam = AdamSettings(learning_rate=1e-2)
    host, jobs = make()
    _, twin_jobs = make()
    sets = []
    for job in jobs:
        ss = SwapSet(job.job_id, "cpu")
        ss.add_module(host.peft, _mine(job.adapter))
        ss.add_optimizer(lambda job=job: job.optimizer)  # load() replaces the optimizer object
        sets.append(ss)
    results, twin_results = [], []
    for _ in range(3):
        for i in (0, 1):
            if not sets[i].resident:  # the other tenant leaves, this one comes back
                switch(sets[1 - i], sets[i])
            results.append(jobs[i].forward_backward(data, "cross_entropy").metrics["loss:sum"])
            sets[i].evict()  # a yield between forward_backward and optim_step: the grads travel too
            sets[i].restore()
            jobs[i].optim_step(adam)
            twin_results.append(twin_jobs[i].forward_backward(data, "cross_entropy").metrics["loss:sum"])
            twin_jobs[i].optim_step(adam)
    for ss in sets:
        if not ss.resident:
            ss.restore()
    assert results == twin_results
    for job, twin in zip(jobs, twin_jobs):
        for k, p in job.params.items():
            assert torch.equal(p, twin.params[k]), k
        for k, v in job._optimizer_tensors().items():
            assert torch.equal(v, twin._optimizer_tensors()[k]), k
