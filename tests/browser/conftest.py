"""Fixtures for the browser tests: one control plane and one JupyterLab per module, one Chromium per session,
a fresh browser context (no cookies, no storage) per test."""

from __future__ import annotations

import pytest

from tests.browser.jupyterlab import LabUnderTest, NotebookPage, launch_chromium
from tests.conftest import running_lab


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    yield from running_lab(tmp_path_factory.mktemp("browser-lab"))


@pytest.fixture(scope="module")
def jupyter_lab(control_plane, tmp_path_factory):
    with LabUnderTest(tmp_path_factory.mktemp("jupyterlab"), control_plane.home) as lab:
        yield lab


@pytest.fixture(scope="module")  # not the session: Playwright's loop must not outlive this folder's tests
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        yield browser
        browser.close()


@pytest.fixture
def page(chromium, request):
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    context.close()


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
    yield None


@pytest.fixture(autouse=True)
def jp_server_cleanup():
    yield
