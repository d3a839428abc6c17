"""OpenRL Lab: RL post-training of language models on shared accelerators, spoken through the Tinker API.

The package root holds only the entry points Jupyter looks up by the package's name (`%load_ext openrl_lab`, the
`openrl_lab` server extension), each a call into the notebook layer (openrl_lab/lab/). Nothing in the package
imports the root: the layers below never depend on the notebook layer (tests/test_layering.py).
"""

from openrl_lab.version import __version__


def load_ipython_extension(ipython) -> None:
    """`%load_ext openrl_lab`: the %openrl magics (the OpenRL kernelspec loads this for you)."""
    from openrl_lab.lab.ipython import load_ipython_extension as load

    load(ipython)


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "openrl_lab"}]


def _load_jupyter_server_extension(serverapp) -> None:
    from openrl_lab.lab.server_extension import _load_jupyter_server_extension as load

    load(serverapp)


__all__ = ["__version__", "load_ipython_extension"]
