"""What every widget here shows: the live widget where a frontend renders it, its text repr everywhere."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from openrl_lab.lab.widgets import _kernel_guard


def mime_bundle(widget: Any, render: Callable[[], dict], lock: Any = None) -> dict:
    """`render()` (the plotly or ipywidgets bundle, under `lock` if given) plus `text/plain` = repr(widget), so
    nbval and terminals get the plain-text repr; a closed widget has only that."""
    if widget._closed:
        return {"text/plain": repr(widget)}
    # Displayed widgets bring comm traffic on subshells (JupyterLab 4.4+): keep the kernel's status right.
    _kernel_guard.install()
    with lock if lock is not None else contextlib.nullcontext():
        bundle = dict(render())
    bundle["text/plain"] = repr(widget)
    return bundle
