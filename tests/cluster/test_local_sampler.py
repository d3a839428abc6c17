"""The sampler backend chosen per group reaches the local kernels: config file and `serve --sampler` -> serve's plan
-> LocalKernel's command line and interpreter; a kernel that exits at start says why (real processes)."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from openrl_lab import cli
from openrl_lab.cluster.launchers import local_kernels as _local_kernels
from openrl_lab.cluster.local import LocalKernel
from openrl_lab.kernel.client import KernelError
from openrl_lab.orchestrator.config import load_config
from openrl_lab.orchestrator.errors import InvalidArgument
from openrl_lab.server import LabServer

VLLM_MISSING = re.compile(r"vLLM.*(not installed|cannot import)", re.DOTALL)  # what the kernel says when it has none
no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable here")


def by_group(planned: list[dict]) -> dict[str, dict]:
    return {k["group"]: k for k in planned}


# --- LocalKernel ------------------------------------------------------------------------------------------------
def test_the_kernel_command_names_the_sampler_and_its_interpreter(tmp_path, monkeypatch):
    monkeypatch.delenv("OPENRL_LAB_VLLM_PYTHON", raising=False)
    torch_kernel = LocalKernel("g", tmp_path, "cpu", cores=(0,))
    assert torch_kernel.command() == [
        sys.executable,
        "-m",
        "openrl_lab.kernel",
        "--home",
        str(tmp_path),
        "--device",
        "cpu",
        "--group",
        "g",
        "--name",
        "kernel-g",
        "--cores",
        "0",
    ]
    vllm_kernel = LocalKernel(
        "g",
        tmp_path,
        "cpu",
        sampler="vllm",
        sampler_fallback=True,
        python="/opt/v/bin/python",
        sampler_models=("a/m", "b/n"),
    )
    assert vllm_kernel.command() == [
        "/opt/v/bin/python",
        "-m",
        "openrl_lab.kernel",
        "--home",
        str(tmp_path),
        "--device",
        "cpu",
        "--group",
        "g",
        "--name",
        "kernel-g",
        "--sampler",
        "vllm",
        "--sampler-fallback",
        "--sampler-models",
        "a/m,b/n",
    ]
    # without an interpreter of its own, a vLLM kernel runs $OPENRL_LAB_VLLM_PYTHON (`make vllm-env`'s); torch
    # kernels keep the control plane's
    monkeypatch.setenv("OPENRL_LAB_VLLM_PYTHON", "/srv/.venv-vllm/bin/python")
    assert LocalKernel("g", tmp_path, sampler="vllm").command()[0] == "/srv/.venv-vllm/bin/python"
    assert LocalKernel("g", tmp_path).command()[0] == sys.executable


@pytest.mark.server  # starts kernel or serve processes
def test_a_kernel_that_exits_at_start_says_why(tmp_path):
    """What the kernel wrote to stderr before it died is in the error (the control plane's message), not only in
    its log file."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'openrl-lab kernel: no accelerator here' >&2\nexit 3\n")
    python.chmod(0o755)
    kernel = LocalKernel("g", tmp_path / "home", "cpu", log_dir=tmp_path / "logs", python=str(python))
    kernel.log_path.parent.mkdir(parents=True)
    kernel.log_path.write_text("an earlier start's line\n")
    with pytest.raises(KernelError) as e:
        kernel.start(timeout=30)
    message = str(e.value)
    assert "exited with 3 at start" in message and "openrl-lab kernel: no accelerator here" in message
    assert "an earlier start's line" not in message and str(kernel.log_path) in message
    missing = LocalKernel("g", tmp_path / "home", python=str(tmp_path / "no-such-python"))
    with pytest.raises(KernelError, match=r"cannot run .*no-such-python: No such file"):
        missing.start(timeout=30)


@pytest.mark.server  # starts kernel or serve processes
def test_a_torch_sampler_kernel_comes_up(tmp_path):
    kernel = LocalKernel("default", tmp_path / "home", "cpu", sampler="torch")
    try:
        client = kernel.start(timeout=120)
        assert client.call("metrics", timeout=30) is not None and kernel.alive()
    finally:
        kernel.stop()


