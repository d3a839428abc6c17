"""What a test reads off a rendered plotly plot in the page: its traces and points as plotly.js holds them
(`gd.data` of the graph div, what it draws), and its drawn line paths."""

from __future__ import annotations

import nbformat

# The graph divs of one cell's outputs, each as {traces: [{name, points}], lines: number of drawn line paths
# with a non-trivial `d`}.
_READ = """(cell) => Array.from(cell.querySelectorAll('.js-plotly-plot')).map(gd => ({
    traces: (gd.data || []).map(t => ({name: t.name, points: t.x ? t.x.length : 0,
                                       last: t.x && t.x.length ? Number(t.x[t.x.length - 1]) : null})),
    lines: Array.from(gd.querySelectorAll('.scatterlayer .js-line'))
        .filter(p => (p.getAttribute('d') || '').length > 10).length,
    annotations: Array.from(gd.querySelectorAll('.annotation-text')).map(a => a.textContent),
}))"""


def plots_in(nbp, index: int) -> list[dict]:
    """The plotly plots rendered in cell `index`'s outputs (see _READ)."""
    return nbp.cell(index).evaluate(_READ)


def wait_for_points(nbp, index: int, traces: int, points: int, timeout: float = 60_000) -> dict:
    """Until cell `index` shows a plot with `traces` traces of at least `points` points each, all drawn; that plot.
    (A wait for convergence, not a timing: the timeout only bounds a broken run.)"""
    nbp.page.wait_for_function(
        f"""([cell, traces, points]) => ({_READ})(cell).some(p => p.traces.length === traces
            && p.traces.every(t => t.points >= points) && p.lines >= traces)""",
        arg=[nbp.cell(index).element_handle(), traces, points],
        timeout=timeout,
    )
    return next(p for p in plots_in(nbp, index) if len(p["traces"]) == traces)


def write_notebook(path, sources: list[str]) -> None:
    """A notebook on the OpenRL kernel with these code cells."""
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "openrl", "display_name": "OpenRL (Python 3)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    path.write_text(nbformat.writes(nb))
