"""Through the tinker SDK: one user's samplers on two saved checkpoints and on the base model, sampled all at once,
decode in shared batches (each row through its own weights, /metrics counts the mixed batches) and answer what each
gives alone."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.gateway.helpers import MODEL, TEXTS, new_trainer, sft_batch

ROUNDS = 3  # concurrent rounds at most: the calls must overlap in the kernel, which the first round nearly always does


def _mixed(lab) -> float:
    text = httpx.get(f"{lab.base_url}/metrics", timeout=30).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "openrl_kernel_sample_mixed_total"
    )


def _tokens(result) -> list[tuple[list[int], list[float]]]:
    return [(list(s.tokens), list(s.logprobs)) for s in result.sequences]


def test_samplers_of_one_user_share_batches_and_answer_as_alone(lab, service):
    trainer = new_trainer(service, seed=21)
    tok = trainer.get_tokenizer()
    batch = sft_batch(tok, TEXTS)
    paths = []
    for name in ("mix-early", "mix-late"):
        for _ in range(2):
            trainer.forward_backward(batch, "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        paths.append(trainer.save_weights_for_sampler(name).result().path)
    samplers = [service.create_sampling_client(model_path=p).result() for p in paths]
    samplers.append(service.create_sampling_client(base_model=MODEL).result())
    prompts = [types.ModelInput.from_ints(tok.encode(t[:4], add_special_tokens=False)) for t in TEXTS[:4]]
    calls = [(s, p, i) for i, p in enumerate(prompts) for s in range(len(samplers))]

    def run(sampler: int, prompt, i: int):
        params = types.SamplingParams(max_tokens=12, temperature=1.0, seed=40 + i, stop=[])
        return samplers[sampler].sample(prompt, num_samples=3, sampling_params=params)

    alone = [_tokens(run(*c).result()) for c in calls]  # one at a time: each call its own batch
    # the three samplers differ, so a row through the wrong weights would show
    assert len({str(alone[k]) for k in range(len(samplers))}) == len(samplers)
    before = _mixed(lab)
    for _ in range(ROUNDS):
        futures = [run(*c) for c in calls]  # all sent before any answer is read
        assert [_tokens(f.result()) for f in futures] == alone
        if _mixed(lab) > before:
            break
    assert _mixed(lab) > before, "no batch ran calls of two samplers together"
