"""The doctor against a real lab: every check passes on a healthy one; a refused key, a lab that is not there,
a run whose sampler samples other weights, a user near or at the lease limit, a lease out of quota and a busy
group are each named, with the fix. The phase check leaves no lease behind. Also as `openrl-lab doctor`."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from openrl_lab.collapse import CollapseWarning
from openrl_lab.lab import Lab
from openrl_lab.lab.doctor import FAIL, OK, PHASE_TIMEOUT_S, SAMPLER_KL_LIMIT, SKIP, WARN, diagnose, render
from openrl_lab.lab.widgets.lease_panel import render_text
from openrl_lab.orchestrator import ResourceExhausted, TimeSliceOrchestratorClient
from openrl_lab.version import TESTED_SDKS
from tests.conftest import make_key, running_lab

pytestmark = pytest.mark.server  # starts a lab of its own: what other tests do to the session's is not its to judge

ROOT = Path(__file__).resolve().parents[2]
LEASE_LIMIT = 10  # the lab's max_leases_per_user: small, so a test reaches it with a few CreateLease calls


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    config = tmp_path_factory.mktemp("doctor-config") / "orchestrator.toml"
    config.write_text(f"max_leases_per_user = {LEASE_LIMIT}\n")  # groups: those found, as by default
    yield from running_lab(tmp_path_factory.mktemp("doctor-lab"), env={"OPENRL_LAB_ORCHESTRATOR_CONFIG": str(config)})


def orchestrator(lab, key: str, job: str = "test") -> TimeSliceOrchestratorClient:
    return TimeSliceOrchestratorClient(lab.grpc_target, api_key=key, job=job, retry_timeout_s=10)


def leases_of(lab, key: str) -> set[tuple[str, str]]:
    """The user's open orchestrator leases, as (group, name), asked through a client of its own."""
    with orchestrator(lab, key) as c:
        return {(lease.group_id, lease.name) for lease in c.leases()}


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_healthy_lab_passes_every_check(lab):
    before = leases_of(lab, lab.api_key)
    checks = by_name(diagnose(lab.base_url, api_key=lab.api_key))
    assert leases_of(lab, lab.api_key) == before  # the phase check closed its lease
    assert list(checks) == [
        "http",
        "key",
        "version",
        "sdk",
        "wire",
        "clock",
        "grpc",
        "lane",
        "rights",
        "tokenizer",
        "kernels",
        "sandbox",
        "runs",
        "phase",
    ]
    assert {n: c.status for n, c in checks.items() if c.status != OK} == {}, render(list(checks.values()))
    assert "accepted: user" in checks["key"].detail
    assert "protobuf both ways" in checks["wire"].detail
    assert re.search(r"reachable \(hand-offs take it\)", checks["lane"].detail)  # the orchestrator is on this machine
    assert "default" in checks["grpc"].detail and "up (default" in checks["kernels"].detail
    assert re.fullmatch(
        rf"user 'local': {len(before)} orchestrator leases open of at most {LEASE_LIMIT}", checks["rights"].detail
    )
    assert re.fullmatch(
        r"group 'default': waited \d+ ms; acquire to release \d+ ms \(lease doctor-.+-\d+, closed again\)",
        checks["phase"].detail,
    )
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


def test_a_collapsing_run_is_warned_of_in_the_notebook_listed_by_the_lab_and_by_the_doctor(lab):
    client = Lab.connect(lab.base_url, api_key=lab.api_key, home=lab.home)
    run = client.lease("doctor-collapse", rank=2)
    for step in range(12):  # exploring: high entropy
        run.log(step, reward=0.3, entropy=1.0)
    run.flush()
    row = next(r for r in client.status() if r["name"] == "doctor-collapse")
    assert row["collapse_since"] is None

    def falling():  # sure of itself while the reward falls to zero
        for step in range(12, 40):
            run.log(step, reward=max(0.3 - (step - 11) * 0.03, 0.0), entropy=0.05)

    with pytest.warns(CollapseWarning, match=r"doctor-collapse: step \d+: the policy is collapsing: entropy 0.05"):
        falling()
    run.flush()
    row = next(r for r in client.status() if r["name"] == "doctor-collapse")
    since = row["collapse_since"]
    assert isinstance(since, int) and 12 < since < 40
    assert f"(collapse since step {since})" in render_text([row])  # `%openrl status`
    assert run.history().loc[lambda h: h["step"] == since, "collapse"].item() == 1.0
    runs = by_name(diagnose(lab.base_url, api_key=lab.api_key))["runs"]
    assert runs.status == WARN and f"doctor-collapse since step {since}" in runs.detail
    assert "lower learning rate" in runs.fix
    client.release("doctor-collapse")
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
    assert len(checks) == 14 and {c.status for c in checks[1:]} == {SKIP}


