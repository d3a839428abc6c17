"""Where model directories come from: built-in tiny models made locally, local HF dirs, the HF cache.

No model hub is reachable on our machines, so the project makes its own small Llama models from a fixed
seed, with a byte-level BPE tokenizer trained on a fixed synthetic corpus (every digit its own token, see
`_tokenizer_json`). Each is saved as an ordinary
Hugging Face directory and also registered in the HF hub cache, so that
`AutoTokenizer.from_pretrained("openrl-lab/tiny-llama-1m")` (what the tinker SDK calls) works offline.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from openrl_lab.home import default_home, find_model, served_models, served_names  # default_home: re-exported

BUILDER_VERSION = 2  # bump when a built-in model's recipe changes: built models of another version are rebuilt
# (a new HF cache revision too). 2: digits pre-tokenized one per token (issue 16).
MARKER_FILE = "openrl_lab_model.json"  # names a built-in model inside its directory

BUILTIN_MODELS: dict[str, dict] = {
    "openrl-lab/tiny-llama-1m": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        seed=1,
    ),
    "openrl-lab/tiny-llama-10m": dict(
        hidden_size=256,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1024,
        seed=10,
    ),
}
# Files transformers probes for but our models do not have: recorded as absent in the HF cache
# (`.no_exist/<rev>/<file>`), so an online-mode load does not ask the hub for each of them.
_ABSENT_FILES = (
    "added_tokens.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "model.safetensors.index.json",
    "adapter_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "custom_generate/generate.py",
)
MAX_CONTEXT = 512
TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class UnknownModelError(ValueError):
    """A model name that is neither built in, a local directory, nor in the local HF cache."""


# ----------------------------------------------------------------------------------------- tokenizer


def _synthetic_corpus() -> list[str]:
    """A fixed corpus of arithmetic, digits and short words: what our toy RL tasks look like."""
    rng = random.Random(1234)
    words = (
        "the a an is are was and or not of to in on at it be we you they what how many much sum "
        "add plus minus times answer question number count one two three four five six seven eight "
        "nine ten yes no true false good bad cat dog sun moon red blue green big small up down left "
        "right hello world think step so then if equal more less than first last total each"
    ).split()
    lines = []
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        op = rng.choice("+-*")
        c = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a}{op}{b}={c}")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))))
        lines.append(f"what is {a} {op} {b}? the answer is {c}.")
    return lines


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process (deterministic: fixed corpus, ordered merges).

    A digit is always one token, on purpose (as most arithmetic work assumes): digits are split apart before
    byte-level BPE sees them, so no merge can join two digits ('14' is '1', '4') or a space and a digit
    (' 0' and ' 7' are both a space token, then the digit). A number of k digits is k tokens wherever it
    stands, and a task's answer length in tokens is its length in digits.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(), trainer)
    # With digits kept apart, the corpus runs out of merges at 506 tokens. Pad with reserved special tokens
    # (at the end, so no id moves) to exactly TOKENIZER_VOCAB: a round embedding size, and the same model
    # shape, hence the same seeded weights, as before digits were split; a text made of single characters
    # (the copy task's) gets the very ids it had then.
    missing = TOKENIZER_VOCAB - tok.get_vocab_size()
    tok.add_special_tokens([f"<reserved_{i}>" for i in range(max(missing, 0))])
    return tok.to_str()


def build_tokenizer():
    """The built-in models' tokenizer: byte-level BPE trained on a fixed synthetic corpus."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_CONTEXT,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# ------------------------------------------------------------------------------------- built models


