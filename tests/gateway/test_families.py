"""The other families' stand-ins (`openrl_lab.train.families`) through the real SDK, as a user of each would run them:
Llama 3 (Llama-3.2-1B, Llama-3.1-8B-Instruct) with the real Llama 3 tokenizer, put in a Hugging Face cache and
served by its hub name; Gemma 3, Mistral and gpt-oss (their architectures: sliding windows, attention sinks, a
mixture of experts) on the lab's tokenizer, served as `openrl-lab/tiny-<family>=DIR`. Each: a LoRA run whose loss
falls, what it trains (get_info), a sampler whose logprobs are the trainer's for the same tokens, and a full
fine-tuning step. (Qwen3 and Qwen3-MoE: test_qwen3.py.)"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from tinker import types

from openrl_lab.server import LabServer
from openrl_lab.train.families import FAMILIES, build_with

from ..conftest import sdk_client
from .helpers import raw_info, served_models

LLAMA3 = ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B-Instruct")
BY_DIR = ("openrl-lab/tiny-gemma3", "openrl-lab/tiny-mistral", "openrl-lab/tiny-gpt-oss")
KIND = {  # the config's model_type, as get_server_capabilities lists it
    LLAMA3[0]: "llama",
    LLAMA3[1]: "llama",
    BY_DIR[0]: "gemma3_text",
    BY_DIR[1]: "mistral",
    BY_DIR[2]: "gpt_oss",
}
# the repo tinker-cookbook loads every meta-llama/Llama-3* model's tokenizer from (tokenizer_utils.get_tokenizer)
COOKBOOK_LLAMA3_TOKENIZER = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"
# known ids of the real Llama 3 vocabulary: what a client of the real model gets
LLAMA3_IDS = {"Hello, world!": [128000, 9906, 11, 1917, 0]}
LLAMA3_CHAT = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"


@pytest.fixture(scope="module")
def families_lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    hf_home = root / "hf"
    args: list[str] = []
    for i, name in enumerate(FAMILIES):
        if name in LLAMA3:
            build_with(sys.executable, name, root / f"model-{i}", hf_home)
            args += ["--model", name]
        elif name in BY_DIR:
            args += ["--model", f"{name}={build_with(sys.executable, name, root / f'model-{i}')}"]
    args += ["--tokenizer-alias", f"{COOKBOOK_LLAMA3_TOKENIZER}={LLAMA3[1]}"]
    with LabServer(root / "home", args=tuple(args), env={"HF_HOME": str(hf_home)}) as lab:
        yield lab


@pytest.fixture(scope="module")
def client(families_lab):
    yield from sdk_client(families_lab)


def _datum(ids: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def _steps(trainer, datum: types.Datum, n: int, lr: float) -> list[float]:
    losses = []
    for _ in range(n):
        fb = trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


@pytest.mark.server  # `openrl-lab serve` processes
def test_each_is_listed_with_its_family(families_lab):
    served = served_models(families_lab)
    for name, kind in KIND.items():
        entry = served[name]
        assert entry["family"] == kind and entry["trainable"] and entry["sampleable"], entry
        assert ("architecture only" in entry["validated"]) is (name in BY_DIR), entry
    assert served[LLAMA3[0]]["max_context_length"] == 131072


@pytest.mark.server
@pytest.mark.parametrize("name", LLAMA3)
def test_llama3_comes_with_its_own_tokenizer(client, name):
    trainer = client.create_lora_training_client(base_model=name, rank=4, seed=0).result()
    tok = trainer.get_tokenizer()  # through the lab's /hf mirror, as the SDK loads it
    for text, ids in LLAMA3_IDS.items():
        assert tok.encode(text) == ids
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == LLAMA3_CHAT
    assert tok.convert_tokens_to_ids("<|eot_id|>") == 128009 and len(tok) == 128256
    assert tok.eos_token == ("<|eot_id|>" if "Instruct" in name else "<|end_of_text|>")


@pytest.mark.server
def test_the_mirror_serves_a_tokenizer_under_an_operators_alias(families_lab, tmp_path):
    """What a tool that loads the tokenizer from a repo of its own gets (`serve --tokenizer-alias REPO=MODEL`):
    huggingface_hub against the lab's /hf mirror, in a process of its own, as the cookbook's recipes load it."""
    import subprocess

    code = (
        "import sys, json\n"
        "from transformers import AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "print(json.dumps([tok.encode('Hello, world!'), tok.eos_token]))\n"
    )
    env = {
        "HF_ENDPOINT": f"{families_lab.base_url}/hf",
        "HF_TOKEN": families_lab.api_key,
        "HF_HOME": str(tmp_path / "hf-client"),
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run(
        [sys.executable, "-c", code, COOKBOOK_LLAMA3_TOKENIZER], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == '[[128000, 9906, 11, 1917, 0], "<|eot_id|>"]', done.stdout


@pytest.mark.server
@pytest.mark.parametrize("name", sorted(KIND))
def test_a_client_trains_and_samples_each_family(families_lab, client, name):
    trainer = client.create_lora_training_client(base_model=name, rank=8, seed=0).result()
    tok = trainer.get_tokenizer()
    prompt = tok.encode("12+3=", add_special_tokens=False)
    ids = [*prompt, *tok.encode("15", add_special_tokens=False), tok.eos_token_id]
    losses = _steps(trainer, _datum(ids), 6, 1e-2)
    assert losses[-1] < losses[0] * 0.8, losses

    trained = raw_info(families_lab, trainer.model_id)["trained"]
    assert trained["kind"] == "lora" and trained["parameters"] == sum(trained["targets"].values()), trained
    if KIND[name] == "gpt_oss":  # its fused experts, each with its own adapter; the router frozen
        assert "experts" in trained["targets"] and "gate_proj" not in trained["targets"], trained
        assert trained["experts"] == 4 and trained["router_trained"] is False, trained
    else:
        assert {"q_proj", "gate_proj", "lm_head"} <= set(trained["targets"]) and trained["experts"] == 0, trained

    sampler = trainer.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=8, seed=3, temperature=1.0)
    ).result()
    assert len(out.sequences) == 4 and all(1 <= len(s.tokens) <= 8 for s in out.sequences)
    # the sampler's logprobs of what it drew are the trainer's for the same tokens (the same weights)
    seq = out.sequences[0]
    scored = trainer.forward([_datum([*prompt, *seq.tokens])], "cross_entropy").result()
    theirs = np.asarray(scored.loss_fn_outputs[0]["logprobs"].tolist())[len(prompt) - 1 :]
    np.testing.assert_allclose(seq.logprobs, theirs, atol=1e-5)


@pytest.mark.server
@pytest.mark.parametrize("name", sorted(KIND))
def test_a_full_finetune_of_each_family_learns(families_lab, client, name):
    trainer = client.create_lora_training_client(base_model=name, rank=0, seed=0).result()  # rank 0: every weight
    trained = raw_info(families_lab, trainer.model_id)["trained"]
    assert trained["kind"] == "full" and trained["parameters"] == trained["base_parameters"], trained
    tok = trainer.get_tokenizer()
    losses = _steps(trainer, _datum(tok.encode("7+7=14 and 1+2=3", add_special_tokens=False)), 3, 1e-3)
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 1.0, losses
