"""The kernel's `tokenizer_files` operation (in-process, and through the kernel protocol's codec): the
allow-listed files of a model's directory, nothing else, nothing from outside it, and a size cap."""

from __future__ import annotations

import json

import numpy as np
import pytest

from openrl_lab.kernel import codec, engine
from openrl_lab.kernel.api import OPERATIONS
from openrl_lab.kernel.engine import Engine, UserError


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "models" / "m"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "tokenizer_config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 64)  # weights: never served
    (d / "notes.txt").write_text("private")
    (tmp_path / "secret.json").write_text("outside the model directory")
    (d / "special_tokens_map.json").symlink_to(tmp_path / "secret.json")  # a link out: skipped
    (d / "vocab.json").mkdir()  # not a file: skipped
    return d


@pytest.fixture
def kernel(tmp_path):
    return Engine(tmp_path / "home")


def test_only_allow_listed_files_from_inside_the_directory(kernel, model_dir):
    files = kernel.tokenizer_files(str(model_dir))
    assert set(files) == {"config.json", "tokenizer.json", "tokenizer_config.json"}
    assert all(isinstance(a, np.ndarray) and a.dtype == np.uint8 for a in files.values())
    assert files["tokenizer.json"].tobytes() == (model_dir / "tokenizer.json").read_bytes()
    assert "tokenizer_files" in OPERATIONS
    # what the protocol carries: raw blobs, the same bytes back
    back = codec.decode(*codec.encode(files))
    assert {k: v.tobytes() for k, v in back.items()} == {k: v.tobytes() for k, v in files.items()}


def test_a_huggingface_cache_snapshot_serves_its_blobs(kernel, tmp_path):
    repo = tmp_path / "hub" / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for name, text in (("config.json", "{}"), ("tokenizer.json", '{"v": 1}')):
        (repo / "blobs" / name).write_text(text)
        (snap / name).symlink_to(f"../../blobs/{name}")
    assert {k: v.tobytes() for k, v in kernel.tokenizer_files(str(snap)).items()} == {
        "config.json": b"{}",
        "tokenizer.json": b'{"v": 1}',
    }


def test_unknown_and_unusable_models_are_refused_alike(kernel, tmp_path, model_dir):
    (tmp_path / "empty").mkdir()
    for name in ("no-such/model", str(tmp_path / "missing"), str(tmp_path / "empty")):
        with pytest.raises(UserError, match=r"not a model this kernel can load|unknown model"):
            kernel.tokenizer_files(name)


def test_the_size_is_capped(kernel, model_dir, monkeypatch):
    monkeypatch.setattr(engine, "MAX_TOKENIZER_BYTES", 8)
    with pytest.raises(UserError, match=r"tokenizer files of .* MiB .*at most 0 MiB are served"):
        kernel.tokenizer_files(str(model_dir))
