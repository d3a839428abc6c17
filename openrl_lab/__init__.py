"""OpenRL Lab: RL post-training of language models on shared accelerators, spoken through the Tinker API."""

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """`%load_ext openrl_lab`: the %openrl magics (the OpenRL kernelspec loads this for you), and a background
    warm-up of what the first `%openrl lease` and the first live plot import."""
    from openrl_lab.lab.magics import load_ipython_extension as load

    load(ipython)
    _start_warmup()


_warmup = None


def _warmup_imports() -> None:
    """Imports that cost seconds the first time, done ahead (measured in docs/benchmarks.md, "Notebook latency"):
    plotly's FigureWidget imports nbformat -> jsonschema -> rfc3987_syntax, which compiles Lark grammars at import
    (1-8 s, most of the first plot's wait); `tinker` imports torch through its tensor types (3-5 s of the first
    `%openrl lease`). A cell that needs a module meanwhile waits on the import lock for the rest of the import
    rather than starting it again. Nothing here opens a comm or talks to a server."""
    import importlib

    for name in ("plotly.graph_objs._figurewidget", "openrl_lab.lab.widgets", "tinker"):
        try:
            importlib.import_module(name)
            if name == "openrl_lab.lab.widgets":
                from openrl_lab.lab.widgets._figure import figure_class

                figure_class()  # reads plotly's 5 MB widget module once
        except Exception:  # noqa: BLE001 - a warm-up only: the real import reports the error where it matters
            pass
    try:  # plotly's validators for what a LivePlot draws are imported on first use
        import plotly.graph_objects as go

        go.Figure(data=[go.Scatter(x=[0], y=[0], xaxis="x", yaxis="y2"), go.Bar(x=[1], y=["a"], base=[0],
                                                                             orientation="h")],
                  layout=dict(annotations=[dict(text="")], yaxis2=dict(domain=[0, 1]), legend=dict(x=0)))
    except Exception:  # noqa: BLE001
        pass


def _start_warmup():
    """Starts the warm-up thread once per process (OPENRL_LAB_NO_WARMUP=1 turns it off); returns it."""
    global _warmup
    import os
    import threading

    if _warmup is None and os.environ.get("OPENRL_LAB_NO_WARMUP", "") in ("", "0"):
        _warmup = threading.Thread(target=_warmup_imports, name="openrl-warmup", daemon=True)
        _warmup.start()
    return _warmup


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "openrl_lab"}]


def _load_jupyter_server_extension(serverapp) -> None:
    from openrl_lab.lab.server_extension import _load_jupyter_server_extension as load

    load(serverapp)
