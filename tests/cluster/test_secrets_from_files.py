"""`serve --join-token-file` and `--api-keys-dir`: the join token and users' keys given as files, the way Kubernetes
mounts the Helm chart's Secrets (deploy/helm/openrl-lab), registered at start and replaced by the next start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from openrl_lab.gateway.store import Store
from openrl_lab.identity import hash_key, new_api_key, new_join_token
from openrl_lab.server import DIR_KEYS_LABEL, FILE_TOKEN_LABEL, LabServer
from tests.cluster.helpers import joined, start_join


def secret_volume(directory: Path, data: dict[str, str]) -> Path:
    """A directory laid out as the kubelet mounts a Secret: each key a link into `..data`, itself a link to a
    timestamped directory; rewriting it swaps `..data`, as an updated Secret does."""
    directory.mkdir(exist_ok=True)
    version = directory / f"..2026_{len(list(directory.glob('..2026_*')))}"
    version.mkdir()
    for name, value in data.items():
        (version / name).write_text(value + "\n")
    data_link = directory / "..data"
    tmp_link = directory / "..data_tmp"
    tmp_link.symlink_to(version.name)
    tmp_link.replace(data_link)
    for name in os.listdir(directory):
        if not name.startswith(".") and name not in data:
            (directory / name).unlink()
    for name in data:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    return directory


def test_set_join_token_registers_it_once_and_a_new_one_replaces_it(tmp_path):
    store = Store(tmp_path / "state.db")
    made = store.add_join_token("by-hand")
    first, second = new_join_token(), new_join_token()
    store.set_join_token(FILE_TOKEN_LABEL, first)
    store.set_join_token(FILE_TOKEN_LABEL, first)  # a restart with the same Secret: nothing changes
    assert store.join_token_label(hash_key(first)) == FILE_TOKEN_LABEL
    assert len(store.list_join_tokens()) == 2
    store.set_join_token(FILE_TOKEN_LABEL, second)  # rotated: the old one is revoked, the hand-made one stays
    assert store.join_token_label(hash_key(first)) is None
    assert store.join_token_label(hash_key(second)) == FILE_TOKEN_LABEL
    assert store.join_token_label(hash_key(made)) == "by-hand"
    for bad in ("", "orl-join-short", new_api_key(), first + " trailing"):
        with pytest.raises(ValueError, match="a join token is 'orl-join-'"):
            store.set_join_token(FILE_TOKEN_LABEL, bad)
    store.close()


def test_set_keys_makes_exactly_those_keys_and_leaves_cli_keys_alone(tmp_path):
    store = Store(tmp_path / "state.db")
    own = store.add_key("carol", "default")
    alice, bob, bob2 = new_api_key(), new_api_key(), new_api_key()
    store.set_keys(DIR_KEYS_LABEL, {"alice": alice, "bob": bob})
    assert (store.user_for_key(alice), store.user_for_key(bob)) == ("alice", "bob")
    store.set_keys(DIR_KEYS_LABEL, {"bob": bob2})  # alice left the Secret, bob's key was replaced
    assert store.user_for_key(alice) is None and store.user_for_key(bob) is None
    assert store.user_for_key(bob2) == "bob" and store.user_for_key(own) == "carol"
    with pytest.raises(ValueError, match="user name 'a@b' is not allowed"):
        store.set_keys(DIR_KEYS_LABEL, {"a@b": new_api_key()})
    with pytest.raises(ValueError, match="the key of user 'dave' is not one: 'tml-'"):
        store.set_keys(DIR_KEYS_LABEL, {"dave": "sk-something-else-entirely-long-enough-000"})
    assert store.user_for_key(bob2) == "bob"  # a refused set changes nothing
    store.close()


def _serve_args(token_file: Path, keys_dir: Path) -> tuple[str, ...]:
    return ("--cpu-kernels", "0", "--join-token-file", str(token_file), "--api-keys-dir", str(keys_dir))


def _status(lab, key: str) -> int:
    return httpx.get(f"{lab.base_url}/api/v1/lab/kernels", headers={"X-API-Key": key}, timeout=10).status_code


@pytest.mark.server  # runs openrl-lab serve
def test_serve_takes_the_join_token_and_keys_from_mounted_secrets_and_a_restart_rotates_them(tmp_path):
    home = tmp_path / "cp-home"
    token = new_join_token()
    token_dir = secret_volume(tmp_path / "join", {"token": token})
    alice, bob = new_api_key(), new_api_key()
    keys_dir = secret_volume(tmp_path / "keys", {"alice": alice, "bob": bob})
    procs: list[subprocess.Popen] = []
    try:
        with LabServer(home, args=_serve_args(token_dir / "token", keys_dir)) as lab:
            assert _status(lab, alice) == 200 and _status(lab, bob) == 200
            log = tmp_path / "join.log"
            procs.append(
                start_join(
                    lab.grpc_target,
                    token_dir / "token",
                    tmp_path / "kernel-home",
                    "--name",
                    "pod-kernel",
                    "--group",
                    "cpu0",
                    log=log,
                )
            )
            assert joined(lab, "pod-kernel", procs[-1], log)["group"] == "cpu0"
            procs[-1].kill()  # (it would rejoin the next control plane with the file's new token)
        # The Secrets change (a new token, bob removed) and the control plane restarts, as `helm upgrade` does.
        new_token = new_join_token()
        secret_volume(token_dir, {"token": new_token})
        secret_volume(keys_dir, {"alice": alice})
        with LabServer(home, args=_serve_args(token_dir / "token", keys_dir)) as lab:
            assert _status(lab, alice) == 200 and _status(lab, bob) == 401
        listed = subprocess.run(
            [sys.executable, "-m", "openrl_lab.cli", "tokens", "list", "--home", str(home)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert listed.splitlines() == [f"{hash_key(new_token)[:12]}\t{FILE_TOKEN_LABEL}"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.server  # runs openrl-lab serve
def test_serve_refuses_a_malformed_join_token_file_with_a_readable_message(tmp_path):
    bad = tmp_path / "token"
    bad.write_text("changeme\n")
    keys = secret_volume(tmp_path / "keys", {})
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "openrl_lab.cli",
            "serve",
            "--home",
            str(tmp_path / "home"),
            "--port",
            "0",
            "--grpc-port",
            "0",
            *_serve_args(bad, keys),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "openrl-lab serve: a join token is 'orl-join-' and at least 32" in out.stderr
