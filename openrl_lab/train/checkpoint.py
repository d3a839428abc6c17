"""Checkpoint directories: weights.safetensors, optional optimizer.safetensors, meta.json.

Writes are atomic: everything goes into a hidden temp sibling, is fsynced, and is renamed into place,
so a crash never leaves a half-written directory at the final path. meta.json is plain JSON that the
gateway reads without torch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

WEIGHTS_FILE = "weights.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
FORMAT = "openrl-lab-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not fit where it is being loaded."""


class CheckpointExistsError(CheckpointError):
    """The target directory exists and overwrite was not asked for."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    # safetensors wants contiguous CPU tensors that share no storage.
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}, str(path))


def write_checkpoint(
    directory: str | Path,
    weights: dict[str, torch.Tensor],
    meta: dict,
    optimizer: dict[str, torch.Tensor] | None = None,
    overwrite: bool = False,
) -> int:
    """Write a checkpoint atomically; returns its total size in bytes."""
    final = Path(directory)
    if final.exists() and not overwrite:
        raise CheckpointExistsError(f"checkpoint {final} already exists")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        _save_tensors(weights, tmp / WEIGHTS_FILE)
        if optimizer is not None:
            _save_tensors(optimizer, tmp / OPTIMIZER_FILE)
        meta = {"format": FORMAT, "created_at": time.time(), **meta, "has_optimizer": optimizer is not None}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        size = sum(f.stat().st_size for f in tmp.iterdir())
        if final.exists():  # overwrite: move the old one aside, then swap in the new one
            old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync(final.parent)
        return size
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_meta(directory: str | Path) -> dict:
    path = Path(directory) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {directory} (missing {META_FILE})") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory}: unreadable {META_FILE}: {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {directory}: {META_FILE} is not a JSON object")
    return meta


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise CheckpointError(f"checkpoint {path.parent}: missing {path.name}")
    try:
        # Each tensor its own copy: safetensors' tensors are views of one storage over the whole file, and AdamW's
        # moments loaded as such views stayed alive when their job was evicted (the file's storage, not theirs).
        return {k: t.clone() for k, t in load_file(str(path), device="cpu").items()}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path.parent}: corrupt {path.name}: {e}") from None


def read_checkpoint(
    directory: str | Path, with_optimizer: bool = True
) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor] | None]:
    """(weights, meta, optimizer or None); CheckpointError when missing or corrupt."""
    directory = Path(directory)
    meta = read_meta(directory)
    weights = _load_tensors(directory / WEIGHTS_FILE)
    optimizer = None
    if with_optimizer and meta.get("has_optimizer"):
        optimizer = _load_tensors(directory / OPTIMIZER_FILE)
    return weights, meta, optimizer
