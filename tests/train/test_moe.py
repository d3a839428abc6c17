"""LoRA on a mixture of experts whose experts are fused 3-D parameters (transformers 5's Qwen3-MoE and gpt-oss), on
each MoE family's stand-in (`openrl_lab.train.families`): what train_mlp trains is stated (`FUSED_EXPERT_PARAMS`),
every expert's projections change after a step, the router does not, and a saved snapshot and both exports compute
what the job does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from openrl_lab.train.families import write_model
from openrl_lab.train.hparams import AdamSettings, LoraSettings
from openrl_lab.train.trainer import EXPERTS, BaseModelHost, Datum, load_snapshot, lora_signature

MOES = ("Qwen/Qwen3-30B-A3B", "openrl-lab/tiny-gpt-oss")  # each MoE family's stand-in
# where each family's router parameters are, by model_type (its gate: a Linear, or gpt-oss's own module with a bias)
ROUTERS = {"qwen3_moe": ".mlp.gate.", "gpt_oss": ".mlp.router."}
RANK = 4


@pytest.fixture(scope="module", params=MOES)
def host(request, tmp_path_factory):
    return BaseModelHost(write_model(request.param, tmp_path_factory.mktemp("moe") / "model"))


def _ids(host: BaseModelHost) -> torch.Tensor:
    return torch.tensor([[5, 900, 77, 151644, 12, 4000]]) % host.card.vocab_size


def _data(host: BaseModelHost, n: int = 8, length: int = 24) -> list[Datum]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        ids = rng.integers(0, host.card.vocab_size, length + 1)
        out.append(Datum(ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(length, np.float32)}))
    return out


def _wrappers(host: BaseModelHost):
    """PEFT's wrappers of the fused expert parameters: (module name, wrapped parameter name, wrapper)."""
    return [
        (name, module.parameter_name, module)
        for name, module in host.model.named_modules()
        if type(module).__name__ == "ParamWrapper"
    ]


def test_every_expert_trains_and_the_router_does_not(host):
    assert host.expert_params == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"] and host.experts == 4
    assert host.mlp_targets == [EXPERTS]  # every layer sparse: no dense MLP projections
    router = ROUTERS[host.card.family]
    routers = {n: p.detach().clone() for n, p in host.model.named_parameters() if router in n}
    job = host.create_job("moe-lora", LoraSettings(rank=RANK, seed=0))
    assert "experts" in job._meta()["lora_target_modules"]
    assert not any(router in n for n in job.params), "the router is never a LoRA target"
    assert job.trained.router_trained is False and job.trained.experts == 4 and EXPERTS in job.trained.targets
    wrapped = _wrappers(host)
    # two fused parameters per layer, each with its own rank-r adapter per expert (PEFT's own mapping of the MLP
    # module names would give gate_up_proj rank 2r)
    assert sorted(p for _, p, _ in wrapped) == ["down_proj", "down_proj", "gate_up_proj", "gate_up_proj"]
    for _, _, w in wrapped:
        assert w.lora_A[job.adapter].weight.shape[0] == RANK * host.experts

    job.forward_backward(_data(host), "cross_entropy")
    job.optim_step(AdamSettings(learning_rate=1e-2))
    for name, param, w in wrapped:
        with torch.no_grad():
            delta = w.get_delta_weight(job.adapter)
        assert delta.shape[0] == host.experts, (name, delta.shape)
        moved = [float(delta[e].abs().sum()) for e in range(host.experts)]
        assert all(m > 0 for m in moved), (name, param, moved)  # every expert's projection changed
    now = dict(host.model.named_parameters())
    assert len(routers) >= 2 and all(torch.equal(now[n], before) for n, before in routers.items())
    host.drop_job(job.job_id)


def test_a_saved_moe_snapshot_computes_what_the_job_does(host, tmp_path):
    job = host.create_job("moe-snap", LoraSettings(rank=RANK, seed=1))
    job.forward_backward(_data(host), "cross_entropy")
    job.optim_step(AdamSettings(learning_rate=1e-2))
    job.save_snapshot(job.snapshot(), tmp_path / "snap")
    snapshot = load_snapshot(tmp_path / "snap")
    assert lora_signature(snapshot, host.experts) == (
        RANK,
        sorted(["q_proj", "k_proj", "v_proj", "o_proj", EXPERTS, "lm_head"]),
    )
    ids = _ids(host)
    live, _ = job.model_call()(ids)
    saved, _ = host.model_call(snapshot)(ids)  # a sampler slot of its own, made from the snapshot's signature
    base, _ = host.model_call()(ids)
    assert torch.allclose(live, saved, atol=1e-5) and not torch.allclose(live, base, atol=1e-3)
    # experts trained alone: the rank comes from the model's expert count
    alone = host.create_job("moe-experts", LoraSettings(rank=RANK, seed=2, train_attn=False, train_unembed=False))
    only = alone.snapshot()
    assert lora_signature(dict(only), host.experts) == (RANK, [EXPERTS])
    with pytest.raises(ValueError, match="expert count"):
        lora_signature(dict(only))
    host.drop_job(alone.job_id)
    host.drop_job(job.job_id)


@pytest.mark.parametrize("fmt", ["peft", "merged"])
def test_an_moe_lora_exports_to_what_other_tools_load(host, tmp_path, fmt):
    """The PEFT directory loads with PeftModel.from_pretrained, the merged one with transformers, and each computes
    what the job computes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from openrl_lab.train.export import export_checkpoint

    job = host.create_job(f"moe-export-{fmt}", LoraSettings(rank=RANK, seed=3))
    job.forward_backward(_data(host), "cross_entropy")
    job.optim_step(AdamSettings(learning_rate=1e-2))
    job.save(tmp_path / "ckpt")
    got, files = export_checkpoint(tmp_path / "ckpt", host.model_dir, fmt)
    assert got == fmt and files
    out = tmp_path / "ckpt" / "export" / fmt
    if fmt == "peft":
        base = AutoModelForCausalLM.from_pretrained(host.model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, out).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = _ids(host)
    with torch.no_grad():
        theirs = model(input_ids=ids).logits.float()
    ours, _ = job.model_call()(ids)
    assert torch.allclose(theirs, ours, atol=1e-4), float((theirs - ours).abs().max())
    host.drop_job(job.job_id)
