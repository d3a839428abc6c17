"""A Jupyter pre-save hook: a saved notebook never reopens on "Error displaying widget: model not found".

A widget output in a notebook file is only a reference (`application/vnd.jupyter.widget-view+json`, a
model id); the widget itself lives in the kernel. JupyterLab does not save widget state by default, so a
notebook reopened after its kernel is gone (or holding a widget that was closed) shows the error above.

Before each save, for every widget-view output whose model has no saved state, this hook

- adds a tiny saved state for that model id: an ipywidgets `HTML` saying what was there and how to get
  it back (`%openrl plot NAME` for a run's live plot, ...), so a notebook reopened on a new kernel shows the
  note. Only when no kernel runs the notebook (saved after its kernel stopped): while one runs, a page
  reload must get the live widgets back from it, and a saved state under the same id kept them from loading;
- sets the output's `text/plain` to the same note (what nbconvert, GitHub and terminals show).

The widget-view reference itself stays, so the output keeps its place. Registered by the server extension
(`register(serverapp)`), or by hand: `c.FileContentsManager.pre_save_hook =
"openrl_lab.lab.save_hook.pre_save_hook"`.
"""

from __future__ import annotations

import html
import re
from typing import Any

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
_CONTROLS = ("@jupyter-widgets/controls", "2.0.0")  # ipywidgets 8's HTML widget


def describe(plain: str) -> str:
    """One or two sentences for a widget that is not there any more, from its text repr (as displayed: its
    numbers may be stale, so only its kind and name are used)."""
    plain = (plain or "").strip()
    first = plain.splitlines()[0] if plain else ""
    if m := re.match(r"LivePlot '([^']*)'", first):
        title = m.group(1)  # a run's plot is titled with the run's name unless given another title
        name = title if re.fullmatch(r"[\w.-]+", title) else "NAME"
        return (
            f"Live plot {title!r}: not saved in the notebook. `%openrl plot {name}` draws a run's plot again "
            "from the lab, where its metrics stay" + ("." if name != "NAME" else " (NAME: the run's name).")
        )
    if first.startswith("LivePlot"):
        return "A live plot: not saved in the notebook; run its cell again to draw it."
    if m := re.match(r"StopButton '([^']*)'", first):
        return f"A Stop button ({m.group(1)!r}): not saved in the notebook; run its cell again for a new one."
    if first.startswith(("TimelineView", "Timeline")):
        return "A slice timeline: not saved in the notebook; `%openrl timeline` draws it again."
    if first.startswith("LeasePanel"):
        return "A lease table: not saved in the notebook; `%openrl status` shows it again."
    kind = re.match(r"[A-Za-z_][\w.]*", first)
    kind = kind.group(0) if kind else "widget"
    return f"A {kind} widget: its state is not saved in the notebook; run its cell again to show it."


def _note_model(note: str) -> dict:
    body = html.escape(note)
    body = re.sub(r"`([^`]+)`", r"<code>\1</code>", body)
    return {
        "model_name": "HTMLModel",
        "model_module": _CONTROLS[0],
        "model_module_version": _CONTROLS[1],
        "state": {
            "value": f'<div class="openrl-lab-widget-note" style="color: var(--jp-ui-font-color2, '
            f'#666); font-style: italic">{body}</div>'
        },
    }


def _text(value: Any) -> str:
    return "".join(value) if isinstance(value, list) else str(value or "")


def add_widget_fallbacks(nb: dict, saved_state: bool = True) -> int:
    """Adds the fallbacks to a notebook (nbformat 4 dict, in place). Returns how many outputs got one.
    `saved_state=False`: the `text/plain` notes only (while the notebook's kernel runs, see `register`)."""
    meta = nb.setdefault("metadata", {})
    widgets = w if isinstance(w := meta.get("widgets"), dict) else {}
    saved_doc = d if isinstance(d := widgets.get(WIDGET_STATE), dict) else {}
    saved = s if isinstance(s := saved_doc.get("state"), dict) else {}
    added: dict[str, dict] = {}
    for cell in nb.get("cells") or []:
        if cell.get("cell_type") != "code":
            continue
        for out in cell.get("outputs") or []:
            data = out.get("data")
            if not isinstance(data, dict) or not isinstance(data.get(WIDGET_VIEW), dict):
                continue
            model_id = data[WIDGET_VIEW].get("model_id")
            if not model_id or model_id in saved or model_id in added:
                continue  # hidden (a view JupyterLab disposed) or its state is saved
            plain = _text(data.get("text/plain"))
            note = describe(plain)
            added[model_id] = _note_model(note)
            data["text/plain"] = note
    if added and saved_state:
        meta["widgets"] = {
            **widgets,
            WIDGET_STATE: {
                "version_major": saved_doc.get("version_major", 2),
                "version_minor": saved_doc.get("version_minor", 0),
                "state": {**saved, **added},
            },
        }
    return len(added)


def pre_save_hook(model: dict, path: str = "", contents_manager=None, saved_state: bool = True, **kwargs) -> None:
    """jupyter_server's pre-save hook signature (all keywords); `saved_state` as in `add_widget_fallbacks`."""
    if model.get("type") == "notebook" and isinstance(model.get("content"), dict):
        n = add_widget_fallbacks(model["content"], saved_state=saved_state)
        if n and contents_manager is not None:
            contents_manager.log.debug(
                "openrl_lab: %d widget output(s) of %s saved with a note%s",
                n,
                path,
                "" if saved_state else " (text only: its kernel runs)",
            )


def _kernel_running(serverapp, path: str) -> bool:
    """Whether a live kernel session has the notebook at `path` (an API path) open."""
    try:
        rows = serverapp.session_manager.cursor.execute(
            "SELECT kernel_id FROM session WHERE path=?", (path.strip("/"),)
        ).fetchall()
        return any(kernel_id in serverapp.kernel_manager for (kernel_id,) in rows)
    except Exception:  # noqa: BLE001 - an unknown session store: as if none ran
        return False


def register(serverapp) -> None:
    """Adds the hook to the server's contents manager (called by the server extension when it loads).

    While the notebook's kernel runs, only the `text/plain` notes are saved, not the note states: a page
    reloaded mid-run must get the kernel's live widgets back, and with a saved state under the same model id
    JupyterLab 4.6's widget manager left the live plot "Loading widget..." (seen in tests/browser/
    test_live_plot.py). A notebook saved after its kernel stopped gets the states too."""

    def hook(model: dict, path: str = "", contents_manager=None, **kwargs) -> None:
        pre_save_hook(model, path, contents_manager, saved_state=not _kernel_running(serverapp, path))

    serverapp.contents_manager.register_pre_save_hook(hook)
