"""`make gpu-check` (benchmarks/gpu_check.py) on a CPU machine: its plan, its answer without a GPU, and its table
and result files from fake steps (a pass, a failure, a time-out, skips, a pytest run). No server, no GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", DRIVER)
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses look their module up there
_spec.loader.exec_module(gc)


def test_the_plan_has_every_cuda_test_file_and_benchmark_within_8_minutes():
    steps = gc.plan()
    names = [s.name for s in steps]
    marked = gc.cuda_test_files()
    assert "tests/test_gpu_check.py" not in marked and "tests/sample/test_torch_sampler.py" not in marked
    for f in (
        "tests/swap/test_swapset.py",
        "tests/lab/test_resident_cuda.py",
        "tests/sample/test_torch_sampler_cuda.py",
        "tests/kernel/test_engine_cuda.py",
    ):
        assert f in marked and "pytest " + f.removeprefix("tests/") in names
    assert names[0] == "probe" and {"gpu_swap", "resident_phase", "vllm_sampler"} <= set(names)
    assert sum(s.budget_s for s in steps) <= gc.TOTAL_S == 480
    assert all(s.budget_s > 0 for s in steps)
    vllm = next(s for s in steps if s.name == "vllm_sampler")
    assert "vllm" in vllm.requires and "cuda" in vllm.cmd


@pytest.mark.server  # runs benchmarks/gpu_check.py in a subprocess
@pytest.mark.parametrize("flag", ["--dry-run", "--list"])
def test_the_dry_run_prints_every_step_its_command_and_budget_without_a_gpu(flag):
    out = subprocess.run(
        [sys.executable, str(DRIVER), flag], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert out.returncode == 0, out.stderr
    for s in gc.plan():
        line = next(ln for ln in out.stdout.splitlines() if f" {s.name} " in ln)
        assert f"budget {s.budget_s:5.0f} s" in line
        assert f"$GPU_PY {s.cmd[1]}" in out.stdout  # its command, as it will run
    assert "benchmarks/gpu_swap.py" in out.stdout and "-m cuda" in out.stdout and "limit 480 s" in out.stdout


@pytest.mark.server  # runs benchmarks/gpu_check.py in a subprocess
def test_without_cuda_it_says_so_in_one_line_and_fails():
    # this machine's torch is a CPU build (or absent): either way, the one line and status 2, and nothing written
    out = subprocess.run(
        [sys.executable, str(DRIVER), "--out", "/nonexistent/gpu-check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == gc.EXIT_NO_CUDA
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no CUDA device: "), out.stderr
    assert out.stdout == ""


def _dead(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.server  # runs benchmarks/gpu_check.py in a subprocess
def test_fake_steps_give_one_table_and_the_json_markdown_and_log(tmp_path):
    py = sys.executable
    pid_file = tmp_path / "grandchild.pid"
    summary = {"evict GB/s": 51.2, "bit-exact": True}
    last = {"ok": True, "summary": summary}
    grandchild = (
        "import subprocess; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); p.wait()"
    )
    test_file = tmp_path / "test_fake.py"
    test_file.write_text(
        "import pytest\n\ndef test_ok():\n    assert True\n\n"
        "@pytest.mark.skip(reason='no thing')\ndef test_skip():\n    pass\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    steps = [
        gc.Step("good", "prints its figures", [py, "-c", f"print('x'); print({json.dumps(json.dumps(last))})"], 20),
        gc.Step("bad", "exits 3", [py, "-c", "import sys; print('boom'); sys.exit(3)"], 20),
        gc.Step(
            "slow",
            "runs past its budget, with a child",
            [py, "-c", grandchild],
            1.5,
        ),
        gc.Step("needs", "needs a module that is not there", [py, "-c", "pass"], 20, ("no_such_module_for_gpu_check",)),
        gc.Step("imports", "fails on a missing package", [py, "-c", "import no_such_pkg_for_gpu_check"], 20),
        gc.Step("ours", "fails on a missing module of ours", [py, "-c", "import openrl_lab.no_such_module"], 20),
        gc.Step("silent", "a benchmark with no JSON line", [py, "-c", "print('done')"], 20),
        gc.Step(
            "tests",
            "a pytest run",
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--noconftest",
                "-c",
                str(tmp_path / "pytest.ini"),
                "--rootdir",
                str(tmp_path),
                "--junitxml",
                "{out}/junit.xml",
                str(test_file),
            ],
            60,
            kind="pytest",
            env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},  # fast: none of the installed plugins
        ),
        gc.Step("late", "no time left", [py, "-c", "pass"], 20),
    ]
    out = tmp_path / "out"
    t0 = time.monotonic()
    rows = gc.run_plan(steps[:-1], out, total_s=600, header={"device": "fake GPU", "torch": "0"})
    late = gc.run_step(steps[-1], tmp_path / "scratch", budget_s=0)
    assert time.monotonic() - t0 < 60
    by = {r["step"]: r for r in rows}
    assert by["good"]["status"] == "pass" and by["good"]["summary"] == summary
    assert by["bad"]["status"] == "fail" and "exit 3" in by["bad"]["note"] and "boom" in by["bad"]["note"]
    assert by["slow"]["status"] == "timeout" and by["slow"]["seconds"] < 10
    assert _dead(int(pid_file.read_text())), "the step's own child outlived its budget"
    assert by["needs"]["status"] == "skipped"
    assert by["needs"]["note"] == "skipped: no_such_module_for_gpu_check not installed"
    assert by["imports"]["status"] == "skipped"
    assert by["imports"]["note"] == "skipped: no_such_pkg_for_gpu_check not installed"
    assert by["ours"]["status"] == "fail"  # a module of this checkout missing is a bug, not a skip
    assert by["silent"]["status"] == "fail" and "no JSON" in by["silent"]["note"]
    assert by["tests"]["status"] == "pass"
    assert by["tests"]["summary"] == {"passed": 1, "failures": 0, "errors": 0, "skipped": 1}
    assert late["status"] == "skipped" and "no time left" in late["note"]

    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["device"] == "fake GPU" and doc["counts"] == {"pass": 2, "fail": 3, "timeout": 1, "skipped": 2}
    assert [s["step"] for s in doc["steps"]] == [s.name for s in steps[:-1]]
    md = (out / "gpu_check.md").read_text()
    assert "| step | status | seconds | budget s | key figures | note |" in md
    assert "| good | pass |" in md and "evict GB/s 51.2, bit-exact True" in md and "| slow | timeout |" in md
    log = (out / "gpu_check.log").read_text()
    assert "===== bad: fail" in log and "boom" in log


@pytest.mark.server  # runs benchmarks/gpu_check.py in a subprocess
def test_pytest_steps_load_the_suite_with_the_pytest_jupyter_stand_in(tmp_path, monkeypatch):
    """What the device machine lacks (pytest-jupyter, jupyter_server): the stand-in lets tests/conftest.py load."""
    monkeypatch.setenv("GPU_CHECK_STUBS", "1")
    step = gc.Step("collect", "", [], 60, kind="pytest")
    env = gc._env(step, tmp_path) | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # pytest alone, as it may be there
    assert env["PYTHONPATH"].split(":")[0] == str(gc.STUBS)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-q",
            "--trace-config",
            "tests/test_gpu_check.py",
            "-k",
            "dry_run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "benchmarks/gpu_stubs/pytest_jupyter/jupyter_server.py" in out.stdout
    assert "test_the_dry_run_prints_every_step" in out.stdout
