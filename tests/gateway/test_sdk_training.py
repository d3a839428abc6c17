"""The four primitives through the real tinker SDK against a real server on loopback."""

from __future__ import annotations

import numpy as np
import tinker
from tinker import types

from .helpers import MODEL, TEXTS, logprobs_of, new_trainer, raw_info, sft_batch


def test_supervised_loop_lowers_loss(service):
    trainer = new_trainer(service)
    batch = sft_batch(trainer.get_tokenizer(), TEXTS)
    losses = []
    for _ in range(8):
        fb = trainer.forward_backward(batch, "cross_entropy")
        opt = trainer.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    assert losses[-1] < 0.7 * losses[0], losses


def test_forward_returns_per_datum_logprobs_and_does_not_train(service):
    trainer = new_trainer(service)
    batch = sft_batch(trainer.get_tokenizer(), TEXTS[:3])
    a = trainer.forward(batch, "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-1)).result()  # no grads: nothing moves
    b = trainer.forward(batch, "cross_entropy").result()
    assert [len(x) for x in logprobs_of(a)] == [d.model_input.length for d in batch]
    for x, y in zip(logprobs_of(a), logprobs_of(b)):
        np.testing.assert_array_equal(x, y)
    assert all((x <= 0).all() for x in logprobs_of(a))


def test_get_info(lab, service):
    trainer = new_trainer(service)
    info = trainer.get_info()
    assert info.is_lora and info.lora_rank == 8
    assert info.model_data.model_name == MODEL
    # what is trained, as the kernel counted it: rank-8 adapters on every attention, MLP and unembedding module
    trained = raw_info(lab, trainer.model_id)["trained"]
    assert trained["kind"] == "lora" and list(trained["targets"]) == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"
    ], trained  # fmt: skip
    assert trained["parameters"] == sum(trained["targets"].values()) < trained["base_parameters"] / 2, trained
    assert trained["experts"] == 0 and trained["router_trained"] is None and trained["expert_parameters"] == []


def test_get_info_says_what_a_narrower_lora_leaves_out(lab, service):
    attn_only = service.create_lora_training_client(
        base_model=MODEL, rank=4, seed=0, train_mlp=False, train_unembed=False
    ).result()
    trained = raw_info(lab, attn_only.model_id)["trained"]
    assert list(trained["targets"]) == ["q_proj", "k_proj", "v_proj", "o_proj"], trained
    wide = raw_info(lab, new_trainer(service, rank=4).model_id)["trained"]
    assert trained["targets"]["q_proj"] == wide["targets"]["q_proj"] and trained["parameters"] < wide["parameters"]


def test_sampling_shapes_and_seed(service):
    trainer = new_trainer(service)
    tok = trainer.get_tokenizer()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("12+3=", add_special_tokens=False))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])
    out = sampler.sample(prompt, num_samples=5, sampling_params=params).result()
    assert len(out.sequences) == 5
    for seq in out.sequences:
        assert len(seq.tokens) == 6 and len(seq.logprobs) == 6
        assert seq.stop_reason == "length"
    again = sampler.sample(prompt, num_samples=5, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]


def test_compute_logprobs_agrees_with_sample(service):
    trainer = new_trainer(service)
    tok = trainer.get_tokenizer()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt_ids = tok.encode("5+5=", add_special_tokens=False)
    out = sampler.sample(
        types.ModelInput.from_ints(prompt_ids),
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=5, seed=1, stop=[]),
    ).result()
    for seq in out.sequences:
        full = types.ModelInput.from_ints(prompt_ids + list(seq.tokens))
        lp = sampler.compute_logprobs(full).result()
        assert lp[0] is None and len(lp) == len(prompt_ids) + len(seq.tokens)
        np.testing.assert_allclose(lp[len(prompt_ids) :], seq.logprobs, atol=1e-4)


def test_sampler_uses_its_snapshot_not_live_weights(service):
    trainer = new_trainer(service)
    tok = trainer.get_tokenizer()
    batch = sft_batch(tok, TEXTS)
    before = trainer.save_weights_and_get_sampling_client().result()
    full = types.ModelInput.from_ints(tok.encode("7+7=14", add_special_tokens=False))
    lp_before = before.compute_logprobs(full).result()
    for _ in range(3):
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert before.compute_logprobs(full).result() == lp_before
    after = trainer.save_weights_and_get_sampling_client().result()
    assert after.compute_logprobs(full).result() != lp_before


