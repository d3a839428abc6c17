"""The sandbox server on its own (`openrl-lab sandbox serve`, what the chart's sandbox Pods run) and a lab that
forwards to it (OPENRL_SANDBOX_REMOTE_URL), over real HTTP on loopback: programs run through the lab, the status
names the remote, the service token is required, a stopped server is a SandboxError naming it while the lab keeps
serving, and the per-user accounting stays in the lab. The server here uses bubblewrap, as this host has it; the
Pods' `pod` isolation is tested at the end, forced on outside a Pod. No cluster runs here (tests/deploy/chart.py):
gVisor and the NetworkPolicy are checked only as rendered objects (tests/deploy/test_chart.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from openrl_lab.lab import Lab
from openrl_lab.sandbox import isolation
from openrl_lab.sandbox.isolation import Limits
from openrl_lab.sandbox.pool import SandboxPool
from openrl_lab.server import LabServer
from tests.conftest import make_key, running_lab

pytestmark = pytest.mark.server
TOKEN = "orl-sandbox-" + "t" * 43


class SandboxServer:
    """`openrl-lab sandbox serve` as a child process on loopback; `port` 0: a free one (read from its first line)."""

    def __init__(self, token_file: Path, env: dict[str, str] | None = None, port: int = 0):
        self.token_file, self.env, self.port = token_file, env or {}, port
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> SandboxServer:
        argv = [sys.executable, "-m", "openrl_lab.cli", "sandbox", "serve", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*argv, "--token-file", str(self.token_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **self.env},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the first line, once bound (the host check runs first: seconds)
        if not line.startswith("sandbox server: http://"):
            self.stop()
            raise AssertionError(f"the sandbox server did not start: {line!r} {self.stderr()}")
        self.url = line.split()[2]
        self.port = int(self.url.rsplit(":", 1)[1])
        return self

    def stderr(self) -> str:
        assert self.proc is not None and self.proc.stderr is not None
        return self.proc.stderr.read() if self.proc.poll() is not None else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sandbox-token") / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def sandbox_server(token_file):
    server = SandboxServer(token_file).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def remote_lab(tmp_path_factory, sandbox_server, token_file):
    env = {"OPENRL_SANDBOX_REMOTE_URL": sandbox_server.url, "OPENRL_SANDBOX_REMOTE_TOKEN_FILE": str(token_file)}
    yield from running_lab(tmp_path_factory.mktemp("remote-lab-home"), env=env)


@pytest.fixture(scope="module")
def alice(remote_lab):
    client = Lab.connect(remote_lab.base_url, api_key=remote_lab.api_key, home=remote_lab.home)
    yield client
    client.close()


def test_programs_run_on_the_remote_server_and_the_status_names_it(remote_lab, alice, sandbox_server):
    r = alice.sandbox.run("import sys; print(sys.stdin.read().upper())", stdin="through the lab")
    assert (r.status, r.stdout) == ("Success", "THROUGH THE LAB\n")
    failed = alice.sandbox.run("raise SystemExit(3)")
    assert failed.status == "Failed" and failed.return_code == 3
    slow = alice.sandbox.run("while True: pass", timeout=1)
    assert slow.status == "Failed" and slow.timed_out
    status = alice.sandbox.status()
    assert status["available"] and status["remote"] == sandbox_server.url
    assert "bubblewrap" in status["isolation"]  # the remote's isolation, not the lab host's
    assert status["pool"]["finished"] >= 3  # the remote pool's own counters


def test_the_sandbox_server_wants_its_service_token(sandbox_server):
    body = {"code": "print(1)"}
    for headers, why in (
        ({}, "missing service token"),
        ({"Authorization": "Bearer not-the-token"}, "wrong service token"),
        ({"Authorization": f"Basic {TOKEN}"}, "not `Bearer <token>`"),
        ({"X-API-Key": TOKEN}, "missing service token"),
    ):
        r = httpx.post(f"{sandbox_server.url}/sandbox/run_code", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and why in r.json()["detail"], (headers, r.text)
        r = httpx.get(f"{sandbox_server.url}/sandbox/status", headers=headers, timeout=30)
        assert r.status_code == 401, headers
    ok = httpx.post(
        f"{sandbox_server.url}/sandbox/run_code",
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    assert ok.status_code == 200 and ok.json()["run_result"]["stdout"] == "1\n"
    assert httpx.get(f"{sandbox_server.url}/healthz", timeout=30).status_code == 200  # probes need no token


def test_a_wrong_token_in_the_lab_is_a_sandbox_error_naming_the_refusal(tmp_path, sandbox_server):
    wrong = tmp_path / "token"
    wrong.write_text("orl-sandbox-wrong")
    env = {"OPENRL_SANDBOX_REMOTE_URL": sandbox_server.url, "OPENRL_SANDBOX_REMOTE_TOKEN_FILE": str(wrong)}
    with LabServer(tmp_path / "home", env=env) as lab:
        client = Lab.connect(lab.base_url, api_key=lab.api_key, home=lab.home)
        try:
            r = client.sandbox.run("print(1)")
            assert r.status == "SandboxError" and sandbox_server.url in r.message and "HTTP 401" in r.message
            assert "wrong service token" in r.message
        finally:
            client.close()


def test_a_stopped_server_is_a_sandbox_error_naming_it_and_the_lab_keeps_serving(remote_lab, alice, sandbox_server):
    sandbox_server.stop()
    try:
        r = alice.sandbox.run("print(1)")
        assert r.status == "SandboxError" and sandbox_server.url in r.message and "cannot be reached" in r.message
        status = alice.sandbox.status()
        assert not status["available"] and sandbox_server.url in status["unavailable"]
        assert httpx.get(f"{remote_lab.base_url}/api/v1/healthz", timeout=30).status_code == 200
    finally:
        sandbox_server.start()  # the same port again: the lab's URL holds
    deadline = time.monotonic() + 60  # liveness: the first run after a restart waits for a warm sandbox
    while (r := alice.sandbox.run("print(2)")).status != "Success" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert r.stdout == "2\n", r


def test_per_user_accounting_stays_in_the_lab(remote_lab, alice):
    bob = Lab.connect(remote_lab.base_url, api_key=make_key(remote_lab.home, "bob-remote"))
    try:
        before = alice.sandbox.status()["you"]["runs"]
        results = bob.sandbox.run_many(["print(1)", "raise SystemExit(1)", "print(3)"])
        assert [r.status for r in results] == ["Success", "Failed", "Success"]
        mine, theirs = alice.sandbox.status(), bob.sandbox.status()
        assert theirs["you"]["runs"] == 3 and theirs["you"]["outcomes"]["failed"] == 1
        assert mine["you"]["runs"] == before  # bob's runs are his, counted by the lab, not the server
        assert theirs["limits"]["per_user"] >= 1
        text = httpx.get(f"{remote_lab.base_url}/metrics", timeout=30).text
        assert 'openrl_sandbox_executions_total{outcome="failed"}' in text
    finally:
        bob.close()


# --- pod isolation (what the chart's sandbox Pods use), forced on outside a Pod ---------------------------------
def test_pod_isolation_refuses_to_start_outside_a_pod_unless_forced(token_file):
    env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "OPENRL_SANDBOX_POD_FORCE")}
    argv = [sys.executable, "-m", "openrl_lab.cli", "sandbox", "serve", "--port", "0", "--token-file", str(token_file)]
    out = subprocess.run(
        argv, env={**env, "OPENRL_SANDBOX_ISOLATION": "pod"}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0 and "this is not a Pod" in out.stderr and "OPENRL_SANDBOX_POD_FORCE=1" in out.stderr


def test_pod_isolation_forced_runs_programs_with_their_limits_each_in_a_scratch_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENRL_SANDBOX_ISOLATION", "pod")
    monkeypatch.setenv("OPENRL_SANDBOX_POD_FORCE", "1")
    monkeypatch.setenv("OPENRL_SANDBOX_SCRATCH_DIR", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    isolation._pod_host.cache_clear()
    line = isolation.check_host()
    assert line.startswith("pod isolation, FORCED outside a Pod") and "relies on the Pod's runtime (gVisor" in line
    assert "NetworkPolicy and no service account token" in line and "seccomp-bpf" in line

    async def runs():
        pool = SandboxPool(2)
        try:
            limits = Limits(wall_s=2, cpu_s=3, memory_bytes=256 << 20)
            secret = await pool.run("import os; open('secret', 'w').write('x'); print(os.getcwd())", limits=limits)
            peek = "import os; print(os.listdir(os.path.dirname(os.getcwd()))); print(open(%r).read())"
            scratch = secret.stdout.strip()
            other = await pool.run(peek % os.path.join(scratch, "secret"), limits=limits)
            bomb = await pool.run("x = bytearray(1 << 30)", limits=limits)
            loop = await pool.run("while True: pass", limits=limits)
            escape = await pool.run("import os; os.setsid()", limits=limits)
            return secret, scratch, other, bomb, loop, escape
        finally:
            await pool.aclose()

    secret, scratch, other, bomb, loop, escape = asyncio.run(runs())
    assert secret.status == "Finished" and scratch.startswith(str(tmp_path) + "/")
    # single-use: the first program's scratch is gone before the next runs, and only this one's own is there
    assert not os.path.exists(scratch) and os.path.basename(scratch) not in other.stdout
    assert other.return_code == 1 and "FileNotFoundError" in other.stderr
    assert bomb.return_code == 1 and "MemoryError" in bomb.stderr  # RLIMIT_AS
    assert loop.status == "TimeLimitExceeded"
    assert escape.return_code == 1 and "PermissionError" in escape.stderr  # setsid refused: the group holds all
    assert os.listdir(tmp_path / f"openrl-sandbox-{os.getuid()}") == []  # nothing left behind
    isolation._pod_host.cache_clear()