@pytest.mark.server  # starts kernel or serve processes
@no_vllm
def test_a_vllm_kernel_without_vllm_fails_at_start_saying_so(tmp_path):
    """In the main environment (no vLLM) a `--sampler vllm` kernel exits at start; the reason reaches the caller."""
    kernel = LocalKernel("default", tmp_path / "home", "cpu", sampler="vllm", python=sys.executable)
    try:
        with pytest.raises(KernelError) as e:
            kernel.start(timeout=120)
    finally:
        kernel.stop()
    assert VLLM_MISSING.search(str(e.value)), str(e.value)


# --- serve ------------------------------------------------------------------------------------------------------
def test_serve_sampler_flag_sets_the_group_samplers_go_to(monkeypatch):
    monkeypatch.delenv("OPENRL_LAB_VLLM_PYTHON", raising=False)
    two = by_group(_local_kernels("cpu", 2, None, "vllm", True))  # cpu0: trainer-group, cpu1: sampler-group
    assert (two["cpu1"]["sampler"], two["cpu1"]["sampler_fallback"]) == ("vllm", True)
    assert (two["cpu0"]["sampler"], two["cpu0"]["sampler_fallback"]) == ("torch", False)
    (one,) = _local_kernels("cpu", None, None, "vllm")  # one device: `default` trains and samples
    assert (one["group"], one["sampler"], one["python"]) == ("default", "vllm", None)
    assert {k["sampler"] for k in _local_kernels("cpu", 2, None)} == {"torch"}  # no flag: torch everywhere


def test_a_config_files_groups_choose_their_sampler_and_the_flag_overrides_the_sampler_group():
    config = load_config(
        {
            "groups": [
                {
                    "id": "train",
                    "devices": ["cpu:0"],
                    "aliases": ["trainer-group"],
                    "sampler": "vllm",
                    "kernel_python": "/opt/vllm/bin/python",
                },
                {"id": "sample", "devices": ["cpu:1"], "aliases": ["sampler-group"]},
            ]
        }
    )
    planned = by_group(_local_kernels("cpu", None, config.groups))
    assert planned["train"]["sampler"] == "vllm" and planned["train"]["python"] == "/opt/vllm/bin/python"
    assert planned["sample"]["sampler"] == "torch" and planned["sample"]["python"] is None
    flagged = by_group(_local_kernels("cpu", None, config.groups, "vllm", True))
    assert flagged["sample"]["sampler"] == "vllm" and flagged["sample"]["sampler_fallback"] is True
    assert flagged["train"]["sampler"] == "vllm"  # the file's setting for the other group stands
    assert by_group(_local_kernels("cpu", None, config.groups, "torch"))["train"]["sampler"] == "vllm"
    unnamed = load_config({"groups": [{"id": "a", "devices": ["cpu"]}]})
    with pytest.raises(InvalidArgument, match="no group is named 'sampler-group'"):
        _local_kernels("cpu", None, unnamed.groups, "vllm")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sampler-fallback"], "--sampler-fallback goes with --sampler vllm"),
        (["--sampler", "vllm", "--cpu-kernels", "0"], "starts none here"),
    ],
)
def test_serve_refuses_sampler_flags_it_cannot_apply(argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", *argv])
    assert message in str(e.value.code)


@pytest.mark.server  # starts kernel or serve processes
@no_vllm
def test_serve_with_a_vllm_kernel_that_cannot_start_exits_with_its_reason(tmp_path):
    """`serve --sampler vllm` where vLLM is missing: the control plane stops at once, saying why."""
    lab = LabServer(tmp_path / "home", args=("--cpu-kernels", "1", "--sampler", "vllm"))
    try:
        with pytest.raises(RuntimeError, match="exited with 1"):
            lab.start(timeout=180)
    finally:
        lab.stop()
    log = (tmp_path / "home" / "server.log").read_text()
    assert "openrl-lab serve: kernel kernel-default exited with 1 at start" in log
    assert VLLM_MISSING.search(log) and "Traceback" not in log
