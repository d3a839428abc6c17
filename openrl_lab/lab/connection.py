"""Finding the control plane a notebook (or the Jupyter server extension) talks to. No Jupyter imports.

Order: an explicit URL; `$OPENRL_LAB_URL`; the `connection.json` that `openrl-lab serve` writes under the
lab home (`$OPENRL_LAB_HOME` or the per-user data dir) when that server answers. The key: an explicit
one, `$OPENRL_LAB_API_KEY`, `$TINKER_API_KEY`, or the one in `connection.json` (`home.find_api_key`, the
same lookup as the orchestrator client's).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from openrl_lab.home import connection_file, default_home, find_api_key
from openrl_lab.settings import settings
from openrl_lab.sockets import lab_answers


class LabError(Exception):
    """A user-facing problem with one-line message (wrong usage, nothing to connect to, unknown lease)."""


@dataclass(frozen=True)
class Connection:
    base_url: str
    api_key: str
    grpc_target: str | None = None  # the orchestrator; asked from the gateway when not known
    home: Path | None = None

    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.api_key}


def find_connection(url: str | None = None, api_key: str | None = None, home: Path | None = None) -> Connection | None:
    """The control plane to use, or None when no URL is given and no local one is running."""
    url = url or settings().lab_url
    home = Path(home).expanduser() if home else default_home()
    saved: dict = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        saved = json.loads(connection_file(home).read_text())
    if url:
        url = url.rstrip("/")
        same = saved.get("base_url", "").rstrip("/") == url
        key = find_api_key(api_key, saved if same else {})
        if not key:
            raise LabError(f"no API key for {url}: pass one, or set OPENRL_LAB_API_KEY")
        if not lab_answers(url):
            raise LabError(f"no OpenRL Lab answers at {url} (GET /api/v1/healthz failed)")
        return Connection(url, key, saved.get("grpc_target") if same else None, home if same else None)
    if saved.get("base_url") and lab_answers(saved["base_url"]):
        # The saved URL comes with its own key: $TINKER_API_KEY (often a hosted service's key) does not replace
        # it, only an explicit key or the lab's own variable does.
        key = api_key or settings().lab_api_key or saved["api_key"]
        return Connection(saved["base_url"].rstrip("/"), key, saved.get("grpc_target"), home)
    return None
