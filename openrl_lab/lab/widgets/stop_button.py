"""`StopButton`: lets a notebook loop stop at its next step boundary."""

from __future__ import annotations

import threading
import uuid

import ipywidgets

from openrl_lab.lab.widgets import _kernel_guard


def _keep_frontend_route(_data, default):
    # ipykernel 7.4 routes a comm_msg to the subshell that last *published* on that comm
    # (`BaseComm._reply_subshell_for`), not to the one the frontend chose. A button displayed by a cell has
    # published from the main shell, so its clicks were queued behind the very loop they should stop.
    # Returning `default` (the subshell in the message's header: JupyterLab's per-comm-target subshell, or
    # the main shell where the frontend has no subshells) lets the click run while the cell is busy.
    return default


class StopButton(ipywidgets.Button):
    """A button that asks a loop to stop at its next step boundary: `if stop.should_stop(): break`.

    Clicking only sets a flag (a threading.Event), so the loop decides where it is safe to stop. A click
    reaches a running cell with ipykernel >= 7 and JupyterLab 4.4+ (comms over subshells, on by default):
    the click is handled on the subshell JupyterLab sends it to, not queued behind the cell. With older
    kernels or frontends it waits until the cell ends. `reset()` re-arms it; `done()` (or `close()`) leaves
    it disabled, reading "Done" (or "Stopped" after a stop).
    """

    def __init__(self, description: str = "Stop", **kwargs):
        kwargs.setdefault("button_style", "danger")
        kwargs.setdefault("icon", "stop")
        kwargs.setdefault("tooltip", "stop the loop at its next step")
        super().__init__(description=description, **kwargs)
        self._label = description
        self._event = threading.Event()
        self._finished = False
        self._display_id: str | None = None
        self._route_clicks_as_sent()
        _kernel_guard.install()  # a click handled on a subshell must not make a busy kernel read "Idle"
        self.on_click(lambda _button: self.stop())

    def _route_clicks_as_sent(self) -> None:
        comm = self.comm
        if comm is not None and hasattr(comm, "_reply_subshell_for"):  # ipykernel >= 7.4's comms only
            comm._reply_subshell_for = _keep_frontend_route

    def open(self) -> None:
        super().open()
        if getattr(self, "_event", None) is not None:  # a re-opened comm is a new object
            self._route_clicks_as_sent()

    def stop(self) -> None:
        """What a click does; also callable from code."""
        self._event.set()
        if self.comm is not None and not self._finished:  # a closed widget has no comm; the flag still works
            self.description = "Stopping…"
            self.disabled = True
            self.button_style = "warning"

    @property
    def stopped(self) -> bool:
        return self._event.is_set()

    def should_stop(self) -> bool:
        return self._event.is_set()

    def reset(self) -> None:
        """Re-arms the button for another loop."""
        self._event.clear()
        self._finished = False
        if self.comm is not None:
            self.description = self._label
            self.disabled = False
            self.button_style = "danger"
            self.icon = "stop"

    def done(self) -> None:
        """The loop is over: the button stays on the page, disabled, reading "Stopped" or "Done", so it no
        longer looks like something to click. `close()` does this first."""
        self._finished = True
        if self.comm is not None:
            self.description = "Stopped" if self.stopped else "Done"
            self.disabled = True
            self.button_style = ""
            self.icon = "stop" if self.stopped else "check"

    def _ipython_display_(self, **kwargs) -> None:
        # Displayed under a display id, so close() can swap every view of it for plain text: a saved notebook
        # then holds no reference to a closed model ("Error displaying widget: model not found" on reload).
        from IPython.display import display

        if self.comm is None:
            display({"text/plain": repr(self)}, raw=True)
            return
        self._display_id = self._display_id or uuid.uuid4().hex
        display(self._repr_mimebundle_(**kwargs), raw=True, display_id=self._display_id)

    def close(self) -> None:
        """done(), then the widget's views become plain text and its comm closes (the flag still works)."""
        if self.comm is not None:
            self.done()
            if self._display_id is not None:
                from IPython.display import update_display

                update_display({"text/plain": f"{self!r} (closed)"}, raw=True, display_id=self._display_id)
        super().close()

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else ("done" if self._finished else "not stopped")
        return f"StopButton {self._label!r}: {state}"
