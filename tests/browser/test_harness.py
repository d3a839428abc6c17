"""The browser tests' harness cannot hang the suite (issue 25): a cell that raises fails the wait at once with its
traceback, and a wedged page fails its test before pytest-timeout fires, with a bounded teardown."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.browser.jupyterlab import REPO, CellError, LabUnderTest, NotebookPage, browser_processes


def _notebook(path: Path, sources: list[str], kernel: str = "python3") -> None:
    cells = [
        {"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [], "source": src}
        for i, src in enumerate(sources)
    ]
    meta = {"kernelspec": {"name": kernel, "display_name": kernel, "language": "python"}}
    path.write_text(json.dumps({"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}))


@pytest.fixture(scope="module")
def plain_lab(tmp_path_factory):
    """JupyterLab with a plain Python kernel and no control plane: the harness needs nothing more."""
    tmp = tmp_path_factory.mktemp("harness-lab")
    with LabUnderTest(tmp, tmp / "no-lab-home", copy_tutorials=False) as lab:
        yield lab


def test_a_cell_that_raises_fails_the_wait_at_once_with_its_traceback(plain_lab, page):
    _notebook(
        plain_lab.root / "raises.ipynb",
        ["x = 1", "def check():\n    assert x == 2, 'the injected check'\n\ncheck()", "import time\ntime.sleep(600)"],
    )
    nbp = NotebookPage(page, plain_lab, "raises.ipynb").open()
    t0 = time.monotonic()
    nbp.run_all()
    with pytest.raises(CellError) as failed:
        nbp.wait_for_cell(2, timeout=300_000)  # Run All stops at the error: cell 2 never runs
    took = time.monotonic() - t0
    assert took < 120, f"the error was noticed after {took:.0f} s, not at once"  # (the wait allowed 300 s)
    message = str(failed.value)
    assert "cell 1 of raises.ipynb raised" in message and "AssertionError: the injected check" in message, message
    assert "check()" in message, f"the traceback is in the failure: {message}"
    assert "\x1b[" not in message, "no terminal colour codes"


@pytest.mark.timeout(180)  # short, so that the 600 s wait below is cut to it (~120 s); room for a loaded machine
def test_a_wait_longer_than_the_test_has_left_ends_before_its_timeout(plain_lab, page):
    _notebook(plain_lab.root / "slow.ipynb", ["import time\ntime.sleep(600)"])
    nbp = NotebookPage(page, plain_lab, "slow.ipynb").open()
    nbp.run_cell(0)
    t0 = time.monotonic()
    with pytest.raises(CellError, match=re.escape("cell 0 of slow.ipynb had not finished after")):
        nbp.wait_for_cell(0, timeout=600_000)  # longer than the test's 180 s: cut to what is left, less teardown's
    assert time.monotonic() - t0 < 180
    nbp.command("kernelmenu:interrupt")


WEDGED = """
import time

import pytest

from tests.browser.conftest import chromium, page  # noqa: F401 - the fixtures under test


@pytest.mark.timeout({timeout})
def test_wedged(page):
    page.goto("data:text/html,<p>wedged</p>")
    page.evaluate("() => {{ setTimeout(() => {{ for (;;) {{}} }}, 0); }}")  # the renderer spins from now on
    time.sleep(0.5)
    page.evaluate("() => document.title")  # never answers: Playwright's evaluate has no timeout of its own


def test_after_it(page):  # the module's next test gets a working browser
    page.goto("data:text/html,<title>fine</title>")
    assert page.title() == "fine"
"""


def test_a_wedged_page_fails_its_test_before_the_timeout_and_the_run_goes_on(tmp_path):
    timeout = 75  # the page guard fires 45 s before it: 30 s into the test
    (tmp_path / "test_wedged_page.py").write_text(textwrap.dedent(WEDGED.format(timeout=timeout)))
    before = set(browser_processes())
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.harness",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            str(tmp_path / "test_wedged_page.py"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,  # bounded: a hang fails here
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "Chromium was killed shortly before the test's timeout" in out, out
    assert "Timeout >" not in out, f"pytest-timeout fired inside a Playwright call: {out}"
    assert set(browser_processes()) <= before, "no Chromium left behind"
