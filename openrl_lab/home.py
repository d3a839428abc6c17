"""Where the lab keeps its state, and how clients find a running control plane (torch-free)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from openrl_lab.settings import settings

BUILTIN_MODEL_NAMES = ("openrl-lab/tiny-llama-1m", "openrl-lab/tiny-llama-10m")
DEFAULT_MODEL = BUILTIN_MODEL_NAMES[0]


def default_home() -> Path:
    """$OPENRL_LAB_HOME, else the per-user data directory (like JupyterHub's default)."""
    if env := settings().lab_home:
        return env.expanduser()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "openrl-lab"


def write_private(path: Path, text: str) -> None:
    """Writes a secret file readable by its owner only, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def connection_file(home: Path | None = None) -> Path:
    return (home or default_home()) / "connection.json"


def read_connection(home: Path | None = None) -> dict:
    """{"base_url": ..., "api_key": ...} of the control plane serving this home."""
    path = connection_file(home)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no running OpenRL Lab found: {path} does not exist (start one with `openrl-lab serve`)"
        ) from None


def find_api_key(explicit: str | None = None, saved: dict | None = None, home: Path | None = None) -> str | None:
    """The API key a client uses: `explicit`, else $OPENRL_LAB_API_KEY, else $TINKER_API_KEY, else the one in
    `saved` (a connection dict already read), or in the home's connection.json when `saved` is None. The one
    lookup every client (orchestrator, notebook, server extension) goes through."""
    key = explicit or settings().lab_api_key or os.environ.get("TINKER_API_KEY")
    if key:
        return key
    if saved is None:
        try:
            saved = read_connection(home)
        except (OSError, ValueError):
            return None
    return saved.get("api_key") or None


def secure_home(home: Path) -> Path:
    """Makes `home` private to its owner (0700, tightened if it was looser) and this process's new files
    private too (umask 077, inherited by kernels): the databases, their WAL files, logs and checkpoints
    hold other users' keys' hashes, runs and weights."""
    os.umask(0o077)
    home.mkdir(parents=True, exist_ok=True)
    if home.stat().st_mode & 0o077:
        home.chmod(0o700)
    return home
