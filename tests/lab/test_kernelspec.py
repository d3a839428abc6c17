"""The "OpenRL (Python 3)" kernelspec: installed into a prefix, found by jupyter_client, and a real kernel
started from it has the `openrl_lab` IPython extension loaded (ipykernel's `--ext`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

from openrl_lab.lab.kernelspec import install_kernelspec, kernel_dict
from tests.lab.helpers import run_in_kernel

ROOT = Path(__file__).resolve().parents[2]


def test_the_shipped_kernel_json_is_the_one_the_code_writes():
    shipped = json.loads((ROOT / "kernels" / "openrl" / "kernel.json").read_text())
    assert shipped == kernel_dict("python")  # jupyter_client runs "python" as its own interpreter
    assert shipped["display_name"] == "OpenRL (Python 3)" and "--ext=openrl_lab" in shipped["argv"]


@pytest.mark.server  # runs the CLI or a kernel
def test_install_into_a_prefix_then_a_started_kernel_has_the_extension_loaded(tmp_path, monkeypatch):
    prefix = tmp_path / "prefix"
    path = install_kernelspec(user=False, prefix=prefix)
    assert path == prefix / "share" / "jupyter" / "kernels" / "openrl"
    assert (path / "logo-64x64.png").exists()
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))  # no per-user kernels in the way
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("OPENRL_LAB_HOME", str(tmp_path / "lab-home"))
    ksm = KernelSpecManager()
    assert Path(ksm.find_kernel_specs()["openrl"]) == path
    spec = ksm.get_kernel_spec("openrl")
    assert spec.display_name == "OpenRL (Python 3)" and spec.language == "python"
    assert spec.argv[0] == sys.executable and spec.argv[1:3] == ["-m", "ipykernel_launcher"]
    assert "--ext=openrl_lab" in spec.argv

    km = KernelManager(kernel_name="openrl", kernel_spec_manager=ksm)
    km.start_kernel()
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=180)
        code = (
            "import sys, json; ip = get_ipython(); "
            "print(json.dumps({'loaded': sorted(ip.extension_manager.loaded), 'exe': sys.executable}))"
        )
        out = run_in_kernel(kc, code)
        seen = json.loads(out.strip().splitlines()[-1])
        assert seen["exe"] == sys.executable
        assert "openrl_lab" in seen["loaded"], out
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)


@pytest.mark.server  # runs the CLI or a kernel
def test_the_cli_installs_under_a_name_into_a_prefix(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "openrl_lab.cli",
            "install-kernelspec",
            "--prefix",
            str(tmp_path),
            "--name",
            "openrl-test",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = tmp_path / "share" / "jupyter" / "kernels" / "openrl-test"
    assert str(path) in out
    spec = json.loads((path / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable and spec["display_name"] == "OpenRL (Python 3)"
    bad = subprocess.run(
        [sys.executable, "-m", "openrl_lab.cli", "install-kernelspec", "--user", "--sys-prefix"],
        check=False,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "not allowed with" in bad.stderr
