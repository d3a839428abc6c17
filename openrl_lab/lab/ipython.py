"""`%load_ext openrl_lab` (the OpenRL kernelspec loads it): the %openrl magics, the widget control comm answered
while a cell runs, and a background warm-up of slow first imports. The package root's entry point calls
`load_ipython_extension` here."""

from __future__ import annotations


def load_ipython_extension(ipython) -> None:
    """`%load_ext openrl_lab`: the %openrl magics (the OpenRL kernelspec loads this for you), and a background
    warm-up of what the first `%openrl lease` and the first live plot import."""
    from openrl_lab.lab.magics import load_ipython_extension as load

    load(ipython)
    answer_widget_control_while_busy(getattr(ipython, "kernel", None))
    start_warmup()


def answer_widget_control_while_busy(kernel) -> None:
    """The widget manager's control comm (`jupyter.widget.control`: "send me every widget's state") answered by
    ipykernel's shell-channel thread at once, instead of queueing behind a running cell on the main shell.

    A page reloaded mid-run asks for the live widgets' state on the control comm, gives up after 4 s and falls
    back to per-widget requests that wait for the main shell; so the live plot came back only when the loop
    ended (issue 12, item 8). The answer does not need the main thread: it reads the widgets' synced traits
    (LivePlot keeps its state current for this). kernel_info is left to ipykernel: answered here, JupyterLab
    4.6 stopped seeing the kernel's subshells (so a Stop click queued behind the loop again; seen in
    tests/browser). Only for the OpenRL kernel (loaded with --ext, before the kernel starts its streams); a
    kernel without ipykernel 7's shell-channel thread is left as is."""
    if kernel is None or getattr(kernel, "shell_channel_thread", None) is None or getattr(kernel, "io_loop", None):
        return
    original = kernel.shell_channel_thread_main
    control = "jupyter.widget.control"

    def answer_here(msg_type: str, parent: dict) -> bool:
        comms = getattr(kernel, "comm_manager", None)
        if comms is None or msg_type not in ("comm_open", "comm_msg", "comm_close"):
            return False
        content = parent["content"]
        if msg_type == "comm_open":
            return content.get("target_name") == control
        comm = comms.get_comm(content.get("comm_id"))
        return comm is not None and getattr(comm, "target_name", None) == control

    async def shell_channel_thread_main(msg):
        try:
            idents, frames = kernel.session.feed_identities(msg, copy=False)
            header = kernel.session.deserialize(frames, content=False, copy=False)["header"]
            msg_type = header.get("msg_type")
            if header.get("subshell_id") is None and msg_type in ("comm_open", "comm_msg", "comm_close"):
                # a peek (content=False, then unpack) records no signature: a full deserialize here would make
                # ipykernel's own one, for every message passed on below, a "Duplicate Signature" it drops
                peek = kernel.session.deserialize(frames, content=False, copy=False)
                peek["content"] = kernel.session.unpack(peek["content"])
                if answer_here(msg_type, peek):
                    parent = kernel.session.deserialize(frames, content=True, copy=False)
                    getattr(kernel.comm_manager, msg_type)(kernel.shell_stream, idents, parent)
                    return
        except Exception:  # noqa: BLE001 - anything unexpected: ipykernel's own path
            pass
        await original(msg)

    kernel.shell_channel_thread_main = shell_channel_thread_main


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

        go.Figure(
            data=[go.Scatter(x=[0], y=[0], xaxis="x", yaxis="y2"), go.Bar(x=[1], y=["a"], base=[0], orientation="h")],
            layout=dict(annotations=[dict(text="")], yaxis2=dict(domain=[0, 1]), legend=dict(x=0)),
        )
    except Exception:  # noqa: BLE001
        pass


def start_warmup():
    """Starts the warm-up thread once per process (OPENRL_LAB_NO_WARMUP=1 turns it off); returns it."""
    global _warmup  # noqa: PLW0603 - one warm-up thread per process, made on first use
    import threading

    from openrl_lab.settings import settings

    if _warmup is None and not settings().lab_no_warmup:
        _warmup = threading.Thread(target=_warmup_imports, name="openrl-warmup", daemon=True)
        _warmup.start()
    return _warmup
