"""`StopButton`: lets a notebook loop stop at its next step boundary."""

from __future__ import annotations

import threading

import ipywidgets

class StopButton(ipywidgets.Button):
    """A button that asks a loop to stop at its next step boundary: `if stop.should_stop(): break`.

    Clicking only sets a flag (a threading.Event), so the loop decides where it is safe to stop. Clicks
    arrive while a cell is still running with ipykernel >= 7 and JupyterLab's `commsOverSubshells` setting
    (the comm message is handled on a subshell); with older kernels or frontends the click is queued until
    the cell ends. `reset()` re-arms it.
    """

    def __init__(self, description: str = "Stop", **kwargs):
        kwargs.setdefault("button_style", "danger")
        kwargs.setdefault("icon", "stop")
        kwargs.setdefault("tooltip", "stop the loop at its next step")
        super().__init__(description=description, **kwargs)
        self._label = description
        self._event = threading.Event()
        self.on_click(lambda _button: self.stop())

    def stop(self) -> None:
        """What a click does; also callable from code."""
        self._event.set()
        if self.comm is not None:  # a closed widget has no comm; the flag still works
            self.description = "Stopping…"
            self.disabled = True

    @property
    def stopped(self) -> bool:
        return self._event.is_set()

    def should_stop(self) -> bool:
        return self._event.is_set()

    def reset(self) -> None:
        self._event.clear()
        if self.comm is not None:
            self.description = self._label
            self.disabled = False

    def __repr__(self) -> str:
        return f"StopButton {self._label!r}: {'stopped' if self.stopped else 'not stopped'}"
