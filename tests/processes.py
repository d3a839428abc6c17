"""The processes a test's control plane started, found without racing them.

`openrl-lab serve` starts more than its kernels: `bwrap --version` when it probes the sandbox, warm sandboxes.
Those come and go while a test looks, so a child that ends between being listed and being read is skipped, not
an error (psutil raises NoSuchProcess for it; a zombie is one whose kernel was killed and not yet reaped).
"""

from __future__ import annotations

import psutil


def lab_kernels(lab, group: str | None = None) -> list[psutil.Process]:
    """The live kernel processes the control plane `lab` (a `LabServer`) started, of `group` if given."""
    found = []
    for child in psutil.Process(lab.proc.pid).children():
        try:
            cmd = child.cmdline()
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:  # ended while we looked: not a kernel we can use
            continue
        if "openrl_lab.kernel" not in cmd:
            continue
        if group is None or ("--group" in cmd and cmd[cmd.index("--group") + 1] == group):
            found.append(child)
    return found
