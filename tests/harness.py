"""The test harness, a pytest plugin loaded (by the root conftest.py) in every pytest run in this checkout: the
main suite, the tutorials under nbval, the vLLM and cookbook environments.

- Nothing outlives the run: every process a test starts carries `OPENRL_TEST_RUN_<token>=1` in its environment,
  and `tests/reaper.py`, a watchdog of its own, kills what is left when pytest ends, however it ends (SIGTERM,
  SIGINT, SIGKILL, a crash).
- The whole suite has a deadline (`OPENRL_TEST_DEADLINE`, seconds since the epoch; `make test` sets it): past it,
  the reaper says which test was running and where its threads were, and stops the run.
- `time_left()`: how long the running test has before pytest-timeout stops it, so that a test's own waits end
  first, with their own message (a timeout that fires inside a Playwright call leaves the browser unusable).
"""

from __future__ import annotations

import faulthandler
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.reaper import DEADLINE_VAR, TOKEN_PREFIX

_state: dict = {}  # run_dir, the pipe to the reaper, the running item and when it started


def pytest_configure(config: pytest.Config) -> None:
    # Kernels the tests start run torch on one thread unless a test says otherwise: seeded runs then follow the
    # same trajectory on every machine (a reduction split over threads sums in another order), and a loaded
    # machine slows a one-thread kernel down in proportion instead of ~10x (docs/benchmarks.md, tutorial checks)
    os.environ.setdefault("OPENRL_KERNEL_THREADS", "1")
    if not sys.platform.startswith("linux") or "run_dir" in _state:
        return
    run_dir = Path(tempfile.mkdtemp(prefix="openrl-test-run-"))
    token = secrets.token_hex(8)
    read_end, write_end = os.pipe()  # both close-on-exec: no child holds the write end open
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else _Nothing():  # the reaper writes to the real stderr
        reaper = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("reaper.py")), str(run_dir), token],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for pytest does not reach it
        )
    os.close(read_end)
    os.environ[TOKEN_PREFIX + token] = "1"  # after the reaper started: it must not carry the token itself
    stacks = open(run_dir / "stacks.txt", "w")  # noqa: SIM115 - open until the process ends, for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    _state.update(run_dir=run_dir, pipe=write_end, reaper=reaper, stacks=stacks, token=token)
    deadline = os.environ.get(DEADLINE_VAR)
    if deadline:
        left = float(deadline) - time.time()
        print(f"openrl-lab tests: {left / 60:.0f} min left of the suite's deadline", file=sys.stderr)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def pytest_unconfigure(config: pytest.Config) -> None:
    if "pipe" not in _state:
        return
    (_state["run_dir"] / "ended").write_text("")
    os.close(_state.pop("pipe"))  # EOF: the reaper sweeps what is left once this process has exited


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _state["item"], _state["started"] = item, time.monotonic()
    if "run_dir" in _state:
        (_state["run_dir"] / "current").write_text(item.nodeid)


def test_timeout(item: pytest.Item) -> float:
    """The pytest-timeout limit of `item` in seconds (inf when it has none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    else:
        try:
            value = item.config.getoption("timeout") or item.config.getini("timeout")
        except ValueError:  # pytest-timeout is not installed
            value = None
    return float(value) if value else math.inf


def time_left(reserve: float = 0.0) -> float:
    """Seconds before pytest-timeout stops the running test (its setup, call and teardown together), less
    `reserve`; inf outside a test or without a timeout. Never below 1."""
    item = _state.get("item")
    if item is None:
        return math.inf
    left = test_timeout(item) - (time.monotonic() - _state["started"]) - reserve
    return max(left, 1.0)
