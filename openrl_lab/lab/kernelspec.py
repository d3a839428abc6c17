"""The "OpenRL (Python 3)" Jupyter kernel: ipykernel with the `openrl_lab` IPython extension preloaded.

The spec is the one in `kernels/openrl/kernel.json` (shipped as a data file, argv starting with `python`,
which jupyter_client replaces with its own interpreter); `install_kernelspec` writes it with this
interpreter's path instead, so the kernel runs in this environment whichever Jupyter starts it.

    openrl-lab install-kernelspec [--user | --sys-prefix | --prefix P] [--name N]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

DISPLAY_NAME = "OpenRL (Python 3)"
KERNEL_NAME = "openrl"


def kernel_dict(executable: str | None = None) -> dict:
    """The kernel.json contents; argv runs `ipykernel_launcher` with `--ext=openrl_lab` (IPKernelApp's alias
    for `InteractiveShellApp.extra_extensions`: the extension is loaded before the first cell)."""
    return {
        "argv": [
            executable or sys.executable,
            "-m",
            "ipykernel_launcher",
            "-f",
            "{connection_file}",
            "--ext=openrl_lab",
        ],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": True, "openrl_lab": {"extension": "openrl_lab"}},
        "kernel_protocol_version": "5.5",
    }


def install_kernelspec(user: bool = True, prefix: str | Path | None = None, name: str = KERNEL_NAME) -> Path:
    """Installs the kernelspec (argv with this `sys.executable`) and returns its directory.

    `prefix` (e.g. `sys.prefix`) installs into `<prefix>/share/jupyter/kernels/<name>` and wins over `user`;
    `user=True` into the per-user Jupyter data dir; otherwise the system-wide one.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / name
        src.mkdir()
        (src / "kernel.json").write_text(json.dumps(kernel_dict(), indent=1) + "\n")
        try:  # ipykernel's Python logos, as the stock python3 kernel has
            from ipykernel.kernelspec import RESOURCES

            for logo in Path(RESOURCES).iterdir():
                if logo.name.startswith("logo-"):
                    shutil.copy(logo, src / logo.name)
        except (ImportError, OSError):
            pass
        # (an existing spec of that name is replaced)
        dest = KernelSpecManager().install_kernel_spec(
            str(src), name, user=bool(user) and prefix is None, prefix=str(prefix) if prefix else None
        )
    return Path(dest)
