"""Processes a test started, found without racing them.

`openrl-lab serve` starts more than its kernels: `bwrap --version` when it probes the sandbox, warm sandboxes.
Those come and go while a test looks, so a child that ends between being listed and being read is skipped, not
an error (psutil raises NoSuchProcess for it); a zombie (killed, not yet reaped) counts as gone.
"""

from __future__ import annotations

import psutil


def live_children(pid: int, recursive: bool = False) -> list[tuple[psutil.Process, list[str]]]:
    """The children of `pid` that are alive while we look, each with its command line."""
    found = []
    for child in psutil.Process(pid).children(recursive=recursive):
        try:
            cmd = child.cmdline()
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append((child, cmd))
        except psutil.Error:  # ended while we looked
            continue
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def lab_kernels(lab, group: str | None = None) -> list[psutil.Process]:
    """The live kernel processes the control plane `lab` (a `LabServer`) started, of `group` if given."""
    return [
        child
        for child, cmd in live_children(lab.proc.pid)
        if "openrl_lab.kernel" in cmd and (group is None or _option(cmd, "--group") == group)
    ]


def _option(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd[:-1] else None


def describe(pid: int) -> str:
    """`pid`'s command line, or that it has ended, for a failure message."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return f"pid {pid} (ended)"
