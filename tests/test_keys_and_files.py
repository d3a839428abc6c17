"""Keys that end, and a home nobody else can read: kernel keys die with their `serve`, users' keys can be
revoked while the lab runs, and everything under the home is private to its owner."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tinker

from openrl_lab.orchestrator import ServiceOrchestratorClient, TimeSliceOrchestratorClient
from openrl_lab.orchestrator.errors import Unauthenticated
from openrl_lab.server import LabServer
from tests.conftest import make_key
from tests.processes import lab_kernels

pytestmark = pytest.mark.server  # starts labs and runs the CLI in subprocesses

MODEL = "openrl-lab/tiny-llama-1m"


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "openrl_lab.cli", "keys", *args, "--home", str(home)], capture_output=True, text=True
    )


def _kernel_key(lab: LabServer) -> str:
    return lab_kernels(lab)[0].environ()["OPENRL_ORCHESTRATOR_KEY"]


def _http_status(lab: LabServer, key: str) -> int:
    return httpx.get(f"{lab.base_url}/api/v1/training_runs", headers={"X-API-Key": key}, timeout=30).status_code


def test_a_kernel_key_does_not_outlive_its_serve(tmp_path):
    lab = LabServer(tmp_path / "home")
    with lab:
        old = _kernel_key(lab)
        with TimeSliceOrchestratorClient(lab.grpc_target, api_key=old, job="probe") as c:
            assert c.list_groups()  # valid while its serve runs ...
        assert _http_status(lab, old) == 401  # ... over gRPC only: a kernel is nobody's HTTP identity
    with lab:  # the same home, started again
        new = _kernel_key(lab)
        assert new != old
        with (
            ServiceOrchestratorClient(lab.grpc_target, api_key=old, job="probe", on_behalf_of="local") as c,
            pytest.raises(Unauthenticated),
        ):
            c.lease("default", "hijack")
        assert _http_status(lab, old) == 401
        # the new kernel still works: a training step goes through it
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
        datum = tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
        )
        assert trainer.forward_backward([datum], "cross_entropy").result().metrics
        service.close("success").result()
    listed = _cli(tmp_path / "home", "list")
    assert listed.returncode == 0 and "openrl-kernel" not in listed.stdout, listed.stderr  # revoked when serve stopped


def test_revoke_a_users_keys_while_the_lab_runs(tmp_path):
    home = tmp_path / "home"
    with LabServer(home) as lab:
        first, second = make_key(home, "alice"), make_key(home, "alice")
        assert _http_status(lab, first) == _http_status(lab, second) == 200
        listed = [line.split("\t") for line in _cli(home, "list").stdout.splitlines()]
        ids = [key_id for key_id, user, _ in listed if user == "alice"]
        assert len(ids) == 2 and all(len(i) == 12 for i in ids) and first not in _cli(home, "list").stdout

        # One key by id: the other keeps working.
        out = _cli(home, "revoke", "alice", "--id", ids[0][:8])
        assert out.returncode == 0 and "revoked 1 key of alice" in out.stdout
        statuses = sorted([_http_status(lab, first), _http_status(lab, second)])
        assert statuses == [200, 401]

        # All of them: refused over HTTP and gRPC at once, without a restart.
        assert _cli(home, "revoke", "alice").returncode == 0
        assert _http_status(lab, first) == _http_status(lab, second) == 401
        with (
            TimeSliceOrchestratorClient(lab.grpc_target, api_key=second, job="probe") as c,
            pytest.raises(Unauthenticated),
        ):
            c.list_groups()

        nothing = _cli(home, "revoke", "alice")
        assert nothing.returncode != 0 and "user 'alice' has no key" in nothing.stderr
        assert _http_status(lab, lab.api_key) == 200  # other users are untouched


def test_everything_under_the_home_is_private(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)  # as a user's earlier, looser setup left it
    with LabServer(home) as lab:
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
        trainer.save_state("private").result()
        trainer.save_weights_for_sampler("private-sampler").result()
        make_key(home, "bob")
        service.close("success").result()
        created = list(home.rglob("*"))
        names = {p.name for p in created}
        assert {"state.db", "state.db-wal", "orchestrator.db", "api_key", "connection.json"} <= names
        assert any(p.suffix == ".safetensors" for p in created)
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        loose = {
            str(p.relative_to(home)): oct(stat.S_IMODE(p.lstat().st_mode))
            for p in created
            if not p.is_symlink() and p.lstat().st_mode & 0o077
        }
        assert loose == {}
        assert os.stat(home / "state.db").st_uid == os.getuid()
