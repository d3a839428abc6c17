"""The live plot as a researcher sees it in JupyterLab (issue 12, items 5 and 8): a fresh kernel's plot always
draws its points, and a page reload mid-run brings the plot back, still growing."""

from __future__ import annotations

from pathlib import Path

from tests.browser.jupyterlab import NotebookPage
from tests.browser.plot_helpers import plots_in, wait_for_points, write_notebook

DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"

# The race of item 5: the points arrive while the fresh page still loads plotly's ~5 MB widget module, so the
# view renders after the first updates went by. Display first, then append at once, as a training loop does.
RACE = """from IPython.display import display
from openrl_lab.lab.widgets import LivePlot
plot = LivePlot(["reward", "loss"], hz=5)
display(plot)
for step in range(20):
    plot.append(step, reward=step / 20, loss=1 - step / 40)"""

FRESH_KERNELS = 6


def test_a_fresh_kernels_plot_always_draws_its_points(jupyter_lab, chromium):
    for i in range(FRESH_KERNELS):  # each a fresh browser context and page (the widget module loads again),
        path = f"race-{i}.ipynb"     # and a fresh kernel
        write_notebook(jupyter_lab.root / path, [RACE])
        context = chromium.new_context(viewport={"width": 1400, "height": 900})
        try:
            page = context.new_page()
            page.set_default_timeout(60_000)
            nbp = NotebookPage(page, jupyter_lab, path + "?reset").open()  # ?reset: only this notebook open
            nbp.run_cell(0)
            nbp.wait_for_cell(0)
            plot = wait_for_points(nbp, 0, traces=2, points=20)
            assert [t["name"] for t in plot["traces"]] == ["reward", "loss"], (i, plot)
            assert [t["last"] for t in plot["traces"]] == [19, 19], (i, plot)
            assert "waiting for the first step" not in plot["annotations"]
        finally:
            context.close()
            _shutdown_kernels(jupyter_lab)


LOOP = """import math, time
from IPython.display import display
plot = run.plot(["reward", "loss"], title="GRPO (synthetic metrics)")
display(plot)
for step in range(400):
    run.log(step, reward=1 - math.exp(-step / 60) + 0.05 * math.sin(step), loss=math.exp(-step / 80) + 0.02 * math.cos(3 * step))
    time.sleep(0.1)"""


def test_a_reload_mid_run_brings_the_plot_back_and_it_keeps_growing(jupyter_lab, notebook):
    write_notebook(jupyter_lab.root / "reload.ipynb", ["%openrl lease live-reload --rank 2", LOOP])
    nbp = notebook("reload.ipynb")
    nbp.run_cell(0)
    nbp.wait_for_cell(0)
    assert "bound: run" in nbp.output_text(0)
    nbp.run_cell(1)
    before = wait_for_points(nbp, 1, traces=2, points=30)
    # what the README shows
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    nbp.cell(1).locator(".jp-OutputArea").screenshot(path=str(DOCS_IMAGES / "live-plot.png"))
    nbp.cell(1).locator(".cm-content").click()
    nbp.page.keyboard.press("Control+s")  # the page's outputs (the widget view) survive the reload
    nbp.page.wait_for_function("""() => !window.jupyterapp.shell.currentWidget.context.model.dirty""")

    nbp.page.reload()
    nbp.page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
    assert nbp.prompt(1) == "[*]:", "the loop should still be running"
    n = min(t["points"] for t in before["traces"])
    back = wait_for_points(nbp, 1, traces=2, points=n)  # the view comes back with the data so far...
    later = wait_for_points(nbp, 1, traces=2, points=min(t["points"] for t in back["traces"]) + 20)  # ...and grows
    assert nbp.prompt(1) == "[*]:", "the plot came back only after the loop ended"
    assert [t["name"] for t in later["traces"]] == ["reward", "loss"]
    assert not [e for e in nbp.console if "plotly" in e.lower() or "Error displaying widget" in e], nbp.console
    nbp.command("notebook:interrupt-kernel")
    nbp.wait_for_kernel_idle()
    _shutdown_kernels(jupyter_lab)


def _shutdown_kernels(lab) -> None:
    """Kernels of earlier notebooks stop: the machine is small and each holds a CPU-hungry warm-up."""
    for k in lab.api("GET", "api/kernels").json():
        lab.api("DELETE", f"api/kernels/{k['id']}")
