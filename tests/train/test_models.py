from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from openrl_lab.train import models
from openrl_lab.train.models import (
    BUILTIN_MODELS,
    UnknownModelError,
    default_home,
    load_tokenizer,
    model_card,
    register_in_hf_cache,
    resolve_model_dir,
)

TINY = "openrl-lab/tiny-llama-1m"


def _digest(model_dir: Path) -> str:
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        h.update((model_dir / name).read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("name,low,high", [(TINY, 0.8e6, 1.5e6), ("openrl-lab/tiny-llama-10m", 8e6, 12e6)])
def test_builtin_models_are_deterministic_and_sized(name, low, high, lab_home, tmp_path):
    first = resolve_model_dir(name)
    assert first == lab_home / "models" / name
    models._tokenizer_json.cache_clear()  # retrain the tokenizer too
    second = resolve_model_dir(name, home=tmp_path)  # an independent second build
    assert second == tmp_path / "models" / name
    assert _digest(first) == _digest(second)

    card = model_card(first)
    assert card.name == name and card.arch == "LlamaForCausalLM"
    assert low < card.num_parameters < high
    config = json.loads((first / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 32  # a head size vLLM supports
    assert config["tie_word_embeddings"] is False
    assert config["vocab_size"] == len(load_tokenizer(first)) == card.vocab_size
    assert config["num_key_value_heads"] * 2 == config["num_attention_heads"]


def test_tokenizer_round_trips_ascii(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    assert 350 <= len(tok) <= 512
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", "</s>")
    texts = [
        "12+7=19",
        "what is 3 * 4? the answer is 12.",
        "  Leading and trailing  ",
        "tabs\tand\nnewlines\r\n",
        "".join(chr(c) for c in range(32, 127)),
        "",
        "x",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # merges learned from the synthetic corpus compress its kind of text
    assert len(tok.encode("what is the answer")) < len("what is the answer") / 2


def test_a_digit_is_one_token(tiny_dir):
    """Issue 16: every digit is its own token, with or without a space before it, and nothing merges a digit
    with its neighbours. Every digit string of length 1-4 (any merge of digits shows in a pair already), and 5,000
    random ones of length 5-6, bare and after a space."""
    import itertools
    import random

    tok = load_tokenizer(tiny_dir)
    backend = tok.backend_tokenizer
    digit = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    space = tok.encode(" ", add_special_tokens=False)
    assert len(set(digit)) == 10 and tok.unk_token_id not in digit and len(space) == 1
    assert len(tok) == models.TOKENIZER_VOCAB  # padded with reserved tokens at the end: the model's shape is kept
    rng = random.Random(16)
    strings = ["".join(p) for n in range(1, 5) for p in itertools.product("0123456789", repeat=n)]
    strings += ["".join(rng.choice("0123456789") for _ in range(rng.choice((5, 6)))) for _ in range(5_000)]
    for prefix, head in (("", []), (" ", space)):
        texts = [prefix + s for s in strings]
        encoded = backend.encode_batch(texts, add_special_tokens=False)
        for text, s, e in zip(texts, strings, encoded):
            assert e.ids == head + [digit[int(c)] for c in s], (text, e.tokens)
        assert backend.decode_batch([e.ids for e in encoded]) == texts
    # the same inside text: ' 0' like ' 1'..' 9', numbers split digit by digit
    assert [tok.encode(f" {d}", add_special_tokens=False) for d in range(10)] == [[*space, i] for i in digit]
    assert tok.convert_ids_to_tokens(tok.encode("sort 3142:", add_special_tokens=False))[-6:] == [
        "Ġ",
        "3",
        "1",
        "4",
        "2",
        ":",
    ]
    assert tok.convert_ids_to_tokens(tok.encode("12+7=19", add_special_tokens=False)) == [
        "1",
        "2",
        "+",
        "7",
        "=",
        "1",
        "9",
    ]


def test_a_stale_built_model_is_rebuilt(tmp_path, monkeypatch):
    """A model built by an older BUILDER_VERSION (e.g. the tokenizer before issue 16) is rebuilt on first use."""
    builds = []

    def fake_build(name, out_dir):
        builds.append(name)
        (out_dir / models.MARKER_FILE).write_text(json.dumps({"name": name, "builder_version": models.BUILDER_VERSION}))

    monkeypatch.setattr(models, "_build_model_files", fake_build)
    old = tmp_path / "models" / TINY
    old.mkdir(parents=True)
    (old / models.MARKER_FILE).write_text(json.dumps({"name": TINY, "builder_version": models.BUILDER_VERSION - 1}))
    (old / "tokenizer.json").write_text("{}")
    assert models._ensure_built(TINY, tmp_path) == old
    assert builds == [TINY] and not (old / "tokenizer.json").exists()
    assert json.loads((old / models.MARKER_FILE).read_text())["builder_version"] == models.BUILDER_VERSION
    models._ensure_built(TINY, tmp_path)
    assert builds == [TINY]  # current: not built again


def test_model_card(tiny_dir):
    card = model_card(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    assert card.path == tiny_dir
    assert card.max_context_length == 512
    assert card.eos_token_ids == [tok.eos_token_id]
    assert (card.bos_token_id, card.pad_token_id) == (tok.bos_token_id, tok.pad_token_id)


def test_resolve_local_dir_and_unknown(tiny_dir, tmp_path):
    assert resolve_model_dir(str(tiny_dir)) == tiny_dir
    with pytest.raises(UnknownModelError) as err:
        resolve_model_dir("nobody/no-such-model")
    assert "nobody/no-such-model" in str(err.value)
    for name in BUILTIN_MODELS:
        assert name in str(err.value)
    with pytest.raises(UnknownModelError):
        resolve_model_dir(str(tmp_path / "missing"))


def test_resolve_finds_models_in_hf_cache(tiny_dir):
    snap = register_in_hf_cache("someorg/cached-model", tiny_dir)
    assert resolve_model_dir("someorg/cached-model") == snap
    assert (snap / "config.json").exists()


def test_concurrent_first_use_builds_once(tmp_path, monkeypatch):
    builds = []
    original = models._build_model_files

    def counting(name, out_dir):
        builds.append(name)
        time.sleep(0.3)  # keep the builder inside the lock while the other thread arrives
        original(name, out_dir)

    monkeypatch.setattr(models, "_build_model_files", counting)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model_dir(TINY, home=tmp_path))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == [TINY]
    assert results == [tmp_path / "models" / TINY] * 2
    leftovers = [p.name for p in (tmp_path / "models" / "openrl-lab").iterdir() if ".tmp-" in p.name]
    assert leftovers == []


def test_default_home(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENRL_LAB_HOME", str(tmp_path / "h"))
    assert default_home() == tmp_path / "h"
    monkeypatch.delenv("OPENRL_LAB_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_home() == tmp_path / "xdg" / "openrl-lab"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_home() == Path.home() / ".local" / "share" / "openrl-lab"


@pytest.mark.server  # a fresh Python process
def test_autotokenizer_offline_in_fresh_process(tiny_dir, lab_home):
    """What the tinker SDK's get_tokenizer does, in a process that only has the HF cache env."""
    from huggingface_hub import constants

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=constants.HF_HUB_CACHE)
    code = (
        "from transformers import AutoTokenizer\n"
        f"t = AutoTokenizer.from_pretrained({TINY!r})\n"
        "print(len(t), t.decode(t.encode('1+1=2')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(len(load_tokenizer(tiny_dir))), "1+1=2"]


def test_autotokenizer_online_mode_falls_back_to_cache(tiny_dir, monkeypatch):
    """Without HF_HUB_OFFLINE and with the hub unreachable, the cached copy is used."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _http
    from transformers import AutoTokenizer

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # refused at once, never the internet
    monkeypatch.setattr(_http.time, "sleep", lambda s: None)  # skip huggingface_hub's retry backoff
    tok = AutoTokenizer.from_pretrained(TINY)
    assert tok.decode(tok.encode("12+7=19")) == "12+7=19"
    assert len(tok) == len(load_tokenizer(tiny_dir))
