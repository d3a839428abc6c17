"""A real JupyterLab in a real Chromium, for the tests of what a researcher sees in the browser.

- `LabUnderTest`: `python -m jupyterlab` as a child process on loopback, under a non-root base URL (as
  behind JupyterHub's proxy), with the OpenRL server extension, kernel and a control plane (its
  `OPENRL_LAB_HOME`), on a private copy of the tutorials, with private settings, workspaces and runtime
  folders, and `expose_app_in_browser` so a test can reach `window.jupyterapp` (as Galata does).
- `launch_chromium`: Debian's Chromium (`/usr/bin/chromium`, installed by `make test`) driven by Playwright;
  Playwright's own browser downloads do not work on our machines, and are never attempted.
- `NotebookPage`: what a test does with a notebook in the page: open, run cells the way a user does
  (Shift+Enter or the Run All command), read outputs, wait for the kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.harness import time_left

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("OPENRL_TEST_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags Chromium keeps dialling out, and our closed network refuses it.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
]

# JupyterLab's own calls home (news, update checks) are off: the network is closed and they add noise.
_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabUnderTest:
    """JupyterLab on `root` (tutorials copied there unless `copy_tutorials=False`), talking to the control
    plane of `home`. `url(path)` is a page's address, token included."""

    def __init__(
        self,
        tmp: Path,
        home: Path,
        *,
        base_url: str = "/user/researcher/",
        copy_tutorials: bool = True,
        extra_args: list[str] | None = None,
    ):
        self.tmp = tmp
        self.home = home
        self.root = tmp / "notebooks"
        self.root.mkdir(parents=True, exist_ok=True)
        if copy_tutorials:
            for nb in (REPO / "notebooks").glob("*.ipynb"):
                shutil.copy(nb, self.root / nb.name)
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None
        self.log_path = tmp / "jupyterlab.log"

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str = "lab") -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.origin}{self.base_url}{path.lstrip('/')}{sep}token={self.token}"

    def api(self, method: str, path: str, **kw) -> httpx.Response:
        """A request to the Jupyter server (its REST API or the OpenRL server extension), as the page makes it."""
        headers = {"Authorization": f"token {self.token}", **kw.pop("headers", {})}
        return httpx.request(
            method,
            f"{self.origin}{self.base_url}{path.lstrip('/')}",
            headers=headers,
            timeout=kw.pop("timeout", 30),
            **kw,
        )

    def start(self, timeout: float = 90) -> LabUnderTest:
        settings = self.tmp / "lab-settings"
        for name, value in _SETTINGS.items():
            (settings / name).parent.mkdir(parents=True, exist_ok=True)
            (settings / name).write_text(json.dumps(value))
        env = {
            **os.environ,
            "OPENRL_LAB_HOME": str(self.home),
            "JUPYTERLAB_SETTINGS_DIR": str(settings),
            "JUPYTERLAB_WORKSPACES_DIR": str(self.tmp / "lab-workspaces"),
            "JUPYTER_RUNTIME_DIR": str(self.tmp / "runtime"),
            "JUPYTER_CONFIG_DIR": str(self.tmp / "jupyter-config"),  # no user config leaks in
            "IPYTHONDIR": str(self.tmp / "ipython"),
        }
        for var in ("OPENRL_LAB_URL", "OPENRL_LAB_API_KEY"):  # the notebooks find the lab through the home
            env.pop(var, None)
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={self.root}",
            f"--ServerApp.base_url={self.base_url}",
            f"--IdentityProvider.token={self.token}",
            "--ServerApp.allow_root=True",
            "--LabApp.expose_app_in_browser=True",
            "--ServerApp.open_browser=False",
            "--LabServerApp.news_url=",
            *self.extra_args,
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the server's log for its lifetime, closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
            try:
                if self.api("GET", "api/status", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"JupyterLab did not answer in {timeout:.0f} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # kernels first, so none outlives the test; a server that cannot answer is terminated below all the same
        with contextlib.suppress(Exception):
            for k in self.api("GET", "api/kernels", timeout=5).json():
                self.api("DELETE", f"api/kernels/{k['id']}", timeout=15)
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(5)
        self._log.close()

    def __enter__(self) -> LabUnderTest:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class CellError(AssertionError):
    """A notebook cell raised, its kernel died, or it did not finish in time: the message says which."""


# What wait_for_cell reads, in one round trip: whether cell `index`'s prompt shows a number, every error output in
# the notebook's model (ANSI colours removed), and the kernel's state.
# The notebook widget of document `path`: by path, never "the one in front", since JupyterLab restores the
# workspace's earlier tabs (an earlier test's notebook) before it opens the one a URL names.
_FIND = """const w = !(window.jupyterapp && window.jupyterapp.shell) ? null
        : Array.from(window.jupyterapp.shell.widgets('main'))
            .find((x) => x.context && x.context.path === path && x.content) || null;"""

_CELL_STATE = (
    """([index, path]) => {
    """
    + _FIND
    + """
    const cell = w && w.content && w.content.widgets ? w.content.widgets[index] : null;
    const node = cell ? cell.node : null;
    const prompt = node && node.querySelector('.jp-InputPrompt') ? node.querySelector('.jp-InputPrompt').innerText
        : '';
    const errors = [];
    const model = w && w.content && w.content.model;
    if (model) {
        for (let i = 0; i < model.cells.length; i++) {
            const c = model.cells.get(i);
            if (c.type !== 'code') continue;
            for (let j = 0; j < c.outputs.length; j++) {
                const o = c.outputs.get(j).toJSON();
                if (o.output_type === 'error') {
                    const text = [o.ename + ': ' + o.evalue, ...(o.traceback || [])].join('\\n');
                    errors.push({index: i, text: text.replace(/\\u001b\\[[0-9;]*m/g, '')});
                }
            }
        }
    }
    const sc = w && w.sessionContext;
    return {done: /\\[\\d+\\]/.test(prompt), prompt: prompt.trim(), errors,
            kernel: sc ? sc.kernelDisplayStatus : '', had_kernel: !!(sc && sc.session && sc.session.kernel)};
}"""
)


def bounded_ms(timeout_ms: float, reserve_s: float = 60.0) -> float:
    """`timeout_ms`, cut to the time the running test has left less `reserve_s`: a wait ends with its own message
    before the page's guard kills the browser (45 s before the test's timeout, tests/browser/conftest.py) and
    before pytest-timeout fires inside a Playwright call."""
    return max(1000.0, min(timeout_ms, time_left(reserve_s) * 1000))


def browser_processes() -> list[int]:
    """The pids of the Chromium processes this test process started (through Playwright's driver)."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if cmd and Path(cmd[0]).name.startswith(("chromium", "chrome", "headless_shell")):
            found.append(proc.pid)
    return found


def kill_browsers() -> list[int]:
    """Kills every Chromium this process started: a Playwright call waiting on it then raises at once (the
    browser has closed) instead of waiting on a wedged page. Returns the pids killed."""
    pids = browser_processes()
    for pid in pids:
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, 9)
    return pids


class killed_after:  # noqa: N801 - named for how it reads in a with statement, as contextlib.suppress is
    """`with killed_after(20, "closing the context"): ...`: if the block has not ended after that many seconds,
    the browsers are killed, so that the Playwright call inside it returns (raising) instead of hanging."""

    def __init__(self, seconds: float, what: str, on_fire=None):
        import threading

        self.what = what
        self.on_fire = on_fire
        self.fired = False
        self._timer = threading.Timer(seconds, self._fire) if seconds < 10**6 else None  # inf: no timeout, no guard
        if self._timer:
            self._timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        if self.on_fire:  # before the kill: the failing call's report is made as soon as the browser is gone
            self.on_fire()
        pids = kill_browsers()
        print(f"browser tests: {self.what} did not end in time; killed Chromium {pids}", file=sys.stderr)

    def __enter__(self) -> killed_after:
        if self._timer:
            self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._timer:
            self._timer.cancel()


def launch_chromium(playwright):
    """Debian's Chromium, headless, through Playwright (never a downloaded browser)."""
    if not Path(CHROMIUM).exists():
        raise RuntimeError(
            f"{CHROMIUM} is missing: `make test` installs Debian's chromium package "
            "(apt-get install chromium); Playwright's browser downloads do not work here"
        )
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


class NotebookPage:
    """A notebook open in JupyterLab in `page` (a Playwright Page), driven the way a user drives it."""

    def __init__(self, page, lab: LabUnderTest, path: str):
        self.page = page
        self.lab = lab
        self.path = path
        self.doc_path = path.split("?")[0]  # the document's path, without a URL query such as ?reset
        self.console: list[str] = []  # the page's console errors and uncaught exceptions
        page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))

    def open(self, timeout: float = 60_000) -> NotebookPage:
        """Opens the notebook and waits until it is the tab in front, loaded, with an idle kernel. Another
        notebook the workspace restores may show first; waiting for any notebook would drive that one."""
        self.page.goto(self.lab.url(f"lab/tree/{self.path}"))
        self.page.wait_for_function(
            """(path) => {
            """
            + _FIND
            + """
            if (!w || !w.context.isReady) return false;
            if (window.jupyterapp.shell.currentWidget !== w) window.jupyterapp.shell.activateById(w.id);
            return window.jupyterapp.shell.currentWidget === w && w.content.widgets.length > 0;
        }""",
            arg=self.doc_path,
            timeout=bounded_ms(timeout),
        )
        self.wait_for_kernel_idle(timeout)
        return self

    @property
    def panel(self):
        """This notebook's panel, found by its document's path each time (other notebooks may be open in hidden
        tabs, and a reload makes a new panel); the panel in front while the page has no such notebook yet."""
        panel_id = self.page.evaluate("(path) => { " + _FIND + " return w ? w.id : ''; }", self.doc_path)
        if panel_id:
            return self.page.locator(f"[id='{panel_id}']")
        return self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").first

    def cell(self, index: int):
        return self.panel.locator(".jp-Notebook .jp-Cell").nth(index)

    def cells(self):
        return self.panel.locator(".jp-Notebook .jp-Cell")

    def kernel_status(self) -> str:
        """The kernel's state as the notebook's toolbar shows it ("Idle", "Busy", ...)."""
        return self.page.evaluate(
            "(path) => { " + _FIND + " return w && w.sessionContext ? w.sessionContext.kernelDisplayStatus : ''; }",
            self.doc_path,
        )

    def wait_for_kernel_idle(self, timeout: float = 60_000) -> None:
        self.page.wait_for_function(
            "(path) => { "
            + _FIND
            + """
            return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel
                && w.sessionContext.kernelDisplayStatus === 'idle';
        }""",
            arg=self.doc_path,
            timeout=bounded_ms(timeout),
        )

    def command(self, name: str, args: dict | None = None):
        """Runs a JupyterLab command, as the menu or the palette would."""
        return self.page.evaluate("([n, a]) => window.jupyterapp.commands.execute(n, a)", [name, args or {}])

    def set_cell_source(self, index: int, source: str) -> None:
        """Types `source` into cell `index` (replacing what is there), the way a user edits a cell."""
        self.cell(index).locator(".cm-content").click()
        self.page.keyboard.press("Control+a")
        self.page.keyboard.insert_text(source)

    def append_cell(self, source: str) -> int:
        """A new code cell at the end with `source`; its index."""
        self.cells().last.click()
        self.page.keyboard.press("Escape")
        self.command("notebook:insert-cell-below")
        index = self.cells().count() - 1
        self.set_cell_source(index, source)
        return index

    def run_cell(self, index: int) -> None:
        """Selects cell `index` and runs it with Shift+Enter (does not wait for it to finish)."""
        self.cell(index).locator(".cm-content").click()
        self.page.keyboard.press("Shift+Enter")

    def run_all(self) -> None:
        self.command("notebook:run-all-cells")

    def prompt(self, index: int) -> str:
        """The cell's execution prompt: '[ ]:', '[*]:' while it waits or runs, '[3]:' when done."""
        return self.cell(index).locator(".jp-InputPrompt").inner_text().strip()

    def wait_for_cell(self, index: int, timeout: float = 120_000, *, errors_ok: bool = False) -> None:
        """Until cell `index` has run (its prompt shows a number). Fails at once, with the traceback, when any cell
        shows an error output (unless `errors_ok`) or the kernel dies: a Run All stops at an error and the cells
        after it never run, so waiting on would only run into the test's timeout. Never waits past the time the
        test has left (`tests.harness.time_left`)."""
        limit_s = bounded_ms(timeout) / 1000
        deadline = time.monotonic() + limit_s
        dead_polls = 0
        while True:
            state = self.page.evaluate(_CELL_STATE, [index, self.doc_path])
            if state["errors"] and not errors_ok:
                raise CellError(
                    f"cell {state['errors'][0]['index']} of {self.path} raised while waiting for cell {index}:\n"
                    + "\n\n".join(f"[cell {e['index']}] {e['text']}" for e in state["errors"])
                )
            if state["done"]:
                return
            # 'dead' only, and for a second: 'unknown' (and a moment of 'dead') is also what a kernel that is
            # still starting, or restarting, reads
            dead_polls = dead_polls + 1 if state["kernel"] == "dead" and state["had_kernel"] else 0
            if dead_polls >= 4:
                raise CellError(f"the kernel of {self.path} died while waiting for cell {index}")
            if time.monotonic() > deadline:
                raise CellError(
                    f"cell {index} of {self.path} had not finished after {limit_s:.0f} s (prompt "
                    f"{state['prompt']!r}, kernel {state['kernel']})"
                )
            time.sleep(0.25)

    def output_text(self, index: int) -> str:
        return self.cell(index).locator(".jp-OutputArea").inner_text()

    def save(self) -> None:
        self.command("docmanager:save")


def screenshot_dir() -> Path:
    """Where the tests' screenshots go: $OPENRL_SCREENSHOTS (`make screenshots` sets it to docs/images, the
    README's pictures), else a temporary folder: a plain test run writes nothing into the checkout."""
    import tempfile

    out = Path(os.environ.get("OPENRL_SCREENSHOTS") or Path(tempfile.gettempdir()) / "openrl-lab-screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out
