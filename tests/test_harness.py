"""The suite's harness (tests/harness.py, tests/reaper.py), tested by stopping real pytest runs (issue 25): a run
stopped by SIGTERM, SIGINT or SIGKILL leaves no process behind (a real control plane and its kernel, and a process
that put itself in a session of its own), and a run past the suite's deadline ends with a message naming the test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.processes import alive, describe, live_children

pytestmark = pytest.mark.server  # runs pytest in subprocesses and stops them

REPO = Path(__file__).resolve().parents[1]

VICTIM = """
import json, os, subprocess, sys, time
from pathlib import Path

from openrl_lab.server import LabServer


def test_victim(tmp_path):
    # a process that leaves pytest's session and process group, as JupyterLab's kernels do
    loner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"], start_new_session=True)
    with LabServer(tmp_path / "home") as lab:  # `openrl-lab serve`, its kernel and orchestrator
        Path(os.environ["VICTIM_OUT"]).write_text(json.dumps({{"loner": loner.pid, "serve": lab.proc.pid}}))
        time.sleep({sleep})
"""


def _run(tmp_path: Path, body: str, **env) -> subprocess.Popen:
    """The victim pytest run; its output goes to `victim.log` (a pipe nobody reads while it runs could fill and
    block it, and every process it starts inherits the write end)."""
    (tmp_path / "test_victim.py").write_text(textwrap.dedent(body))
    log = open(tmp_path / "victim.log", "w")  # noqa: SIM115 - the child holds it; closed here once it is handed over
    try:
        return _popen(tmp_path, log, env)
    finally:
        log.close()


def _output(tmp_path: Path) -> str:
    return (tmp_path / "victim.log").read_text(errors="replace")


def _hung(victim: subprocess.Popen, tmp_path: Path, what: str) -> str:
    """Why a victim did not end: its threads' stacks (the harness's faulthandler dumps them on SIGUSR1 into its
    run directory's stacks.txt) and the end of its output."""
    stacks = ""
    try:
        files = [f.path for f in psutil.Process(victim.pid).open_files() if f.path.endswith("stacks.txt")]
        victim.send_signal(signal.SIGUSR1)
        time.sleep(1)
        stacks = "".join(Path(f).read_text(errors="replace") for f in files)
    except (psutil.Error, OSError) as e:
        stacks = f"(no stacks: {e})"
    return f"{what}\n--- its threads:\n{stacks[-6000:]}\n--- its output:\n{_output(tmp_path)[-3000:]}"


# pytest as a person runs it in a terminal, where Ctrl-C interrupts it. A run started in the background of a
# non-interactive shell (`make test &`, a CI script's `cmd &`) inherits SIGINT ignored, and Python then installs no
# handler for it: the victim slept through its SIGINT (found by its stacks after a 180 s timeout, twice).
_AS_IN_A_TERMINAL = (
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.exit(pytest.console_main())"
)


def _popen(tmp_path: Path, log, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            _AS_IN_A_TERMINAL,
            "-q",
            "-s",
            "-p",
            "tests.harness",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_victim.py"),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"the victim run ended first:\n{_output(path.parent)}")
        assert time.monotonic() < deadline, "the victim run did not start its servers"
        time.sleep(0.2)
    return json.loads(path.read_text())


def _gone(pids: list[int], timeout: float) -> list[str]:
    """What is still alive of `pids` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return [describe(p) for p in left]
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_a_stopped_run_leaves_nothing_behind(tmp_path, sig):
    out = tmp_path / "pids.json"
    victim = _run(tmp_path, VICTIM.format(sleep=900), VICTIM_OUT=str(out))
    try:
        pids = _wait_for_file(out, victim)
        everything = [p.pid for p in psutil.Process(victim.pid).children(recursive=True)] + [pids["loner"]]
        kernel = [p for p, cmd in live_children(pids["serve"], recursive=True) if "kernel" in " ".join(cmd)]
        assert kernel, "the control plane started its kernel"
        victim.send_signal(sig)
        # 11-15 s here; once over 60 s with two other suites on the same 2 cores (LabServer.stop alone may wait 20 s
        # for serve before it kills it): a bound for a hang, not a speed test
        try:
            victim.wait(180)
        except subprocess.TimeoutExpired:
            raise AssertionError(_hung(victim, tmp_path, f"pytest did not end within 180 s of {sig.name}")) from None
        left = _gone(everything, timeout=30)
        assert not left, f"still running after pytest got {sig.name}: {left}"
        if sig != signal.SIGINT:  # (SIGINT: pytest's own teardown stops the lab; the reaper only the loner)
            assert "processes, killed now" in _output(tmp_path)
    finally:
        if victim.poll() is None:
            victim.kill()


def test_a_run_past_the_suites_deadline_ends_naming_the_test_and_its_stack(tmp_path):
    body = """
    import os, subprocess, sys, time
    from pathlib import Path

    def test_sleeps_past_the_deadline():
        loner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"], start_new_session=True)
        Path(os.environ["VICTIM_OUT"]).write_text(str(loner.pid))
        time.sleep(900)
    """
    out = tmp_path / "pid"
    victim = _run(
        tmp_path, body, VICTIM_OUT=str(out), OPENRL_TEST_DEADLINE=str(time.time() + 30), OPENRL_TEST_BUDGET_MIN="0.1"
    )
    try:
        victim.wait(150)  # bounded: the deadline is 30 s away
    finally:
        if victim.poll() is None:
            victim.kill()
    text = _output(tmp_path)
    assert victim.returncode != 0
    assert "went past the suite's deadline (0.1 min" in text, text
    assert "test_victim.py::test_sleeps_past_the_deadline" in text, text
    assert 'File "' in text and "test_sleeps_past_the_deadline" in text.split("Its threads were at")[1], text
    assert not _gone([int(out.read_text())], timeout=15), "the test's own process was stopped too"
