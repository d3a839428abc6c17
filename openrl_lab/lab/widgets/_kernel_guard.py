"""Keeps the kernel's busy/idle status honest when widget messages are handled on subshells (ipykernel >= 7).

JupyterLab 4.4+ sends comm messages on a subshell (`commsOverSubshells`, default per comm target), so a
widget click (the Stop button) runs while a cell is busy. Two things then go wrong in ipykernel 7.4 with
JupyterLab 4.6, and this module fixes both in the running kernel:

1. Status. A subshell handling a comm message publishes busy then idle, parented to that comm message.
   JupyterLab keeps one status per kernel and takes the latest status message whoever sent it, so the
   toolbar reads "Idle" for the rest of a running cell (and jupyter_server's `execution_state`, which
   culling reads, says idle too). After a subshell's idle, while the main shell is busy, we publish busy
   again, parented to the main shell's request: the toolbar reads Busy, and every future still gets its idle.
2. Parent leak. `Kernel.set_parent` also stores the calling thread's context as the fallback for threads
   that have none (`_shell_context`: how output from a user's thread finds its cell). A subshell calling it
   left background threads publishing as children of a comm message: a training thread's print vanished
   (seen in the browser), and comm messages from LivePlot's flusher recorded that subshell as the route for
   the plot's replies (plotly answers updates), each one another busy/idle pair there. Subshells now leave
   the fallback as the main shell set it.

`install()` is idempotent and a no-op outside an ipykernel with subshells (or with $OPENRL_LAB_NO_STATUS_GUARD set).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from openrl_lab.settings import settings

_lock = threading.Lock()


def install(kernel=None) -> bool:
    """Patches the running kernel (once). Returns whether the guard is active."""

    if settings().lab_no_status_guard:  # an escape hatch: leave ipykernel exactly as it is
        return False
    if kernel is None:
        try:
            from ipykernel.kernelbase import Kernel

            if not Kernel.initialized():
                return False
            kernel = Kernel.instance()
        except Exception:  # noqa: BLE001 - not in an ipykernel
            return False
    with _lock:
        if getattr(kernel, "_openrl_status_guard", False):
            return True
        scthread = getattr(kernel, "shell_channel_thread", None)
        if not getattr(kernel, "_supports_kernel_subshells", False) or scthread is None:
            return False
        if not all(hasattr(kernel, a) for a in ("_publish_status", "set_parent", "_shell_context", "get_parent")):
            return False  # an ipykernel whose internals we do not know: leave it alone
        main = getattr(scthread, "parent_thread", None) or threading.main_thread()
        publish, set_parent = kernel._publish_status, kernel.set_parent
        status_lock = threading.Lock()
        main_busy = {"parent": None}  # the main shell's request while it is busy
        if threading.current_thread() is main:  # installed by a running cell (a widget displayed): busy already
            main_busy["parent"] = kernel.get_parent("shell") or None

        def _publish_status(status, channel, parent=None):
            if channel != "shell":
                return publish(status, channel, parent)
            with status_lock:  # one order on IOPub for the main shell's and the subshells' statuses
                publish(status, channel, parent)
                if threading.current_thread() is main:
                    main_busy["parent"] = (parent or kernel.get_parent("shell")) if status == "busy" else None
                elif status == "idle" and main_busy["parent"] is not None:
                    publish("busy", channel, main_busy["parent"])
            return None

        def _set_parent(ident, parent, channel="shell"):
            if channel != "shell" or threading.current_thread() is main:
                return set_parent(ident, parent, channel)
            # the subshell's own context vars still get its parent; the process-wide fallbacks keep the main's
            shell = getattr(kernel, "shell", None)
            holders: list[Any] = [  # those of them that have the attribute (hasattr)
                o
                for o in (
                    shell,
                    getattr(shell, "displayhook", None),
                    getattr(shell, "display_pub", None),
                    sys.stdout,
                    sys.stderr,
                )
                if hasattr(o, "_parent_header_global")
            ]
            saved = kernel._shell_context, [o._parent_header_global for o in holders]
            try:
                return set_parent(ident, parent, channel)
            finally:
                kernel._shell_context = saved[0]
                for o, header in zip(holders, saved[1]):
                    o._parent_header_global = header

        kernel._publish_status = _publish_status
        kernel.set_parent = _set_parent
        kernel._openrl_status_guard = True
        return True
