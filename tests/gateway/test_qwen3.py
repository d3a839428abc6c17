"""A real family under its hub name: the Qwen3 stand-in (`openrl_lab.train.families`: Qwen3's config shrunk, the real
Qwen vocabulary, Qwen3's added tokens and ChatML) put in a Hugging Face cache as `Qwen/Qwen3-8B`, as on a machine
where the real model is cached, and served by `openrl-lab serve --model Qwen/Qwen3-8B`. Through the real SDK: what
it lists, the tokenizer a client gets, LoRA training, sampling whose logprobs are the trainer's."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from tinker import types

from openrl_lab.server import LabServer
from openrl_lab.train.families import QWEN3_ADDED, QWEN_FIRST_ADDED_ID, build_with, qwen_tokenizer
from openrl_lab.train.trainer import ATTN_MODULES, EXPERTS, MLP_MODULES, UNEMBED_MODULES

from ..conftest import sdk_client
from .helpers import raw_info, served_models

NAME = "Qwen/Qwen3-8B"
MOE = "Qwen/Qwen3-30B-A3B"  # the mixture of experts, on the same tokenizer
FAMILIES = {NAME: "qwen3", MOE: "qwen3_moe"}
# Known ids of the real Qwen2/Qwen3 vocabulary (its tokenizer.json): what a client of the real model gets.
REAL_IDS = {
    "Hello, world!": [9707, 11, 1879, 0],
    "<|im_start|>user\nhi<|im_end|>\n": [151644, 872, 198, 6023, 151645, 198],
}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
CHATML = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_tokenizer()


def test_the_tokenizer_is_qwens(tokenizer):
    for text, ids in REAL_IDS.items():
        assert tokenizer.encode(text, add_special_tokens=False) == ids
        assert tokenizer.decode(ids) == text
    assert len(tokenizer) == QWEN_FIRST_ADDED_ID + len(QWEN3_ADDED) == 151669
    got = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<tool_call>", "<think>", "</think>"])
    assert got == [151643, 151645, 151657, 151667, 151668]
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token) == (151645, 151643, None)
    # non-special added tokens (think, tool calls) survive skip_special_tokens; the ChatML ones do not
    ids = tokenizer.encode("<|im_start|>a <think>b</think><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a <think>b</think>"
    assert tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == CHATML
    no_think = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_think == CHATML + "<think>\n\n</think>\n\n"
    tool = [*CHAT, {"role": "assistant", "content": "4"}, {"role": "tool", "content": "ok"}]
    assert tokenizer.apply_chat_template(tool, tokenize=False).endswith(
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
    )


@pytest.fixture(scope="module")
def qwen_lab(tmp_path_factory):
    """The stand-ins written and cached by the module's own command line, as a user would, then served by name."""
    root = tmp_path_factory.mktemp("qwen3")
    hf_home = root / "hf"
    for i, name in enumerate(FAMILIES):
        build_with(sys.executable, name, root / f"model-{i}", hf_home)
    args = ("--model", NAME, "--model", MOE)
    with LabServer(root / "home", args=args, env={"HF_HOME": str(hf_home)}) as lab:
        yield lab


@pytest.fixture(scope="module")
def client(qwen_lab):
    yield from sdk_client(qwen_lab)


@pytest.mark.server  # `openrl-lab serve` processes
def test_served_under_its_hub_name_with_its_family(qwen_lab):
    served = served_models(qwen_lab)
    for name, family in FAMILIES.items():
        entry = served[name]
        assert entry["family"] == family and entry["architecture"].startswith("Qwen3"), entry
        assert entry["max_context_length"] == 40960 and entry["trainable"] and entry["sampleable"], entry
        assert "torch sampler" in entry["validated"] and "full fine-tuning" in entry["validated"], entry


@pytest.mark.server  # `openrl-lab serve` processes
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_client_trains_and_samples_qwen3_with_its_own_tokenizer(qwen_lab, client, tokenizer, name):
    trainer = client.create_lora_training_client(base_model=name, rank=8, seed=0).result()
    assert trainer.get_info().model_data.model_name == name
    trained = raw_info(qwen_lab, trainer.model_id)["trained"]
    if name == MOE:  # every expert's fused projections, each with its own rank-8 adapter; the router frozen
        assert list(trained["targets"]) == [*ATTN_MODULES, EXPERTS, *UNEMBED_MODULES], trained
        assert trained["expert_parameters"] == ["down_proj", "gate_up_proj"], trained
        assert trained["experts"] == 4 and trained["router_trained"] is False, trained
        # per layer: gate_up_proj [4, 2*32, 64] and down_proj [4, 64, 32], each expert A [8, in] + B [out, 8]
        per_layer = 4 * 8 * ((64 + 2 * 32) + (32 + 64))
        assert trained["targets"][EXPERTS] == 2 * per_layer, trained
    else:
        assert list(trained["targets"]) == [*ATTN_MODULES, *MLP_MODULES, *UNEMBED_MODULES], trained
        assert trained["experts"] == 0 and trained["router_trained"] is None, trained
    theirs = trainer.get_tokenizer()  # through the lab's /hf mirror, as the SDK loads it
    for text, ids in REAL_IDS.items():
        assert theirs.encode(text, add_special_tokens=False) == ids
    assert theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == CHATML

    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    answer = [*tokenizer.encode("<think>\n\n</think>\n\n4", add_special_tokens=False), tokenizer.eos_token_id]
    ids = [*prompt, *answer]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer),  # the answer only, as chat SFT trains
        },
    )
    losses = []
    for _ in range(6):
        fb = trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0] * 0.8, losses

    sampler = trainer.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=8, seed=3, temperature=1.0)
    ).result()
    assert len(out.sequences) == 4 and all(1 <= len(s.tokens) <= 8 for s in out.sequences)
    assert all(0 <= t < len(tokenizer) for s in out.sequences for t in s.tokens)
    # the sampler's logprobs of what it drew are the trainer's for the same tokens (the same weights)
    seq = out.sequences[0]
    full = [*prompt, *seq.tokens]
    scored = trainer.forward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
            )
        ],
        "cross_entropy",
    ).result()
    theirs_lp = np.asarray(scored.loss_fn_outputs[0]["logprobs"].tolist())[len(prompt) - 1 :]
    np.testing.assert_allclose(seq.logprobs, theirs_lp, atol=1e-5)


@pytest.mark.server  # `openrl-lab serve` processes
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_full_finetune_of_qwen3_learns(qwen_lab, client, tokenizer, name):
    trainer = client.create_lora_training_client(base_model=name, rank=0, seed=0).result()  # rank 0: every weight
    ids = tokenizer.encode("<|im_start|>assistant\nfour<|im_end|>", add_special_tokens=False)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    losses = []
    for _ in range(3):
        fb = trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 1.0, losses
