"""Shared fixtures: a real `openrl-lab serve` on loopback, driven by the real tinker SDK."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrl_lab.kernel.threads import reproducible_blas

# jp_fetch / jp_ws_fetch: a real jupyter_server for the server extension's tests
pytest_plugins = ["pytest_jupyter.jupyter_server"]

# tests/vllm runs in the vLLM environment only (`make vllm-env`; `make test` runs it there as a step of its own)
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]
# tests/cookbook runs in the tinker-cookbook environment only (`make cookbook-env`; the fourth step of `make test`)
if not importlib.util.find_spec("tinker_cookbook"):
    collect_ignore.append("cookbook")

# Nothing a test does may write outside its temporary directories, or reach for a network.
_TMP = Path(os.environ.get("PYTEST_TMPROOT", "/tmp")) / f"openrl-lab-tests-{os.getpid()}"
os.environ.setdefault("HF_HOME", str(_TMP / "hf"))
os.environ["TINKER_TELEMETRY"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(_TMP / "hypothesis"))  # not into the checkout
reproducible_blas()  # the BLAS mode a kernel runs in, for what tests compute in this process (kernel/threads.py)


def running_lab(home: Path, env: dict[str, str] | None = None):
    """A real `openrl-lab serve` (gateway + kernel + orchestrator) on loopback, stopped afterwards; `env`: more
    environment variables for it (an OPENRL_LAB_ORCHESTRATOR_CONFIG, say)."""
    from openrl_lab.server import LabServer

    with LabServer(home, env=env) as server:
        yield server


def sdk_client(lab):
    """The real tinker SDK pointed at `lab`, its session finished afterwards."""
    import tinker

    client = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
    yield client
    client.close("success").result()


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """One control plane for the session's API tests."""
    yield from running_lab(tmp_path_factory.mktemp("lab-home"))


@pytest.fixture(scope="session")
def service(lab):
    yield from sdk_client(lab)


def make_key(home: Path, user: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "openrl_lab.cli", "keys", "create", user, "--home", str(home)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def pytest_collection_modifyitems(config, items):
    """`cluster` tests run against the cluster $KUBECONFIG names (in $OPENRL_TEST_K8S_NAMESPACE), and are skipped,
    saying why, without one: none can run on this project's machines."""
    missing = [v for v in ("KUBECONFIG", "OPENRL_TEST_K8S_NAMESPACE") if not os.environ.get(v)]
    if not missing:
        return
    skip = pytest.mark.skip(
        reason=f"needs a real Kubernetes cluster: set {' and '.join(missing)} (without one only "
        "the offline layers ran: rendered manifests, schemas, an API emulator)"
    )
    for item in items:
        if item.get_closest_marker("cluster") is not None:  # not `in keywords`: tests/cluster is "cluster" too
            item.add_marker(skip)
