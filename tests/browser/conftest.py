"""Fixtures for the browser tests: one control plane and one JupyterLab per module, one Chromium per module
(launched again if the harness had to kill it), a fresh browser context (no cookies, no storage) per test.

No browser test can hang the suite: each test's page is guarded by a timer that kills Chromium shortly before the
test's own timeout (a Playwright call on a wedged page then raises at once, and the failure says why), and the
teardown's `context.close()` is bounded the same way."""

from __future__ import annotations

import contextlib

import pytest

from tests.browser.jupyterlab import LabUnderTest, NotebookPage, killed_after, launch_chromium
from tests.conftest import running_lab
from tests.harness import time_left

TEARDOWN_S = 20  # what closing a context may take before its browser is killed
RESERVE_S = 45  # the page guard fires this long before the test's timeout: teardown still fits


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    yield from running_lab(tmp_path_factory.mktemp("browser-lab"))


@pytest.fixture(scope="module")
def jupyter_lab(control_plane, tmp_path_factory):
    with LabUnderTest(tmp_path_factory.mktemp("jupyterlab"), control_plane.home) as lab:
        yield lab


class Chromium:
    """The module's browser: `new_context()` as on a Playwright Browser, with the browser launched again if the
    harness killed the last one (the tests after a wedged one still get a browser)."""

    def __init__(self, playwright):
        self._playwright = playwright
        self._browser = launch_chromium(playwright)

    def new_context(self, **kw):
        if not self._browser.is_connected():
            self._browser = launch_chromium(self._playwright)
        return self._browser.new_context(**kw)

    def close(self) -> None:
        # already gone (killed by a guard): nothing to close, whatever Playwright raises for it
        with killed_after(TEARDOWN_S, "closing Chromium"), contextlib.suppress(Exception):
            self._browser.close()


@pytest.fixture(scope="module")  # not the session: Playwright's loop must not outlive this folder's tests
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = Chromium(p)
        yield browser
        browser.close()


@pytest.fixture
def page(chromium, request):
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)

    def explain() -> None:
        request.node.add_report_section(
            "call",
            "harness",
            "Chromium was killed shortly before the test's timeout: a Playwright call waited "
            "on a page that did not answer (a wedged page, or a wait longer than the test's timeout)",
        )

    guard = killed_after(time_left(RESERVE_S), f"{request.node.nodeid} (its timeout is near)", on_fire=explain)
    with guard:
        yield page
    with killed_after(TEARDOWN_S, f"closing the browser context of {request.node.nodeid}"):
        try:
            context.close()
        except Exception:  # the browser is gone (a guard killed it)
            if not guard.fired:
                raise


@pytest.fixture
def notebook(page, jupyter_lab):
    """`notebook(path)`: a NotebookPage opened on `path` (relative to the lab's root)."""

    def open_(path: str) -> NotebookPage:
        return NotebookPage(page, jupyter_lab, path).open()

    return open_


# pytest-jupyter's autouse fixtures (for the in-process server tests elsewhere) close "the" asyncio loop after
# each test; Playwright's sync API keeps its own loop running for the whole session. These tests run no
# in-process server, so both are switched off here.
@pytest.fixture(autouse=True)
def jp_asyncio_loop():
    return None


@pytest.fixture(autouse=True)
def jp_server_cleanup():
    return None
