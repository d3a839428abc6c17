"""The suite's tiers, a pytest plugin (`-p tests.tiers`): every test is `fast` unless it starts something.

- `fast`: set here at collection on every test that starts no process, server, browser or kernel; `make test-fast`
  runs them (`pytest -m fast`). Nobody writes `fast` by hand: a new test is fast until it uses a fixture that
  starts something or carries `server`.
- `server`: the test starts a process or a server itself (a subprocess, a LabServer, a gRPC or HTTP server, even
  in this process on loopback, a Jupyter server or kernel). Tests that reach one through a fixture need no mark:
  every fixture in SERVER_FIXTURES, and every fixture that depends on one (the closure pytest computes), makes
  its tests `server`-tier by itself.
- `slow`: starts nothing but takes long (tens of seconds); its reason says why. Not in the fast tier.
- `cuda` and `cluster` tests are never fast (a device, a real cluster), nor is anything in tests/browser/.

The guard keeps the tier honest: in a fast run (`-m fast`, or OPENRL_TEST_TIER=fast, which `make test-fast`
sets), a fast test that starts a subprocess, forks, binds a listening socket or makes a gRPC server fails,
saying "this test starts a process/server: mark it `server`". It is recorded even when the test catches the
error, and it covers the test's fixtures too (their setup and teardown run inside the guarded protocol).
"""

from __future__ import annotations

import multiprocessing.process
import os
import re
import socket
import subprocess
import sys
import traceback

import pytest

# Fixtures that start a process or a server (their dependants are covered through pytest's fixture closure).
SERVER_FIXTURES = frozenset(
    {
        # tests/conftest.py: a real `openrl-lab serve` (gateway, kernel, orchestrator processes) and its client
        "lab",
        "service",
        # tests/recipes/conftest.py
        "recipes_lab",
        # tests/orchestrator/conftest.py: the orchestrator's gRPC service in this process, on loopback
        "orch",
        "make_client",
        # tests/browser/conftest.py: a control plane, JupyterLab, Chromium
        "control_plane",
        "jupyter_lab",
        "chromium",
        "page",
        "notebook",
        # pytest-jupyter (and pytest-tornasync under it): an in-process jupyter_server on loopback, kernels
        "jp_configurable_serverapp",
        "jp_serverapp",
        "jp_web_app",
        "jp_fetch",
        "jp_ws_fetch",
        "send_request",
        "jp_start_kernel",
        "http_server",
        "http_server_client",
        "http_server_port",
        "jp_http_port",
    }
)
NOT_FAST_MARKS = ("server", "slow", "cuda", "cluster")
SERVER_DIRS = ("tests/browser/",)  # every test there drives Chromium (or the harness around it)
TIER_VAR = "OPENRL_TEST_TIER"

MARKERS = [
    "fast: starts no process, server, browser or kernel (set by tests/tiers.py, never by hand; `make test-fast`)",
    "server: starts a process or a server itself (subprocess, LabServer, gRPC/HTTP/Jupyter server, kernel)",
    "slow(reason): starts nothing but takes tens of seconds; not in the fast tier",
]


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:  # pyproject.toml lists them too; this keeps `-p tests.tiers` self-contained
        config.addinivalue_line("markers", line)


def starts_something(item: pytest.Item) -> str | None:
    """Why `item` is not fast (a fixture or a mark), or None."""
    for mark in NOT_FAST_MARKS:
        if item.get_closest_marker(mark) is not None:
            return f"marked {mark}"
    if item.nodeid.startswith(SERVER_DIRS):
        return f"in {item.nodeid.split('::')[0].rsplit('/', 1)[0]}/"
    used = SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if used:
        return f"uses the fixture {sorted(used)[0]}"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marks must be there when it looks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if starts_something(item) is None:
            item.add_marker(pytest.mark.fast)


def _guard_on(config: pytest.Config) -> bool:
    if os.environ.get(TIER_VAR) == "fast":
        return True
    expr = config.getoption("markexpr", "") or ""
    return re.search(r"(?<!not )\bfast\b", expr) is not None


class StartsAServer(RuntimeError):
    pass


MESSAGE = "this test starts a process/server: mark it `server` (or use a fixture of tests/tiers.py SERVER_FIXTURES)"


class _Guard:
    """Patches what starts processes and servers while one fast test (with its fixtures) runs."""

    def __init__(self):
        self.seen: list[str] = []
        self._undo: list = []

    def _refuse(self, what: str):
        where = "".join(traceback.format_stack(limit=8)[:-2])
        self.seen.append(f"{what}\n{where}")
        raise StartsAServer(f"{MESSAGE}: it {what}")

    def _patch(self, owner, name: str, what: str) -> None:
        if not hasattr(owner, name):
            return
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        guard = self

        def refused(*args, **kwargs):
            guard._refuse(what)

        setattr(owner, name, refused)
        self._undo.append((owner, name, original))

    def __enter__(self):
        self._patch(subprocess.Popen, "__init__", "started a subprocess")
        self._patch(os, "fork", "forked")
        self._patch(os, "forkpty", "forked")
        self._patch(os, "posix_spawn", "spawned a process")
        self._patch(os, "posix_spawnp", "spawned a process")
        self._patch(os, "system", "started a shell")
        self._patch(multiprocessing.process.BaseProcess, "start", "started a multiprocessing process")
        self._patch(socket.socket, "listen", "bound a listening socket")
        try:
            import grpc
            import grpc.aio
        except ImportError:
            pass
        else:
            self._patch(grpc, "server", "made a gRPC server")
            self._patch(grpc.aio, "server", "made a gRPC server")
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._undo):
            if original is None:  # inherited (socket.socket.listen comes from _socket.socket)
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()


_GUARDS: dict[str, _Guard] = {}

# The test process's torch runs on one thread (OPENRL_TEST_TORCH_THREADS to change it). The in-process models are
# tiny: a second intra-op thread buys nothing, and on a shared 2-core machine the two spin against each other and
# everything else (tests/train/test_trainer.py's resume tests: 41 s with torch's default of 2 threads at load 7, 4.7 s
# with 1). Set before every test, since a test may set it (the kernel's own thread rule); torch is not imported for
# it. Processes the tests start are not affected (no environment variable is set).
TORCH_THREADS_VAR = "OPENRL_TEST_TORCH_THREADS"


def pytest_runtest_setup(item: pytest.Item) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "set_num_threads"):
        return
    n = int(os.environ.get(TORCH_THREADS_VAR) or 1)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    if item.get_closest_marker("fast") is None or not _guard_on(item.config):
        yield
        return
    guard = _GUARDS[item.nodeid] = _Guard()
    with guard:
        yield
    _GUARDS.pop(item.nodeid, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    guard = _GUARDS.get(item.nodeid)
    if guard is None or not guard.seen:
        return
    if report.when != "teardown":
        if report.failed and MESSAGE in str(report.longrepr):  # the test failed on it: its error says so
            guard.seen.clear()
        return  # else (caught, or raised in another thread) the teardown says so
    # Recorded even if the test caught StartsAServer: the teardown report fails, saying what and where.
    report.outcome = "failed"
    report.longrepr = f"{MESSAGE}:\n" + "\n".join(guard.seen)
    guard.seen.clear()
