"""The pre-save hook in a real jupyter_server (pytest-jupyter, with the OpenRL server extension loaded): a
notebook saved with widget outputs whose state is not saved reopens on a note, never on "model not found"."""

from __future__ import annotations

import json

import nbformat
import pytest
from traitlets.config import Config

from openrl_lab.lab.save_hook import WIDGET_STATE, WIDGET_VIEW, add_widget_fallbacks, describe


@pytest.fixture(autouse=True)
def _no_lab_env(monkeypatch):
    for var in ("OPENRL_LAB_URL", "OPENRL_LAB_API_KEY", "TINKER_API_KEY", "OPENRL_LAB_HOME"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def jp_server_config(tmp_path):
    return Config(
        {
            "ServerApp": {"jpserver_extensions": {"openrl_lab": True}},
            "OpenRLLab": {"home": str(tmp_path / "no-lab-here")},
        }
    )


def _widget_output(model_id: str, plain: str) -> dict:
    return nbformat.v4.new_output(
        "display_data",
        data={WIDGET_VIEW: {"version_major": 2, "version_minor": 0, "model_id": model_id}, "text/plain": plain},
    )


def _notebook() -> dict:
    nb = nbformat.v4.new_notebook()
    nb.metadata.kernelspec = {"name": "openrl", "display_name": "OpenRL (Python 3)", "language": "python"}
    plot = nbformat.v4.new_code_cell("plot = run.plot()\nplot", execution_count=1)
    plot.outputs = [_widget_output("a" * 32, "LivePlot 'grpo' 30 steps: reward=0.9 loss=0.1")]
    kept = nbformat.v4.new_code_cell("slider", execution_count=2)
    kept.outputs = [_widget_output("b" * 32, "IntSlider(value=3)")]
    text = nbformat.v4.new_code_cell("print('hi')", execution_count=3)
    text.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    nb.cells = [plot, kept, text]
    nb.metadata["widgets"] = {
        WIDGET_STATE: {
            "version_major": 2,
            "version_minor": 0,
            "state": {
                "b" * 32: {
                    "model_name": "IntSliderModel",
                    "model_module": "@jupyter-widgets/controls",
                    "model_module_version": "2.0.0",
                    "state": {"value": 3},
                }
            },
        }
    }
    return json.loads(nbformat.writes(nb))


async def test_a_saved_widget_output_without_state_gets_a_note_and_the_rest_is_untouched(jp_fetch, jp_root_dir):
    nb = _notebook()
    r = await jp_fetch(
        "api",
        "contents",
        "run.ipynb",
        method="PUT",
        body=json.dumps({"type": "notebook", "format": "json", "content": nb}),
    )
    assert r.code in (200, 201)
    on_disk = json.loads((jp_root_dir / "run.ipynb").read_text())
    state = on_disk["metadata"]["widgets"][WIDGET_STATE]["state"]
    note = state["a" * 32]
    assert note["model_name"] == "HTMLModel" and note["model_module"] == "@jupyter-widgets/controls"
    assert "<code>%openrl plot grpo</code>" in note["state"]["value"]
    assert "Live plot &#x27;grpo&#x27;: not saved in the notebook" in note["state"]["value"]
    assert state["b" * 32] == nb["metadata"]["widgets"][WIDGET_STATE]["state"]["b" * 32], "saved state is kept"
    plot_out = on_disk["cells"][0]["outputs"][0]["data"]
    assert plot_out[WIDGET_VIEW]["model_id"] == "a" * 32, "the reference stays: a reload with a live kernel"
    assert "%openrl plot grpo" in "".join(plot_out["text/plain"])
    assert on_disk["cells"][1]["outputs"][0]["data"]["text/plain"] in ("IntSlider(value=3)", ["IntSlider(value=3)"])
    assert on_disk["cells"][2]["outputs"] == nb["cells"][2]["outputs"]
    nbformat.validate(nbformat.reads(json.dumps(on_disk), as_version=4))


async def test_a_notebook_without_widget_outputs_is_saved_as_sent(jp_fetch, jp_root_dir):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("1 + 1")]
    sent = json.loads(nbformat.writes(nb))
    r = await jp_fetch(
        "api",
        "contents",
        "plain.ipynb",
        method="PUT",
        body=json.dumps({"type": "notebook", "format": "json", "content": sent}),
    )
    assert r.code in (200, 201)
    assert "widgets" not in json.loads((jp_root_dir / "plain.ipynb").read_text())["metadata"]


def test_the_notes_say_how_to_get_each_widget_back():
    assert "`%openrl plot grpo`" in describe("LivePlot 'grpo' 3 steps: reward=1")
    assert (
        "`%openrl plot NAME` draws a run's plot again from the lab, where its metrics stay (NAME: the run's "
        "name)" in describe("LivePlot 'GRPO on copy' 30 steps")
    )
    assert "run its cell again" in describe("StopButton 'Stop': stopped") and "stopped" not in describe(
        "StopButton 'Stop': stopped"
    ), "the repr as displayed may be stale: not repeated"
    assert "`%openrl timeline`" in describe("TimelineView default: 3 slices")
    assert "`%openrl status`" in describe("LeasePanel: no leases")
    assert "FigureWidget widget" in describe("FigureWidget({'data': []})")
    nb = _notebook()
    assert add_widget_fallbacks(nb) == 1 and add_widget_fallbacks(nb) == 0, "idempotent"
