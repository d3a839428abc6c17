"""The wheel is what a user installs: a plain `pip install` of it must leave JupyterLab with the sidebar
(labextension/, shipped prebuilt under share/jupyter/labextensions/openrl-lab-labextension) and the server
extension enabled (etc/jupyter/jupyter_server_config.d/openrl_lab.json) — as `jupyter labextension list` and
`jupyter server extension list` report them.

The wheel is built as a user builds it (`pip wheel --no-deps .`: hatchling, whose jupyter-builder hook runs
`jlpm build:prod` in labextension/ unless labextension/dist is built already, which it then reuses) and
installed into a fresh environment: a new venv whose only link to this one is a .pth line naming this venv's
site-packages (so the dependencies need no download, while `openrl_lab` and the data files come from the wheel
into the fresh prefix — checked, not assumed). Jupyter's user-level paths point into the test's tmp dir, so
nothing installed elsewhere can make it pass.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.server  # starts pip wheel and jupyter in subprocesses

REPO = Path(__file__).resolve().parents[2]
NPM_NAME = "openrl-lab-labextension"


def _run(cmd: list, env: dict | None = None, timeout: float = 600, cwd: Path | None = None) -> str:
    r = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    out = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)  # no colours
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if not (REPO / "labextension" / "dist" / "static" / "style.js").exists() and shutil.which("node") is None:
        pytest.fail(
            "labextension/ is not built and node is not on PATH: building the wheel needs node (the build "
            "hook runs `jlpm build:prod`); install node >= 20, or build labextension/ elsewhere first"
        )
    out = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # jlpm, if the hook builds
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check", "-w", out, REPO],
        env=env,
    )
    wheels = list(out.glob("openrl_lab-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def fresh_env(wheel, tmp_path_factory):
    """(python, prefix, env vars, tmp): a new venv with the wheel pip-installed into it."""
    tmp = tmp_path_factory.mktemp("fresh")
    prefix = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", "--without-pip", prefix])
    python = prefix / "bin" / "python"
    purelib = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    # this venv's site-packages as plain sys.path entries (their .pth files are not processed: the editable
    # openrl_lab of the development install stays invisible)
    ours = [p for p in dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]]) if Path(p).is_dir()]
    (purelib / "_openrl_test_deps.pth").write_text("\n".join(ours) + "\n")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "JUPYTER_PATH", "JUPYTER_CONFIG_PATH", "VIRTUAL_ENV", "PYTHONHOME")
    }
    env |= {
        "JUPYTER_CONFIG_DIR": str(tmp / "user-config"),
        "JUPYTER_DATA_DIR": str(tmp / "user-data"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "JUPYTER_PLATFORM_DIRS": "0",
        "HOME": str(tmp / "home"),
        "PATH": f"{prefix / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    # a plain pip install of the wheel (its dependencies are there already, through the .pth)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--no-deps",
            "-q",
            "--disable-pip-version-check",
            wheel,
        ],
        env=env,
    )
    # (run from tmp: from the repository, `python -c` would import its openrl_lab)
    where = _run(
        [python, "-c", "import openrl_lab, sys; print(openrl_lab.__file__); print(sys.prefix)"], env=env, cwd=tmp
    )
    module_file, sys_prefix = where.strip().splitlines()[-2:]
    assert Path(module_file).is_relative_to(prefix), f"openrl_lab imported from {module_file}, not the fresh venv"
    assert Path(sys_prefix) == prefix
    return python, prefix, env, tmp


def test_wheel_ships_the_prebuilt_labextension_and_the_configs(wheel):
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    data = "openrl_lab-0.1.0.data/data/"
    ext = f"{data}share/jupyter/labextensions/{NPM_NAME}/"
    for f in ("package.json", "install.json", "static/style.js"):
        assert ext + f in names, f"{ext + f} missing from {wheel.name}"
    assert any(n.startswith(ext + "static/remoteEntry.") for n in names)
    assert f"{data}etc/jupyter/jupyter_server_config.d/openrl_lab.json" in names
    assert f"{data}share/jupyter/kernels/openrl/kernel.json" in names
    assert "openrl_lab/lab/server_extension.py" in names and "openrl_lab/orchestrator/orchestrator.proto" in names
    assert not any("node_modules" in n or n.startswith("labextension/") for n in names)


def test_jupyter_labextension_list_reports_it_enabled_and_ok(fresh_env):
    python, prefix, env, tmp = fresh_env
    out = _run([python, "-m", "jupyterlab.labextensions", "list"], env=env, timeout=120, cwd=tmp)
    # the extension is listed under the fresh prefix's labextensions folder, enabled, OK, from the python package
    section = out.split(str(prefix / "share" / "jupyter" / "labextensions"), 1)
    assert len(section) == 2, f"nothing listed under the fresh prefix:\n{out}"
    line = next((ln for ln in section[1].splitlines() if NPM_NAME in ln), None)
    assert line is not None, f"{NPM_NAME} not listed under {prefix}:\n{out}"
    assert re.search(rf"{NPM_NAME} v0\.1\.0 enabled\s+OK \(python, openrl-lab\)", line), out


def test_jupyter_server_extension_list_reports_openrl_lab_enabled_and_ok(fresh_env):
    python, prefix, env, tmp = fresh_env
    out = _run([python, "-m", "jupyter_server.extension.serverextension", "list"], env=env, timeout=120, cwd=tmp)
    section = out.split(f"Config dir: {prefix / 'etc' / 'jupyter'}", 1)
    assert len(section) == 2, f"the fresh prefix's config dir is not listed:\n{out}"
    block = section[1].split("Config dir:", 1)[0]
    assert re.search(r"openrl_lab enabled", block), out
    assert re.search(r"openrl_lab 0\.1\.0 OK", block), out
