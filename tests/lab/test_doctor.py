"""The doctor against a real lab: every check passes on a healthy one; a refused key, a lab that is not there and
a run whose sampler samples other weights are each named, with the fix. Also as `openrl-lab doctor`."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from openrl_lab.lab import Lab
from openrl_lab.lab.doctor import FAIL, OK, SAMPLER_KL_LIMIT, SKIP, WARN, diagnose, render
from openrl_lab.version import TESTED_SDKS
from tests.conftest import running_lab

pytestmark = pytest.mark.server  # starts a lab of its own: what other tests do to the session's is not its to judge

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from running_lab(tmp_path_factory.mktemp("doctor-lab"))


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_healthy_lab_passes_every_check(lab):
    checks = by_name(diagnose(lab.base_url, api_key=lab.api_key))
    assert list(checks) == [
        "http",
        "key",
        "version",
        "sdk",
        "wire",
        "clock",
        "grpc",
        "lane",
        "tokenizer",
        "kernels",
        "runs",
    ]
    assert {n: c.status for n, c in checks.items() if c.status != OK} == {}, render(list(checks.values()))
    assert "accepted: user" in checks["key"].detail
    assert "protobuf both ways" in checks["wire"].detail
    assert re.search(r"reachable \(hand-offs take it\)", checks["lane"].detail)  # the orchestrator is on this machine
    assert "default" in checks["grpc"].detail and "up (default" in checks["kernels"].detail
    assert render(list(checks.values())).endswith(f"doctor: all {len(checks)} checks passed")


def test_a_run_whose_sampler_is_on_other_weights_is_flagged(lab):
    client = Lab.connect(lab.base_url, api_key=lab.api_key, home=lab.home)
    run = client.lease("doctor-off", rank=2)
    run.log(0, sampler_kl=1e-8)
    run.flush()
    assert by_name(diagnose(lab.base_url, api_key=lab.api_key))["runs"].status == OK
    run.log(1, sampler_kl=SAMPLER_KL_LIMIT * 30)
    run.flush()
    runs = by_name(diagnose(lab.base_url, api_key=lab.api_key))["runs"]
    assert runs.status == WARN and "doctor-off sampler_kl 0.3" in runs.detail
    assert "save_weights_and_get_sampling_client() after each optim_step" in runs.fix
    client.release("doctor-off")
    client.close()


def test_a_refused_key_and_a_missing_lab_are_named_and_the_rest_skipped(lab):
    checks = diagnose(lab.base_url, api_key="not-a-key")
    assert (checks[0].status, checks[1].status) == (OK, FAIL)
    assert "the key was refused (401)" in checks[1].detail and "keys create" in checks[1].fix
    assert {c.status for c in checks[2:]} == {SKIP}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    checks = diagnose(f"http://127.0.0.1:{port}", api_key="k", timeout_s=2)
    assert checks[0].status == FAIL and "no answer from" in checks[0].detail and "openrl-lab serve" in checks[0].fix
    assert len(checks) == 11 and {c.status for c in checks[1:]} == {SKIP}


def test_the_command_line_doctor_exits_1_on_a_failure(lab):
    cmd = [sys.executable, "-m", "openrl_lab.cli", "doctor", lab.base_url]
    ok = subprocess.run([*cmd, "--key", lab.api_key], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "checks passed" in ok.stdout and ok.stdout.count("\n") == 12
    bad = subprocess.run([*cmd, "--key", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "FAIL key" in bad.stdout


def test_the_tested_sdks_are_the_ones_the_suite_runs():
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^SDK_VERSIONS \?= (.+)$", makefile, re.M).group(1).split()
    pinned = re.search(r'"tinker==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert (*listed, pinned) == TESTED_SDKS
