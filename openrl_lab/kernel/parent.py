"""A kernel that a control plane started goes when its control plane goes, even by SIGKILL (standard library
only: `python -m openrl_lab.kernel` starts the watch before it imports torch, so a kernel the fleet is still
restarting when its control plane stops does not outlive it)."""

from __future__ import annotations

import os
import threading
import time

_started = False


def exit_with_parent(every_s: float = 0.5) -> None:
    """Starts (once) a thread that exits this process as soon as its parent is gone."""
    global _started  # noqa: PLW0603 - one watch per process
    if _started:
        return
    _started = True
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
