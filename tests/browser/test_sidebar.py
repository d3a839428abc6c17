"""The JupyterLab sidebar (labextension/), in a real JupyterLab in Debian's Chromium, against a real control plane:
it opens from its icon, shows my lease with its group and state (a gang's with its devices), shows why a
waiting lease waits, opens a run's live plot, comes back (open, refilled) after a page reload, and releases a
lease through its button — real clicks throughout. Saves sidebar.png (tests/browser/jupyterlab.py `screenshot_dir`).

The page's JupyterLab must have the extension: `make install` builds labextension/ and links it into the venv
(or a wheel install ships it). Without it this test fails saying so; it is never skipped.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from pathlib import Path

import nbformat
import pytest

from openrl_lab.collapse import CollapseWarning
from openrl_lab.lab.rows import devices_text
from tests.browser.jupyterlab import NotebookPage, screenshot_dir

NPM_NAME = "openrl-lab-labextension"
GROUP = "trainer-group"  # an alias: the sidebar must show the group's own id


def _installed_labextension() -> Path | None:
    """Where the JupyterLab under test (same environment) finds the extension, if anywhere."""
    from jupyter_core.paths import jupyter_path

    for base in jupyter_path("labextensions"):
        if (Path(base) / NPM_NAME / "package.json").is_file():
            return Path(base) / NPM_NAME
    return None


@pytest.fixture(scope="module", autouse=True)
def labextension_installed():
    where = _installed_labextension()
    if where is None:
        pytest.fail(
            f"the JupyterLab extension {NPM_NAME} is not installed where this environment's JupyterLab looks "
            "(jupyter_path('labextensions')): run `make install` (it builds labextension/ with jlpm and "
            "links it into the venv), or `cd labextension && jlpm install && jlpm build:prod` and link "
            f"labextension/dist to <prefix>/share/jupyter/labextensions/{NPM_NAME}"
        )
    built = json.loads((where / "package.json").read_text())
    assert built.get("jupyterlab", {}).get("_build", {}).get("load"), f"{where} is not a built lab extension"
    return where


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    """This module's control plane has two CPU kernels (cpu0 = trainer-group, cpu1 = sampler-group), so that a run
    can be a gang of 2."""
    from openrl_lab.server import LabServer

    with LabServer(tmp_path_factory.mktemp("browser-lab"), args=("--cpu-kernels", "2")) as server:
        yield server


@pytest.fixture(scope="module")
def lab(control_plane):
    from openrl_lab.lab import Lab

    lab = Lab.connect(home=control_plane.home)
    yield lab
    lab.close()


@pytest.fixture(scope="module")
def run(lab):
    """A lab lease with two logged steps (group given by its alias)."""
    lease = lab.lease("sb-run", group=GROUP)
    lease.log(1, reward=0.25, loss=1.5)
    lease.log(2, reward=0.5, loss=1.25)
    lease.flush()
    yield lease
    with contextlib.suppress(Exception):  # teardown: the lease is released whatever state the test left it in
        lab.release("sb-run")


@pytest.fixture(scope="module")
def gang(lab):
    """A lab lease on 2 devices (a gang of two ranks, one on each kernel)."""
    lease = lab.lease("sb-gang", devices=2)
    yield lease
    with contextlib.suppress(Exception):
        lab.release("sb-gang")


class Holder:
    """Two orchestrator leases of this user on one group: `sb-holder` (batch) holds a slice, `sb-waiter`
    (interactive) waits for one."""

    def __init__(self, lab, group: str):
        from openrl_lab.orchestrator import TimeSliceOrchestratorClient

        conn = lab.connection
        self.group = group
        self.holder = TimeSliceOrchestratorClient(conn.grpc_target, api_key=conn.api_key, job="sb-holder")
        self.waiter = TimeSliceOrchestratorClient(
            conn.grpc_target, api_key=conn.api_key, job="sb-waiter", priority="interactive"
        )
        self.slice = self.holder.acquire(group, timeout=60)
        self.waited: list = []
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self):
        try:
            s = self.waiter.acquire(self.group, timeout=240)
            self.waiter.release(s)
            self.waited.append(s)
        except Exception as e:  # noqa: BLE001 - handed to the test thread, which fails on it
            self.waited.append(e)

    def close(self):
        with contextlib.suppress(Exception):  # teardown: whatever state the test left the slice in
            self.holder.release(self.slice)
        self.thread.join(30)
        for client, name in ((self.holder, "sb-holder"), (self.waiter, "sb-waiter")):
            with contextlib.suppress(Exception):  # likewise: each lease is closed, each client closed
                client.close_lease(self.group, name)
            client.close()


def log_collapse(run):
    """Steps 3-14 of a policy sure of wrong answers: no reward, entropy 0.05 (the window of 10 is full at 12)."""
    for step in range(3, 15):
        run.log(step, reward=0.0, entropy=0.05)


def _open_lab(page, jupyter_lab):
    page.goto(jupyter_lab.url("lab"))
    page.wait_for_selector(".jp-LabShell", timeout=90_000)
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started !== undefined")
    page.evaluate("() => window.jupyterapp.restored")


def _sidebar_tab(page):
    return page.locator('.jp-SideBar .lm-TabBar-tab[data-id="openrl-lab-sidebar"]')


def _show_sidebar(page):
    """Opens the sidebar from its icon unless the workspace restored it open (a click would close it)."""
    tab = _sidebar_tab(page)
    tab.wait_for(timeout=30_000)
    sidebar = page.locator("#openrl-lab-sidebar")
    if not sidebar.is_visible():
        tab.click()
    sidebar.wait_for(state="visible")
    return sidebar


def test_sidebar_shows_leases_why_waiting_plots_survives_reload_and_releases(jupyter_lab, page, lab, run, gang):
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    _open_lab(page, jupyter_lab)
    tab = _sidebar_tab(page)
    try:
        tab.wait_for(timeout=30_000)
    except Exception:  # noqa: BLE001 - whatever kept the tab away, the failure below says what was loaded
        loaded = page.evaluate("() => [...window.jupyterapp.listPlugins()].filter(p => p.startsWith('openrl'))")
        pytest.fail(
            f"no OpenRL sidebar tab in JupyterLab's left bar (plugins: {loaded}); is {NPM_NAME} built and "
            f"installed? console: {console[-5:]}"
        )

    # opens from its icon
    sidebar = page.locator("#openrl-lab-sidebar")
    assert not sidebar.is_visible()
    tab.click()
    sidebar.wait_for(state="visible")

    # my lease, with its group (the group's own id, not the alias it was asked on) and state
    card = sidebar.locator('.jp-OpenRL-lease[data-lease="sb-run"]')
    card.wait_for(timeout=30_000)
    groups = {g.group_id: g for g in lab.orchestrator.list_groups()}
    group_id = next(gid for gid, g in groups.items() if gid == GROUP or GROUP in g.aliases)
    assert card.locator(".jp-OpenRL-fact-group dd").inner_text() == group_id
    assert card.locator(".jp-OpenRL-state").inner_text() in ("idle", "running", "evicted", "waiting")
    page.wait_for_function(
        """() => { const d = document.querySelector('[data-lease="sb-run"] .jp-OpenRL-fact-step dd');
                   return d && d.textContent === '2'; }""",
        timeout=30_000,
    )
    kernel = card.locator(".jp-OpenRL-fact-kernel dd").inner_text()
    assert kernel != "-", "the run's kernel is not shown"
    memory = card.locator(".jp-OpenRL-fact-memory dd").inner_text()
    assert re.fullmatch(r"\d+\.\d (KiB|MiB|GiB)", memory), f"the run's device memory shows {memory!r}"
    # a run on one device says nothing of devices; a gang says its devices as `%openrl status` does, each rank's
    # kernel on hover
    assert card.locator(".jp-OpenRL-devices").count() == 0
    gang_card = sidebar.locator('.jp-OpenRL-lease[data-lease="sb-gang"]')
    gang_card.wait_for(timeout=30_000)
    row = next(r for r in lab.status() if r["name"] == "sb-gang")
    assert devices_text(row) == f"devices 2: {','.join(r['group'] for r in row['ranks'])}"
    assert gang_card.locator(".jp-OpenRL-devices").inner_text() == devices_text(row)
    hover = gang_card.locator(".jp-OpenRL-devices").get_attribute("title") or ""
    assert [ln.split(":")[0] for ln in hover.splitlines()] == ["rank 0", "rank 1"], hover
    assert all(r["kernel"] in hover for r in row["ranks"]), hover
    assert gang_card.locator(".jp-OpenRL-fact-kernel dd").inner_text().startswith(row["ranks"][0]["kernel"])

    # a notebook's run is interactive: the class is a fact and a badge
    assert card.locator(".jp-OpenRL-fact-class dd").inner_text() == "interactive"
    assert card.locator(".jp-OpenRL-lease-head .jp-OpenRL-priority-interactive").inner_text() == "interactive"

    # a waiting lease: its position and the orchestrator's reason, in its row and in the group's queue
    holder = Holder(lab, group_id)
    try:
        entry = sidebar.locator('.jp-OpenRL-queue-entry[data-job="sb-waiter"]')
        entry.wait_for(timeout=30_000)
        reason = entry.locator(".jp-OpenRL-reason").inner_text()
        assert reason.strip(), "the queue entry shows no reason"
        assert "#1" in entry.locator(".jp-OpenRL-position").inner_text()
        # it is interactive: the queue says so, and why it goes first
        assert entry.get_attribute("data-priority") == "interactive"
        assert entry.locator(".jp-OpenRL-priority-interactive").inner_text() == "interactive"
        assert "goes before batch phases" in reason
        waiter_card = sidebar.locator('.jp-OpenRL-lease[data-lease="sb-waiter"]')
        waiter_card.wait_for(timeout=30_000)
        page.wait_for_function(
            """() => { const c = document.querySelector('.jp-OpenRL-lease[data-lease="sb-waiter"]');
                       return c && c.querySelector('.jp-OpenRL-state').textContent === 'waiting'
                              && c.querySelector('.jp-OpenRL-reason'); }""",
            timeout=30_000,
        )
        assert waiter_card.locator(".jp-OpenRL-reason").inner_text().strip() == reason.strip()
        assert "in queue" in waiter_card.locator(".jp-OpenRL-position").inner_text()
        holder_card = sidebar.locator('.jp-OpenRL-lease[data-lease="sb-holder"]')
        page.wait_for_function(
            """() => { const c = document.querySelector('.jp-OpenRL-lease[data-lease="sb-holder"]');
                       return c && c.querySelector('.jp-OpenRL-state').textContent === 'running'; }""",
            timeout=30_000,
        )
        assert holder_card.locator(".jp-OpenRL-why").count() == 0
        assert holder_card.locator(".jp-OpenRL-fact-class dd").inner_text() == "batch"
        assert holder_card.locator(".jp-OpenRL-priority-interactive").count() == 0
        # the queue section names the holder, and the timeline draws its slice
        group_box = sidebar.locator(f'.jp-OpenRL-group[data-group="{group_id}"]')
        assert "sb-holder" in group_box.locator(".jp-OpenRL-holder").inner_text()
        assert re.search(r"duty \d+%", group_box.locator(".jp-OpenRL-duty-text").inner_text())
        sidebar.locator(".jp-OpenRL-tl-slice").first.wait_for(timeout=30_000)

        # a run's live plot in the main area, fed by the server (two logged steps)
        card.locator("button.jp-OpenRL-plot").click()
        plot = page.locator(".jp-OpenRL-plot")
        plot.locator("canvas").first.wait_for(timeout=30_000)
        page.wait_for_function(
            """() => { const i = document.querySelector('.jp-OpenRL-plot-info');
                       return i && i.textContent.includes('2 steps'); }""",
            timeout=30_000,
        )
        legend = plot.locator(".u-legend").inner_text()
        assert "reward" in legend and "loss" in legend
        page.wait_for_timeout(1500)  # a couple of timeline ticks
        page.screenshot(path=str(screenshot_dir() / "sidebar.png"))

        # a page reload: the sidebar comes back open (layout restorer) and refills; so does the plot
        page.reload()
        page.wait_for_selector(".jp-LabShell", timeout=90_000)
        sidebar = page.locator("#openrl-lab-sidebar")
        sidebar.wait_for(state="visible", timeout=60_000)
        sidebar.locator('.jp-OpenRL-lease[data-lease="sb-run"]').wait_for(timeout=30_000)
        sidebar.locator('.jp-OpenRL-queue-entry[data-job="sb-waiter"] .jp-OpenRL-reason').wait_for(timeout=30_000)
        page.wait_for_function(
            """() => { const i = document.querySelector('.jp-OpenRL-plot-info');
                       return i && i.textContent.includes('2 steps'); }""",
            timeout=60_000,
        )
    finally:
        holder.close()
    assert holder.waited and not isinstance(holder.waited[0], Exception), holder.waited

    # a run whose policy collapses (openrl_lab/collapse.py: entropy under the floor, reward nil), as its log flags
    # it: its card says since when, in red
    card = sidebar.locator('.jp-OpenRL-lease[data-lease="sb-run"]')
    assert card.locator(".jp-OpenRL-collapse").count() == 0
    with pytest.warns(CollapseWarning, match="sb-run: step 12: the policy is collapsing"):
        log_collapse(run)
    run.flush()
    assert next(r for r in lab.status() if r["name"] == "sb-run")["collapse_since"] == 12
    card.locator(".jp-OpenRL-collapse").wait_for(timeout=30_000)
    assert card.locator(".jp-OpenRL-collapse").inner_text() == "collapse since step 12"
    card.screenshot(path=str(screenshot_dir() / "sidebar-collapse.png"))

    # "Attach" puts `%openrl attach sb-run` into the notebook in front, below its active cell
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells.append(nbformat.v4.new_code_cell("print('first cell')"))
    (jupyter_lab.root / "sidebar-attach.ipynb").write_text(nbformat.writes(nb))
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:open', {path: 'sidebar-attach.ipynb'})")
    cells = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell")
    cells.first.wait_for(timeout=60_000)
    card = sidebar.locator('.jp-OpenRL-lease[data-lease="sb-run"]')
    card.locator("button.jp-OpenRL-attach").click()
    page.wait_for_function(
        """() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell .cm-content')]
                  .map(c => c.textContent)[1] === '%openrl attach sb-run'""",
        timeout=30_000,
    )
    assert cells.count() == 2

    # release through the button (and the confirmation dialog), as a user does
    card.locator("button.jp-OpenRL-release").click()
    dialog = page.locator(".jp-Dialog")
    dialog.wait_for()
    assert "Release sb-run?" in dialog.inner_text()
    dialog.locator("button.jp-mod-accept").click()
    toasts: set[str] = set()
    for _ in range(60):
        toasts.update(page.locator(".Toastify__toast").all_inner_texts())
        if card.count() == 0:
            break
        page.wait_for_timeout(500)
    else:
        pytest.fail(f"sb-run is still listed 30 s after its Release button was clicked; notifications: {toasts}")
    assert any("Released sb-run" in t for t in toasts), toasts
    assert "sb-run" not in lab.lease_names()
    errors = [c for c in console if "openrl" in c.lower() or "uplot" in c.lower()]
    assert not errors, errors


def test_release_of_an_unknown_lease_says_why(jupyter_lab, page):
    """The release route's 404 reaches the user as a notification naming the lease (not a silent failure)."""
    _open_lab(page, jupyter_lab)
    _sidebar_tab(page).wait_for(timeout=30_000)
    page.evaluate(
        "() => window.jupyterapp.commands.execute('openrl:release-lease', {name: 'sb-nonesuch', noConfirm: true})"
    )
    toast = page.locator(".Toastify__toast", has_text="sb-nonesuch")
    toast.wait_for(timeout=30_000)
    assert "Could not release sb-nonesuch" in toast.inner_text()


