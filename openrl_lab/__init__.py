"""OpenRL Lab: RL post-training of language models on shared accelerators, spoken through the Tinker API."""

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """`%load_ext openrl_lab`: the %openrl magics (the OpenRL kernelspec loads this for you)."""
    from openrl_lab.lab.magics import load_ipython_extension as load

    load(ipython)


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "openrl_lab"}]


def _load_jupyter_server_extension(serverapp) -> None:
    from openrl_lab.lab.server_extension import _load_jupyter_server_extension as load

    load(serverapp)
