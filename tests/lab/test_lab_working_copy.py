"""`openrl-lab lab` / `make lab` opens a working copy of the tutorials, never the repository's notebooks/: the
copy is made, refreshed while the user has not changed it, kept once they have; and the real command serves
the copy (saving through JupyterLab leaves the repository as committed)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from openrl_lab.cli import TUTORIALS, _tutorial_working_copy
from tests.conftest import running_lab


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def test_the_copy_is_made_refreshed_while_untouched_and_kept_once_changed(tmp_path):
    src, dest = tmp_path / "tutorials", tmp_path / "copy"
    src.mkdir()
    (src / "01-a.ipynb").write_text('{"v": 1}')
    (src / "02-b.ipynb").write_text('{"v": 1}')
    before = _hashes(src)

    assert _tutorial_working_copy(src, dest) == []
    assert (dest / "01-a.ipynb").read_text() == '{"v": 1}' and (dest / "02-b.ipynb").exists()

    (dest / "02-b.ipynb").write_text('{"v": 1, "outputs": "the user ran it"}')  # autosave after a run
    (src / "01-a.ipynb").write_text('{"v": 2}')
    (src / "02-b.ipynb").write_text('{"v": 2}')
    before = _hashes(src)
    notes = _tutorial_working_copy(src, dest)
    assert (dest / "01-a.ipynb").read_text() == '{"v": 2}', "an untouched copy follows its original"
    assert (dest / "02-b.ipynb").read_text() == '{"v": 1, "outputs": "the user ran it"}', "the user's copy stays"
    assert any("refreshed" in n and "01-a" in n for n in notes)
    assert any("02-b" in n and "kept" in n for n in notes)
    assert _tutorial_working_copy(src, dest) == [], "each note once"
    (dest / "02-b.ipynb").unlink()  # how a user gets a fresh copy
    _tutorial_working_copy(src, dest)
    assert (dest / "02-b.ipynb").read_text() == '{"v": 2}'
    assert _hashes(src) == before, "the originals are never written"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.server  # runs openrl-lab lab (JupyterLab and a control plane)
@pytest.mark.skipif(not TUTORIALS.is_dir(), reason="a source checkout's notebooks/")
def test_openrl_lab_lab_serves_a_copy_and_leaves_the_repository_notebooks_alone(tmp_path_factory, tmp_path):
    before = _hashes(TUTORIALS)
    home = tmp_path_factory.mktemp("lab-home")
    port, token = _free_port(), secrets.token_hex(8)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws"),
    }
    for server in running_lab(home):  # a running control plane: `lab` uses it rather than starting one
        cmd = [
            sys.executable,
            "-m",
            "openrl_lab.cli",
            "lab",
            "--home",
            str(home),
            "--notebook-dir",
            str(TUTORIALS),
            "--",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            "--ServerApp.open_browser=False",
            "--ServerApp.allow_root=True",
        ]
        log = open(tmp_path / "lab.log", "wb")  # noqa: SIM115 - the server's log, open while it runs
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            api = f"http://127.0.0.1:{port}/api/contents"
            h = {"Authorization": f"token {token}"}
            deadline = time.monotonic() + 90
            while True:
                assert proc.poll() is None, (tmp_path / "lab.log").read_text()
                try:
                    r = httpx.get(api, headers=h, timeout=2)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, (tmp_path / "lab.log").read_text()
                time.sleep(0.3)
            names = {c["name"] for c in r.json()["content"]}
            assert {p.name for p in TUTORIALS.glob("*.ipynb")} <= names
            # what autosave does after a run: the copy changes, the repository does not
            nb = httpx.get(f"{api}/02-grpo-live-plots.ipynb", headers=h, timeout=10).json()["content"]
            nb["cells"][1]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ran\n"}]
            nb["cells"][1]["execution_count"] = 1
            r = httpx.put(
                f"{api}/02-grpo-live-plots.ipynb",
                headers=h,
                timeout=10,
                json={"type": "notebook", "format": "json", "content": nb},
            )
            assert r.status_code == 200, r.text
            copy = home / "notebooks" / "02-grpo-live-plots.ipynb"
            assert "".join(json.loads(copy.read_text())["cells"][1]["outputs"][0]["text"]) == "ran\n"
            assert "stay as committed" in (tmp_path / "lab.log").read_text()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
            log.close()
        assert server.base_url  # still ours: the command did not stop a control plane it did not start
    assert _hashes(TUTORIALS) == before, "the repository's tutorials are as committed"