def _build_model_files(name: str, out_dir: Path) -> None:
    """Write a built-in model (weights from a fixed seed, tokenizer, configs) into out_dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(BUILTIN_MODELS[name])
    seed = spec.pop("seed")
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_CONTEXT,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **spec,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG alone
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / MARKER_FILE).write_text(json.dumps({"name": name, "builder_version": BUILDER_VERSION}))


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _built_version(model_dir: Path) -> int | None:
    """The BUILDER_VERSION a built model directory was made by (None: not a complete built model)."""
    try:
        return int(json.loads((model_dir / MARKER_FILE).read_text()).get("builder_version", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _ensure_built(name: str, home: Path) -> Path:
    final = home / "models" / name
    if _built_version(final) == BUILDER_VERSION:
        return final
    # Two processes may ask at once: one builds, the other waits on the lock and then finds it. A model
    # built by another BUILDER_VERSION (an older recipe, e.g. the tokenizer before issue 16) is rebuilt.
    with _file_lock(final.parent / f".{final.name}.lock"):
        if _built_version(final) != BUILDER_VERSION:
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
            try:
                _build_model_files(name, tmp)
                if final.exists():  # a half-made dir, or one built by another BUILDER_VERSION: replace it
                    shutil.rmtree(final)
                os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return final


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _cache_revision(name: str) -> str:
    return hashlib.sha1(f"{name}@openrl-lab-builder-{BUILDER_VERSION}".encode()).hexdigest()


def register_in_hf_cache(name: str, model_dir: Path) -> Path:
    """Make `name` resolvable from the HF hub cache (refs/main + a snapshot of symlinks to model_dir)."""
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / ("models--" + name.replace("/", "--"))
    rev = _cache_revision(name)
    snap = repo / "snapshots" / rev
    files = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    if (repo / "refs" / "main").exists() and all((snap / f).exists() for f in files):
        return snap
    with _file_lock(repo.parent / ".locks" / f"{repo.name}.openrl-lab.lock"):
        snap.mkdir(parents=True, exist_ok=True)
        for f in files:
            link = snap / f
            if link.is_symlink() or link.exists():
                link.unlink()
            try:
                link.symlink_to((model_dir / f).resolve())
            except OSError:  # filesystems without symlinks
                shutil.copyfile(model_dir / f, link)
        for f in _ABSENT_FILES:
            if f not in files:
                marker = repo / ".no_exist" / rev / f
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return snap


def resolve_model_dir(name: str | Path, home: Path | None = None) -> Path:
    """A built-in name (built on first use), a catalog name, or without a catalog an existing local directory or a
    model in the HF cache (looked up offline: no hub is contacted)."""
    name = str(name)
    if name in BUILTIN_MODELS:
        model_dir = _ensure_built(name, Path(home) if home else default_home())
        register_in_hf_cache(name, model_dir)
        return model_dir
    catalog = served_models()
    if catalog and name not in catalog:
        raise UnknownModelError(f"unknown model {name!r}: this server serves {', '.join(served_names())}")
    found = find_model(catalog.get(name) or name)
    if found is None:
        where = f" (the catalog's {catalog[name]!r} for it)" if catalog.get(name) else ""
        raise UnknownModelError(
            f"unknown model {name!r}{where}: not a local directory and not in the Hugging Face cache "
            f"(no hub is contacted); built-in models: {', '.join(BUILTIN_MODELS)}"
        )
    return found


# ------------------------------------------------------------------------------------------ card


@dataclass
class ModelCard:
    name: str
    path: Path
    arch: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    num_parameters: int
    family: str = ""  # the config's model_type ("llama", "qwen3", ...): what VALIDATED is keyed by


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _count_parameters(model_dir: Path) -> int:
    """Sum tensor sizes from safetensors headers without loading any weights."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - a safetensors handle: keys(), no iteration
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def model_card(model_dir: str | Path, name: str | None = None) -> ModelCard:
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)  # multimodal configs nest the LM's settings
    marker = model_dir / MARKER_FILE
    if name is None:
        name = json.loads(marker.read_text())["name"] if marker.exists() else str(model_dir)
    tokenizer = load_tokenizer(model_dir)
    eos = _as_list(text.get("eos_token_id"))
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos += _as_list(json.loads(gen.read_text()).get("eos_token_id"))
    eos += _as_list(tokenizer.eos_token_id)
    return ModelCard(
        name=name,
        path=model_dir,
        arch=(config.get("architectures") or [config.get("model_type", "unknown")])[0],
        vocab_size=int(text.get("vocab_size") or len(tokenizer)),
        max_context_length=int(text.get("max_position_embeddings") or tokenizer.model_max_length),
        eos_token_ids=sorted(set(eos)),
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_parameters=_count_parameters(model_dir),
        family=str(config.get("model_type") or ""),
    )