def test_the_command_line_doctor_exits_1_on_a_failure(lab):
    cmd = [sys.executable, "-m", "openrl_lab.cli", "doctor", lab.base_url]
    ok = subprocess.run([*cmd, "--key", lab.api_key], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "checks passed" in ok.stdout and ok.stdout.count("\n") == 15
    bad = subprocess.run([*cmd, "--key", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "FAIL key" in bad.stdout


def test_the_tested_sdks_are_the_ones_the_suite_runs():
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^SDK_VERSIONS \?= (.+)$", makefile, re.M).group(1).split()
    pinned = re.search(r'"tinker==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert (*listed, pinned) == TESTED_SDKS


def test_a_user_near_and_at_the_lease_limit_is_warned_then_failed_with_what_to_close(lab):
    key = make_key(lab.home, "crowded")
    with orchestrator(lab, key) as c:
        for i in range(LEASE_LIMIT - 1):
            c.lease("default", f"job-{i}")
        checks = by_name(diagnose(lab.base_url, api_key=key))
        rights = checks["rights"]
        assert rights.status == WARN, rights.line()
        assert rights.detail == (
            f"user 'crowded': {LEASE_LIMIT - 1} orchestrator leases open of at most {LEASE_LIMIT}: "
            "1 more and new ones are refused"
        )
        assert rights.fix.startswith("close leases you no longer use: TimeSliceOrchestratorClient(...).close_lease(")
        assert "job-0 (default), job-1 (default), job-2 (default) and 6 more" in rights.fix
        assert checks["phase"].status == OK  # its own lease was the tenth, and it closed it again
        c.lease("default", f"job-{LEASE_LIMIT - 1}")
        checks = by_name(diagnose(lab.base_url, api_key=key))
        rights, phase = checks["rights"], checks["phase"]
        assert rights.status == FAIL, rights.line()
        assert "at the limit: every new lease is refused (a new run, a new job)" in rights.detail
        assert rights.fix.startswith("close leases: TimeSliceOrchestratorClient(...).close_lease(GROUP, NAME) for")
        assert (phase.status, phase.detail) == (SKIP, "the rights check failed: a lease of its own would be refused")
        with pytest.raises(ResourceExhausted, match=f"the limit is {LEASE_LIMIT}"):  # what the doctor said
            c.lease("default", "one-more")
        assert render(list(checks.values())).endswith(f"doctor: 1 failed, 0 warned of {len(checks)} checks")
        for i in range(LEASE_LIMIT):
            c.close_lease("default", f"job-{i}")
    assert by_name(diagnose(lab.base_url, api_key=key))["rights"].status == OK
    assert leases_of(lab, key) == set()


def test_a_lease_out_of_quota_is_named_with_how_to_raise_it(lab):
    key = make_key(lab.home, "capped")
    with orchestrator(lab, key) as c:
        c.lease("default", "capped-job", quota_s=0.2)
        s = c.acquire("default", lease="capped-job", timeout=60)  # liveness bound: the group is idle
        time.sleep(0.3)  # used_s counts the slice's time held: at least this
        c.release(s)
        rights = by_name(diagnose(lab.base_url, api_key=key))["rights"]
        assert rights.status == WARN, rights.line()
        assert re.search(r"lease capped-job \(default\) has used up its quota \(0\.\d of 0\.2 s\)", rights.detail)
        assert rights.fix.startswith(
            "capped-job: reattach it with a larger quota (TimeSliceOrchestratorClient(...).lease('default', "
            "'capped-job', quota_s=...)) or close it (.close_lease('default', 'capped-job'))"
        )
        c.lease("default", "capped-job", quota_s=100)  # the fix, done
        assert by_name(diagnose(lab.base_url, api_key=key))["rights"].status == OK
        c.close_lease("default", "capped-job")


def test_a_busy_group_is_a_phase_warning_naming_who_holds_and_waits_and_leaves_no_lease(lab):
    holder = orchestrator(lab, make_key(lab.home, "hogger"), job="hog")
    waiter = orchestrator(lab, lab.api_key, job="queued")
    waited = []
    thread = threading.Thread(target=lambda: waited.append(waiter.release(waiter.acquire("default", timeout=120))))
    held = holder.acquire("default", kind="hog", timeout=60)  # liveness bound: the group frees in seconds
    try:
        waiter.lease("default")
        thread.start()
        deadline = time.monotonic() + 60  # liveness: the waiter's acquire reaches the queue
        while not holder.get_status("default").queue and time.monotonic() < deadline:
            time.sleep(0.05)
        before = leases_of(lab, lab.api_key)
        assert ("default", "queued") in before
        checks = by_name(diagnose(lab.base_url, api_key=lab.api_key))
        phase = checks["phase"]
        assert phase.status == WARN, phase.line()
        assert phase.detail == (
            f"group 'default' is busy: no slice within {PHASE_TIMEOUT_S:g} s "
            "(held by another user's job, 1 waiting (yours: queued))"
        )
        assert "%openrl top shows the group's holder and queue" in phase.fix
        assert {c.status for c in checks.values()} == {OK, WARN}, render(list(checks.values()))
        assert leases_of(lab, lab.api_key) == before  # the doctor's own lease was closed
        assert not waited  # the holder held the group throughout
    finally:
        holder.release(held)
        if thread.is_alive():
            thread.join(60)
        holder.close_lease("default")
        waiter.close_lease("default")
        holder.close()
        waiter.close()
    assert len(waited) == 1  # the waiter got its slice once the holder let go
