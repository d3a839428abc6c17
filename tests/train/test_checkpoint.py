from __future__ import annotations

import json
import re

import pytest
import torch

from openrl_lab.train import checkpoint
from openrl_lab.train.checkpoint import (
    CheckpointError,
    CheckpointExistsError,
    read_checkpoint,
    read_meta,
    write_checkpoint,
)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(4, 8, generator=g),
        "b.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(7, dtype=torch.int64),
        "d.scalar": torch.tensor(3.0),
    }


def _assert_same(x: dict, y: dict):
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


def test_round_trip_is_bit_exact(tmp_path):
    w, opt = _weights(0), {"exp_avg/a.weight": torch.randn(4, 8), "step/a.weight": torch.tensor(5.0)}
    size = write_checkpoint(tmp_path / "ck", w, {"base_model": "m", "is_lora": True, "lora_rank": 8}, opt)
    assert size == sum(f.stat().st_size for f in (tmp_path / "ck").iterdir())
    w2, meta, opt2 = read_checkpoint(tmp_path / "ck")
    _assert_same(w, w2)
    _assert_same(opt, opt2)
    assert meta["base_model"] == "m" and meta["has_optimizer"] is True and "created_at" in meta
    # meta.json is plain JSON for readers without torch
    assert json.loads((tmp_path / "ck" / "meta.json").read_text())["lora_rank"] == 8
    assert read_checkpoint(tmp_path / "ck", with_optimizer=False)[2] is None


def test_without_optimizer(tmp_path):
    write_checkpoint(tmp_path / "ck", _weights(), {"base_model": "m"})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["meta.json", "weights.safetensors"]
    _, meta, opt = read_checkpoint(tmp_path / "ck")
    assert opt is None and meta["has_optimizer"] is False


def test_existing_directory_needs_overwrite(tmp_path):
    write_checkpoint(tmp_path / "ck", _weights(0), {"v": 1})
    with pytest.raises(CheckpointExistsError):
        write_checkpoint(tmp_path / "ck", _weights(1), {"v": 2})
    assert read_meta(tmp_path / "ck")["v"] == 1
    write_checkpoint(tmp_path / "ck", _weights(1), {"v": 2}, overwrite=True)
    w, meta, _ = read_checkpoint(tmp_path / "ck")
    assert meta["v"] == 2
    _assert_same(w, _weights(1))
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def _crash_on_optimizer(monkeypatch):
    real = checkpoint._save_tensors

    def save(tensors, path):
        if path.name == checkpoint.OPTIMIZER_FILE:
            raise OSError("disk full (simulated)")
        real(tensors, path)

    monkeypatch.setattr(checkpoint, "_save_tensors", save)


def test_crash_mid_write_leaves_nothing(tmp_path, monkeypatch):
    _crash_on_optimizer(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        write_checkpoint(tmp_path / "ck", _weights(), {"v": 1}, {"step/x": torch.tensor(1.0)})
    assert list(tmp_path.iterdir()) == []  # no final dir, no temp dir


def test_crash_during_overwrite_keeps_old_checkpoint(tmp_path, monkeypatch):
    write_checkpoint(tmp_path / "ck", _weights(0), {"v": 1})
    _crash_on_optimizer(monkeypatch)
    with pytest.raises(OSError):  # noqa: PT011 - the injected crash
        write_checkpoint(tmp_path / "ck", _weights(1), {"v": 2}, {"step/x": torch.tensor(1.0)}, overwrite=True)
    w, meta, _ = read_checkpoint(tmp_path / "ck")
    assert meta["v"] == 1
    _assert_same(w, _weights(0))
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def test_missing_and_corrupt(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        read_checkpoint(tmp_path / "absent")
    write_checkpoint(tmp_path / "ck", _weights(), {"v": 1}, {"step/x": torch.tensor(1.0)})
    (tmp_path / "ck" / "optimizer.safetensors").unlink()
    with pytest.raises(CheckpointError, match=re.escape("missing optimizer.safetensors")):
        read_checkpoint(tmp_path / "ck")
    data = (tmp_path / "ck" / "weights.safetensors").read_bytes()
    (tmp_path / "ck" / "weights.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape("corrupt weights.safetensors")):
        read_checkpoint(tmp_path / "ck", with_optimizer=False)
    (tmp_path / "ck" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=re.escape("meta.json")):
        read_meta(tmp_path / "ck")