def test_save_load_round_trip_is_bit_exact(service):
    trainer = new_trainer(service, seed=3)
    batch = sft_batch(trainer.get_tokenizer(), TEXTS)
    for _ in range(3):
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = trainer.save_state("round-trip").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/round-trip")

    def continue_training(client):
        client.forward_backward(batch, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return logprobs_of(client.forward(batch, "cross_entropy").result())

    expected = continue_training(trainer)
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    got = continue_training(restored)
    for x, y in zip(expected, got):
        np.testing.assert_array_equal(x, y)  # weights AND Adam moments came back exactly
    # Without the optimizer, the Adam state restarts, so the continuation differs.
    weights_only = service.create_training_client_from_state(path).result()
    differs = continue_training(weights_only)
    assert any(not np.array_equal(x, y) for x, y in zip(expected, differs))


def test_loss_functions_over_the_wire(service):
    trainer = new_trainer(service)
    tok = trainer.get_tokenizer()
    ids = tok.encode("2+2=4", add_special_tokens=False)
    n = len(ids) - 1
    base = trainer.forward(sft_batch(tok, ["2+2=4"]), "cross_entropy").result()
    logq = logprobs_of(base)[0][:n].tolist()
    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro"):
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "logprobs": logq, "advantages": [1.0] * n},
        )
        out = trainer.forward_backward([datum], loss_fn).result()
        assert "loss:sum" in out.metrics
        # at the sampler's own weights the ratio is 1, so IS / PPO / CISPO losses are -sum(A)
        if loss_fn in ("importance_sampling", "ppo"):
            assert abs(out.metrics["loss:sum"] + n) < 1e-3, (loss_fn, out.metrics)


def test_rl_losses_report_the_sampler_vs_trainer_mismatch(service):
    """Samples from the trainer's own weights score as the trainer scores them (mismatch ~0); logprobs of
    other weights (a sampler left behind by an optim_step, or altered ones) show in the metrics."""
    trainer = new_trainer(service, seed=3)
    tok = trainer.get_tokenizer()
    prompt = tok.encode("2+2=", add_special_tokens=False)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=6, seed=0)).result()

    def rl_data(shift: float = 0.0):
        data = []
        for s in seqs.sequences:
            tokens = prompt + list(s.tokens)
            pad = [0.0] * (len(prompt) - 1)  # prompt positions: no sampler logprob, no advantage
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": pad + [lp + shift for lp in s.logprobs],
                        "advantages": pad + [1.0] * len(s.tokens),
                    },
                )
            )
        return data

    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro"):
        m = trainer.forward(rl_data(), loss_fn).result().metrics
        assert 0 <= m["sampler_kl:mean"] < 1e-8 and m["sampler_logprob_diff:max"] < 1e-4, (loss_fn, m)
    # a sampler whose logprobs are 0.5 too high on every sampled token: k3 = e^-0.5 - 1 + 0.5 exactly
    m = trainer.forward(rl_data(shift=0.5), "importance_sampling").result().metrics
    assert abs(m["sampler_kl:mean"] - (np.expm1(-0.5) + 0.5)) < 1e-4
    assert abs(m["sampler_logprob_diff:max"] - 0.5) < 1e-4
    # a stale sampler: the trainer moved on after it sampled
    trainer.forward_backward(rl_data(), "importance_sampling").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    m = trainer.forward_backward(rl_data(), "importance_sampling").result().metrics
    assert m["sampler_kl:mean"] > 1e-4 and m["sampler_logprob_diff:max"] > 1e-2, m
    assert "sampler_kl:mean" not in trainer.forward(sft_batch(tok, TEXTS[:1]), "cross_entropy").result().metrics


def test_rest_runs_and_checkpoints(lab, service):
    trainer = new_trainer(service)
    p1 = trainer.save_state("ck-a").result().path
    p2 = trainer.save_weights_for_sampler("ck-s").result().path
    rest = tinker.RestClient(base_url=lab.base_url, api_key=lab.api_key)
    run_id = trainer.model_id
    run = rest.get_training_run(run_id).result()
    assert run.base_model == MODEL and run.is_lora and run.lora_rank == 8
    listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert {p1, p2} <= listed
    info = rest.get_weights_info_by_tinker_path(p1).result()
    assert info.base_model == MODEL and info.lora_rank == 8
    rest.set_checkpoint_ttl_from_tinker_path(p2, 3600).result()
    ck = {c.tinker_path: c for c in rest.list_checkpoints(run_id).result().checkpoints}[p2]
    assert ck.expires_at is not None
    rest.delete_checkpoint_from_tinker_path(p1).result()
    listed = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert p1 not in listed and p2 in listed
    assert run_id in {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
    # a sampler made from a saved sampler checkpoint
    sampler = service.create_sampling_client(model_path=p2).result()
    assert sampler.get_base_model() == MODEL
    caps = rest.get_server_capabilities().result()
    assert MODEL in [m.model_name for m in caps.supported_models]