def test_without_the_websocket_it_polls_the_get_routes_and_keeps_trying(jupyter_lab, page, lab):
    """A proxy that drops websockets (or a server restarting): the sidebar says so, fills itself from the GET
    routes, and keeps trying the stream with backoff."""
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient

    conn = lab.connection
    client = TimeSliceOrchestratorClient(conn.grpc_target, api_key=conn.api_key, job="sb-poll")
    group_id = client.lease(GROUP, "sb-poll").group_id
    attempts: list[str] = []
    pending: list = []
    # (closed from the test's flow, not inside the handler: a sync call there would wait on itself)
    page.route_web_socket(
        re.compile(r".*/openrl/api/stream.*"), lambda ws: (attempts.append(ws.url), pending.append(ws))
    )

    def refuse_for(ms: int, until=None) -> None:
        for _ in range(ms // 200):
            while pending:
                pending.pop().close(code=1011, reason="refused by the test")
            if until is not None and until():
                return
            page.wait_for_timeout(200)

    try:
        _open_lab(page, jupyter_lab)
        sidebar = _show_sidebar(page)
        card = sidebar.locator('.jp-OpenRL-lease[data-lease="sb-poll"]')
        refuse_for(30_000, until=lambda: card.count() > 0)
        assert card.count() == 1, f"the GET fallback did not fill the sidebar ({len(attempts)} websocket attempts)"
        assert card.locator(".jp-OpenRL-fact-group dd").inner_text() == group_id
        assert "polling" in sidebar.locator(".jp-OpenRL-conn").inner_text()
        refuse_for(2_500)
        assert len(attempts) >= 2, attempts
        assert all(
            u.startswith(f"ws://127.0.0.1:{jupyter_lab.port}/user/researcher/openrl/api/stream") for u in attempts
        ), attempts
    finally:
        client.close_lease(GROUP, "sb-poll")
        client.close()


def test_a_notebooks_own_model_state_is_a_job_in_the_sidebar(jupyter_lab, page, lab):
    """Issue 15: state registered with `%openrl resident` (ResidentState underneath) is a job of its own,
    `notebook:<name>`: the sidebar lists it, shows it evicted while another job holds the group, resident again
    after its next phase, and gone once it is closed."""
    import torch

    from openrl_lab.lab.resident import ResidentState
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = ResidentState(lab.orchestrator, GROUP, "sb-own", announce=None).register(model, optimizer, name="model")
    other = TimeSliceOrchestratorClient(lab.connection.grpc_target, api_key=lab.connection.api_key, job="sb-other")

    def train_step():
        with state.phase():
            model(torch.ones(4, 8)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    def shows(state_text: str) -> None:
        page.wait_for_function(
            """(s) => { const c = document.querySelector('.jp-OpenRL-lease[data-lease="notebook:sb-own"]');
                        return c && c.querySelector('.jp-OpenRL-state').textContent === s; }""",
            arg=state_text,
            timeout=30_000,
        )

    try:
        train_step()
        before = model.weight.detach().clone()
        _open_lab(page, jupyter_lab)
        sidebar = _show_sidebar(page)
        sidebar.locator('.jp-OpenRL-lease[data-lease="notebook:sb-own"]').wait_for(timeout=30_000)
        shows("idle")  # resident, between phases: nothing moved (lazy yield)
        held = other.acquire(GROUP, timeout=60)  # another job wants the group: our state leaves the device
        shows("evicted")
        assert not state.resident
        page.screenshot(path=str(screenshot_dir() / "sidebar-own-state.png"))
        other.release(held)
        train_step()  # the next phase restores it first
        assert state.resident and not torch.equal(model.weight.detach(), before)
        shows("idle")
    finally:
        state.close()
        other.close_lease(GROUP, "sb-other")
        other.close()
    page.wait_for_function(
        "() => !document.querySelector('.jp-OpenRL-lease[data-lease=\"notebook:sb-own\"]')", timeout=30_000
    )


FORK_NOTEBOOK = [
    "%openrl lease cmp-base --rank 2",
    """for step in range(3):
    run.log(step, reward=0.1 * step, loss=2.0 - 0.1 * step)
run.flush()""",
    "%openrl fork cmp-base --as cmp-a,cmp-b --set learning_rate=3e-4,1e-3",
    """for i, f in enumerate(forks.values()):
    for step in range(3, 6):
        f.log(step, reward=0.2 * step + i, loss=1.5 - 0.1 * step - 0.1 * i)
    f.flush()""",
    "%openrl compare cmp-base,cmp-a,cmp-b",
    """forks["cmp-b"].log(6, reward=9.0, loss=0.25)
forks["cmp-b"].flush()""",
]


def test_fork_and_compare_in_a_notebook_and_in_the_sidebar(jupyter_lab, page, lab):
    """Issue 29, item 2, where the researcher meets it: `%openrl fork` and `%openrl compare` in a notebook of a
    real JupyterLab draw the variants overlaid with a summary; the sidebar shows each fork's origin and settings
    (and its class: a notebook's fork is interactive), and its "Compare" buttons (a fork's family, or the runs
    ticked) open the runs overlaid in the main area, live as a run logs from the notebook."""
    from tests.browser.plot_helpers import plots_in, wait_for_points, write_notebook

    write_notebook(jupyter_lab.root / "fork-compare.ipynb", FORK_NOTEBOOK)
    try:
        nbp = NotebookPage(page, jupyter_lab, "fork-compare.ipynb?reset").open()
        for i in range(5):
            nbp.run_cell(i)
            nbp.wait_for_cell(i)
        assert "learning_rate" in nbp.output_text(2) and "bound: forks" in nbp.output_text(2)
        # the notebook's comparison: a trace per metric and run, and the summary table with the settings
        plot = wait_for_points(nbp, 4, traces=6, points=3)
        assert {t["name"] for t in plot["traces"]} == {f"{m} {r}" for m in ("reward", "loss") for r in RUNS}
        summary = nbp.output_text(4)
        assert "learning_rate" in summary and "0.0003" in summary and "cmp-base" in summary, summary

        sidebar = _show_sidebar(page)
        fork = sidebar.locator('.jp-OpenRL-lease[data-lease="cmp-a"]')
        fork.wait_for(timeout=30_000)
        assert fork.locator(".jp-OpenRL-variant").inner_text() == "fork of cmp-base @ 2: learning_rate=0.0003"
        assert fork.locator(".jp-OpenRL-fact-class dd").inner_text() == "interactive"
        base = sidebar.locator('.jp-OpenRL-lease[data-lease="cmp-base"]')
        assert base.locator(".jp-OpenRL-variant").count() == 0  # the origin is no fork

        # a fork's "Compare": its family overlaid, a colour per run, with the summary under the curves
        fork.locator("button.jp-OpenRL-compare-family").click()
        panel = page.locator(".jp-OpenRL-compare").first
        panel.locator("canvas").first.wait_for(timeout=30_000)
        page.wait_for_function(
            """() => { const i = document.querySelector('.jp-OpenRL-compare .jp-OpenRL-plot-info');
                       return i && i.textContent.startsWith('cmp-base: 3 steps')
                                && i.textContent.includes('cmp-a: 6 steps'); }""",
            timeout=30_000,
        )
        legend = panel.locator(".u-legend").inner_text()
        assert all(f"{m} {r}" in legend for m in ("reward", "loss") for r in RUNS), legend
        row = panel.locator('.jp-OpenRL-compare-summary tr[data-run="cmp-b"]')
        row.wait_for(timeout=30_000)
        page.wait_for_function(
            """() => { const r = document.querySelector('.jp-OpenRL-compare-summary tr[data-run="cmp-b"]');
                       return r && r.textContent.includes('fork of cmp-base @ 2: learning_rate=0.001'); }""",
            timeout=30_000,
        )
        assert page.locator(".lm-TabBar-tab", has_text="compare cmp-base vs cmp-a vs cmp-b").count() == 1

        # live: a step logged in the notebook reaches the panel (through the server) and the notebook's plot
        page.locator(".lm-TabBar-tab", has_text="fork-compare.ipynb").click()
        nbp.run_cell(5)
        nbp.wait_for_cell(5)
        for _ in range(120):  # the notebook's comparison draws it too (this process logged it)
            lasts = {t["name"]: t["last"] for p in plots_in(nbp, 4) for t in p["traces"]}
            if lasts.get("reward cmp-b") == 6:
                break
            page.wait_for_timeout(250)
        else:
            pytest.fail(f"the notebook's comparison did not draw cmp-b's step 6: {lasts}")
        page.locator(".lm-TabBar-tab", has_text="compare cmp-base").click()
        page.wait_for_function(
            """() => { const i = document.querySelector('.jp-OpenRL-compare .jp-OpenRL-plot-info');
                       return i && i.textContent.includes('cmp-b: 7 steps, last step 6'); }""",
            timeout=30_000,
        )
        cells = panel.locator('.jp-OpenRL-compare-summary tr[data-run="cmp-b"] td').all_inner_texts()
        assert cells[2] == "6" and "9" in cells[3:], cells  # steps, and the new reward as its last and best
        page.screenshot(path=str(screenshot_dir() / "compare.png"))

        # two runs ticked: "Compare (2)" overlays just those
        button = sidebar.locator("button.jp-OpenRL-compare-picked")
        assert button.is_disabled()
        for name in ("cmp-base", "cmp-b"):
            sidebar.locator(f'.jp-OpenRL-lease[data-lease="{name}"] input.jp-OpenRL-pick-box').check()
        page.wait_for_function(
            """() => { const b = document.querySelector('button.jp-OpenRL-compare-picked');
                       return b && !b.disabled && b.textContent === 'Compare (2)'; }""",
            timeout=10_000,
        )
        sidebar.locator("button.jp-OpenRL-compare-picked").click()
        page.wait_for_function(
            """() => [...document.querySelectorAll('.jp-OpenRL-compare .jp-OpenRL-plot-info')].some(
                       i => i.textContent.split(' · ').sort().join(' · ')
                            === 'cmp-b: 7 steps, last step 6 · cmp-base: 3 steps, last step 2')""",
            timeout=30_000,
        )
        assert page.locator(".jp-OpenRL-compare").count() == 2
        errors = [c for c in nbp.console if "openrl" in c.lower() or "uplot" in c.lower()]
        assert not errors, errors
    finally:
        for name in RUNS:
            with contextlib.suppress(Exception):  # teardown: whatever the test left
                lab.release(name)


RUNS = ("cmp-base", "cmp-a", "cmp-b")
