"""The live plot as a researcher sees it in JupyterLab (issue 12, items 5 and 8): a fresh kernel's plot always
draws its points, and a page reload mid-run brings the plot back, still growing."""

from __future__ import annotations

import os

from tests.browser.jupyterlab import NotebookPage, screenshot_dir
from tests.browser.plot_helpers import plots_in, wait_for_points, write_notebook

# Item 5 was seen in fresh kernels running tutorial 02 with Run All: the kernel still importing (plotly, torch),
# the page still loading plotly's ~5 MB widget module and restoring the kernel's widgets while the first
# points arrive. Both races are run here: one notebook displays then logs at once, the other lets the run start
# first, as the tutorial does; each in a fresh page and a fresh kernel, Run All clicked as soon as it opens.
RACE = [
    "%openrl lease race-{i} --rank 2",
    """from IPython.display import display
from openrl_lab.lab.widgets import StopButton
plot = run.plot(["reward", "loss"])
stop = StopButton()
display(stop, plot)""",
    """for step in range(20):
    run.log(step, reward=step / 20, loss=1 - step / 40)""",
    "%openrl release race-{i}",
]

FRESH_KERNELS = int(os.environ.get("OPENRL_TEST_FRESH_KERNELS", "6"))


def test_a_fresh_kernels_plot_always_draws_its_points(jupyter_lab, chromium):
    for i in range(FRESH_KERNELS):
        path = f"race-{i}.ipynb"
        write_notebook(jupyter_lab.root / path, [c.replace("{i}", str(i)) for c in RACE])
        context = chromium.new_context(viewport={"width": 1400, "height": 900})
        try:
            page = context.new_page()
            page.set_default_timeout(90_000)
            nbp = NotebookPage(page, jupyter_lab, path + "?reset")  # ?reset: only this notebook open
            page.goto(jupyter_lab.url(f"lab/tree/{nbp.path}"))
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
            page.wait_for_function("""() => { const w = window.jupyterapp.shell.currentWidget;
                return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel; }""")
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()  # Run > Run All Cells
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            try:
                nbp.wait_for_cell(3, timeout=120_000)
            except Exception:
                page.screenshot(path=str(jupyter_lab.tmp / f"race-{i}.png"))
                raise
            assert "released race-" in nbp.output_text(3), nbp.output_text(3)
            plot = wait_for_points(nbp, 1, traces=2, points=20)
            assert [t["name"] for t in plot["traces"]] == ["reward", "loss"], (i, plot)
            assert [t["last"] for t in plot["traces"]] == [19, 19], (i, plot)
            assert "waiting for the first step" not in plot["annotations"]
        finally:
            context.close()
            _shutdown_kernels(jupyter_lab)


STEPS = 3000  # 5 minutes at most: the test interrupts it once the plot came back and grew
LOOP = """import math, time
from IPython.display import display
plot = run.plot(["reward", "loss"], title="GRPO (synthetic metrics)")
display(plot)
for step in range(STEPS):
    run.log(step, reward=1 - math.exp(-step / 60) + 0.05 * math.sin(step),
            loss=math.exp(-step / 80) + 0.02 * math.cos(3 * step))
    time.sleep(0.1)""".replace("STEPS", str(STEPS))


def test_a_reload_mid_run_brings_the_plot_back_and_it_keeps_growing(jupyter_lab, page):
    write_notebook(jupyter_lab.root / "reload.ipynb", ["%openrl lease live-reload --rank 2", LOOP])
    nbp = NotebookPage(page, jupyter_lab, "reload.ipynb?reset").open()  # ?reset: no other notebook restored
    nbp.run_cell(0)
    nbp.wait_for_cell(0)
    assert "bound: run" in nbp.output_text(0)
    nbp.run_cell(1)
    before = wait_for_points(nbp, 1, traces=2, points=30)
    # what the README shows
    out = nbp.cell(1).locator(".jp-OutputArea")
    out.scroll_into_view_if_needed()
    # a clip of the page, not an element screenshot: that waits for the element to stop changing, and a live
    # plot does not
    nbp.page.screenshot(path=str(screenshot_dir() / "live-plot.png"), clip=out.bounding_box())
    nbp.cell(1).locator(".cm-content").click()
    nbp.page.keyboard.press("Control+s")  # the page's outputs (the widget view) survive the reload
    nbp.page.wait_for_function("""() => !window.jupyterapp.shell.currentWidget.context.model.dirty""")

    nbp.page.reload()
    nbp.page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell")
    n = min(t["points"] for t in before["traces"])
    back = _wait_or_explain(nbp, jupyter_lab, "reload-back", n)  # the view comes back with the data so far...
    seen = min(t["points"] for t in back["traces"])
    assert seen < STEPS, "the plot came back only after the loop ended"
    later = _wait_or_explain(nbp, jupyter_lab, "reload-grows", seen + 20)  # ...and grows while the loop runs
    assert [t["name"] for t in later["traces"]] == ["reward", "loss"]
    assert not [e for e in nbp.console if "plotly" in e.lower() or "Error displaying widget" in e], nbp.console
    nbp.command("notebook:interrupt-kernel")
    nbp.wait_for_kernel_idle()
    _shutdown_kernels(jupyter_lab)


def _wait_or_explain(nbp, lab, name: str, points: int) -> dict:
    """wait_for_points on cell 1's two traces; on failure a screenshot in the lab's tmp and what the page shows."""
    try:
        return wait_for_points(nbp, 1, traces=2, points=points)
    except Exception as e:
        nbp.page.screenshot(path=str(lab.tmp / f"{name}.png"))
        raise AssertionError(
            f"{name}: no plot with 2 traces of {points} points; the cell shows "
            f"{plots_in(nbp, 1)} / {nbp.output_text(1)[:200]!r}; kernel {nbp.kernel_status()}; "
            f"console {nbp.console}"
        ) from e


def _shutdown_kernels(lab) -> None:
    """Kernels of earlier notebooks stop: the machine is small and each holds a CPU-hungry warm-up."""
    for k in lab.api("GET", "api/kernels").json():
        lab.api("DELETE", f"api/kernels/{k['id']}")
