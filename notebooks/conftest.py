"""Runs the tutorials under nbval against one control plane started for the whole session.

    .venv/bin/pytest -q --nbval-lax --nbval-current-env --nbval-cell-timeout=300 -p no:cacheprovider notebooks/

nbval starts a fresh Jupyter kernel for each notebook. The kernel inherits this process's environment
(jupyter_client copies os.environ when it launches a kernel), so the variables set here reach the
notebooks: `%openrl connect` and `find_connection()` find the lab through OPENRL_LAB_URL and
OPENRL_LAB_API_KEY.

The lab is not started by a fixture. nbval's cells are not pytest Functions, so they get no fixtures, and
each notebook's kernel starts in its collector's setup, before any fixture would run. Instead the lab
starts in `pytest_runtest_setup`, before the first notebook cell and its kernel. It is started only
when a notebook is actually run, so `pytest tests notebooks` starts no extra lab for the other tests. It
stops after the last notebook cell, or at the end of the session, and then the environment is restored.

A magic's mistake (`%openrl lease` on a taken name, `%openrl attach` of an unknown run) is a one-line
IPython UsageError. IPython prints it to stderr and sends no error message, so nbval alone would let the
cell pass. `pytest_runtest_call` below fails such a cell.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "TINKER_TELEMETRY", "OPENRL_LAB_HOME", "OPENRL_LAB_URL", "OPENRL_LAB_API_KEY")
_state: dict = {}


def _start_lab() -> None:
    from openrl_lab.server import LabServer

    _state["env"] = {k: os.environ.get(k) for k in _ENV}
    tmp = Path(tempfile.mkdtemp(prefix="openrl-lab-notebooks-"))
    _state["tmp"] = tmp
    os.environ["HF_HUB_OFFLINE"] = "1"  # no network: the built-in models are made locally
    os.environ["TINKER_TELEMETRY"] = "0"
    os.environ.setdefault("HF_HOME", str(tmp / "hf"))  # nothing written outside the temporary directory
    os.environ["OPENRL_LAB_HOME"] = str(tmp / "lab")
    server = LabServer(tmp / "lab").start()  # a child process; inherits the variables above
    _state["server"] = server
    os.environ["OPENRL_LAB_URL"] = server.base_url
    os.environ["OPENRL_LAB_API_KEY"] = server.api_key


def _stop_lab() -> None:
    server = _state.pop("server", None)
    if server is not None:
        server.stop()
    for k, v in _state.pop("env", {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tmp = _state.pop("tmp", None)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the first notebook cell (its kernel starts in the notebook's setup, which runs after this)."""
    if item.path.suffix != ".ipynb":
        return
    if "error" in _state:  # tried once already: fail fast rather than wait for a lab per cell
        raise RuntimeError(f"the notebooks' lab did not start: {_state['error']}")
    if "server" not in _state:
        try:
            _start_lab()
        except Exception as e:
            _state["error"] = f"{type(e).__name__}: {e}"
            raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last notebook cell (and its kernel's shutdown): stop the lab and restore the environment,
    so tests collected after the notebooks run as they would alone."""
    result = yield
    if item.path.suffix == ".ipynb" and (nextitem is None or nextitem.path.suffix != ".ipynb"):
        _stop_lab()
    return result


def pytest_sessionfinish(session, exitstatus):
    _stop_lab()  # interrupted runs (-x, Ctrl-C)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Fail a notebook cell whose output carries an IPython UsageError (on stderr, not as an error)."""
    result = yield
    for out in getattr(item, "test_outputs", None) or []:  # nbval's outputs of the cell just run
        if out.get("output_type") == "stream" and out.get("name") == "stderr":
            m = re.search(r"^UsageError: .*$", out.get("text", ""), re.M)
            if m:
                item.raise_cell_error("a magic failed (IPython printed a UsageError)", m.group(0))
    return result
