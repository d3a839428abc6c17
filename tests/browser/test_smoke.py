"""The harness itself: JupyterLab under a JupyterHub-style base URL in Debian's Chromium, a notebook on the
OpenRL kernel runs a cell typed into it, and the OpenRL server extension answers under the base URL."""

from __future__ import annotations

import nbformat


def test_a_typed_cell_runs_on_the_openrl_kernel(jupyter_lab, notebook):
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "openrl", "display_name": "OpenRL (Python 3)", "language": "python"}
    nb.cells.append(nbformat.v4.new_code_cell(""))
    (jupyter_lab.root / "smoke.ipynb").write_text(nbformat.writes(nb))
    nbp = notebook("smoke.ipynb")
    nbp.set_cell_source(0, "import openrl_lab, sys; print('answer', 6 * 7, 'openrl_lab' in sys.modules)")
    nbp.run_cell(0)
    nbp.wait_for_cell(0)
    assert "answer 42 True" in nbp.output_text(0)
    assert nbp.page.url.startswith(f"{jupyter_lab.origin}/user/researcher/lab")


def test_the_server_extension_answers_under_the_base_url(jupyter_lab):
    r = jupyter_lab.api("GET", "openrl/api/connection")
    assert r.status_code == 200, r.text
    assert jupyter_lab.api("GET", "openrl/api/connection", headers={"Authorization": ""}).status_code == 403
