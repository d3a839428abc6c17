"""The timeline Gantt as rendered in JupyterLab (issue 12, item 6): nothing overlaps, it is as wide as the
notebook and as tall as its rows, the recent interleaved slices fill the plot, and an empty timeline says so."""

from __future__ import annotations

from tests.browser.jupyterlab import screenshot_dir
from tests.browser.plot_helpers import write_notebook

# Notebook 03's pattern: an older job a minute earlier, then two leases interleaving short phases.
SLICES = """import time
import pandas as pd
from IPython.display import display
from openrl_lab.lab.widgets import TimelineView
now = time.time()
rows = [dict(group_id="trainer-group", job="warm-up", kind="train", started_at=now - 90, run_s=20.0, wait_s=0.0,
             switch_s=0.0)]
for i in range(24):
    rows.append(dict(group_id="trainer-group", job="slice-a" if i % 2 else "slice-b",
                     kind="train" if i % 3 else "sample", started_at=now - 24 + i, run_s=0.8, wait_s=0.2,
                     switch_s=0.15))
view = TimelineView(pd.DataFrame(rows), window_s=120)
display(view)"""

EMPTY = """view2 = TimelineView(window_s=120)
display(view2)"""

# Boxes (page coordinates) of the parts of each rendered plot in a cell.
_GEOMETRY = """(cell) => Array.from(cell.querySelectorAll('.js-plotly-plot')).map(gd => {
    const box = (sel) => { const e = gd.querySelector(sel); if (!e) return null;
        const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, w: r.width, h: r.height}; };
    const bars = Array.from(gd.querySelectorAll('.barlayer .point path')).map(p => p.getBoundingClientRect())
        .filter(r => r.width > 0);
    return {plot: box('.main-svg'), area: box('.bglayer .bg') || box('.nsewdrag'), legend: box('.legend'),
            xtitle: box('.g-xtitle'), title: box('.g-gtitle'), modebar: box('.modebar-container .modebar'),
            output: (() => { const r = gd.closest('.jp-OutputArea-output').getBoundingClientRect();
                             return {x: r.x, y: r.y, w: r.width, h: r.height}; })(),
            bars_left: bars.length ? Math.min(...bars.map(r => r.x)) : null,
            bars_right: bars.length ? Math.max(...bars.map(r => r.right)) : null,
            xtitle_text: (gd.querySelector('.g-xtitle') || {}).textContent || '',
            notes: Array.from(gd.querySelectorAll('.annotation-text')).map(a => a.textContent)};
})"""


def _overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"] and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]
    )


def test_timeline_is_readable(jupyter_lab, notebook):
    write_notebook(jupyter_lab.root / "timeline.ipynb", [SLICES, EMPTY])
    nbp = notebook("timeline.ipynb")
    nbp.run_cell(0)
    nbp.wait_for_cell(0)
    cell = nbp.cell(0).element_handle()
    nbp.page.wait_for_function("cell => cell.querySelectorAll('.barlayer .point path').length >= 20", arg=cell)
    nbp.cell(0).locator(".js-plotly-plot .nsewdrag").first.hover()  # the modebar shows on hover
    nbp.page.wait_for_function("cell => !!cell.querySelector('.modebar-container .modebar')", arg=cell)
    g = nbp.cell(0).evaluate(_GEOMETRY)[0]

    assert not _overlap(g["legend"], g["xtitle"]), g
    assert not _overlap(g["legend"], g["area"]), g
    assert not _overlap(g["modebar"], g["title"]), g
    assert not _overlap(g["modebar"], g["legend"]), g
    assert g["plot"]["w"] >= 0.95 * g["output"]["w"], g  # as wide as the notebook's output area
    assert g["plot"]["h"] == 100 + 50 + 36 * 2  # two rows: slice-a and slice-b, the old job is out of range
    # the interleaved slices fill the plot rather than its last few seconds
    assert g["bars_right"] - g["bars_left"] >= 0.8 * g["area"]["w"], g
    assert g["xtitle_text"].startswith("seconds before ")
    nbp.page.mouse.move(0, 0)
    nbp.cell(0).locator(".jp-OutputArea").screenshot(path=str(screenshot_dir() / "timeline.png"))

    nbp.run_cell(1)
    nbp.wait_for_cell(1)
    nbp.page.wait_for_function(
        "cell => cell.querySelectorAll('.annotation-text').length > 0", arg=nbp.cell(1).element_handle()
    )
    e = nbp.cell(1).evaluate(_GEOMETRY)[0]
    assert e["notes"] == ["no slices in the last 120 s: phases show here as they run"]
    assert e["xtitle_text"] == "seconds before now"
