"""Kernels as child processes of the control plane (the default launcher), torch-free.

Each listens on loopback with a fresh key passed in its environment, prints its port and incarnation when
ready, and exits when the control plane does. `cores` pins a CPU kernel to its own cores (and sizes its
thread pools to them), so N CPU kernels on one machine run side by side instead of fighting for caches.
`sampler="vllm"` makes its sampler vLLM, which may live in another environment than the control plane's
(`python`: the interpreter to run; `kernel_python` in the group's config, or $OPENRL_LAB_VLLM_PYTHON).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from pathlib import Path

from openrl_lab.kernel.client import KernelClient, KernelError
from openrl_lab.settings import settings

LOG_TAIL_LINES = 20  # of a kernel's log, in the error when it exits at start (e.g. "vLLM is not installed")

# glibc keeps freed memory instead of returning it to the OS, so swap restores reuse warm pages
# (docs/benchmarks.md, CPU swap: restore efficiency 0.18 -> 0.97 of a plain copy).
CPU_GLIBC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"


class LocalKernel:
    """A kernel started as a child process of the control plane, on loopback with a fresh key.

    `name` (default kernel-<group>) must be unique among live kernels: a kernel started under a name
    replaces the previous one of that name in the orchestrator's eyes (what it left on the device is gone)."""

    def __init__(
        self,
        group: str,
        home: Path,
        device: str = "cpu",
        log_dir: Path | None = None,
        orchestrator: tuple[str, str] | None = None,
        name: str | None = None,
        cores: tuple[int, ...] | None = None,
        sampler: str = "torch",
        sampler_fallback: bool = False,
        python: str | None = None,
        sampler_models: tuple[str, ...] = (),
    ):
        self.group = group
        self.name = name or f"kernel-{group}"
        self.orchestrator = orchestrator
        self.home = home
        self.device = device
        self.cores = cores
        self.sampler = sampler
        self.sampler_fallback = sampler_fallback
        self.sampler_models = tuple(sampler_models)  # vllm: engines started with the kernel
        self.python = python or kernel_python(sampler)
        self.log_path = (log_dir or home / "logs") / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None
        self.client: KernelClient | None = None
        self.port = 0
        self.incarnation = ""

    def start(self, timeout: float = 120.0) -> KernelClient:
        authkey = secrets.token_hex(32)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OPENRL_KERNEL_AUTHKEY=authkey, PYTHONUNBUFFERED="1")
        if "GLIBC_TUNABLES" not in env and _runs_on_cpu(self.device):
            env["GLIBC_TUNABLES"] = CPU_GLIBC_TUNABLES  # keep freed memory: see CPU_GLIBC_TUNABLES
        if self.cores:  # one OpenMP thread per core it owns (set before torch loads)
            env["OMP_NUM_THREADS"] = str(len(self.cores))
        if self.orchestrator:
            env.update(OPENRL_ORCHESTRATOR_TARGET=self.orchestrator[0], OPENRL_ORCHESTRATOR_KEY=self.orchestrator[1])
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self._log_start = log.tell()
            try:
                self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=log, env=env)
            except OSError as e:  # e.g. a group's kernel_python that is not there
                raise KernelError(f"kernel {self.name}: cannot run {self.python}: {e.strerror or e}") from None
        self.port, self.incarnation = self._read_ready(timeout)
        self.client = KernelClient(("127.0.0.1", self.port), authkey.encode())
        return self.client

    def command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "openrl_lab.kernel",
            "--home",
            str(self.home),
            "--device",
            self.device,
            "--group",
            self.group,
            "--name",
            self.name,
        ]
        if self.cores:
            cmd += ["--cores", ",".join(map(str, self.cores))]
        if self.sampler != "torch":
            cmd += ["--sampler", self.sampler]
        if self.sampler_fallback:
            cmd += ["--sampler-fallback"]
        if self.sampler_models:
            cmd += ["--sampler-models", ",".join(self.sampler_models)]
        return cmd

    def _read_ready(self, timeout: float) -> tuple[int, str]:
        result: list[tuple[int, str]] = []

        def reader() -> None:
            assert self.proc and self.proc.stdout
            for raw in self.proc.stdout:
                words = raw.decode(errors="replace").split()
                if len(words) == 3 and words[0] == "OPENRL_KERNEL_READY" and not result:
                    result.append((int(words[1]), words[2]))
                # keep draining stdout so the child never blocks on a full pipe

        assert self.proc is not None  # start() made it
        threading.Thread(target=reader, daemon=True).start()
        wait = threading.Event()
        for _ in range(int(timeout * 20)):
            if result:
                return result[0]
            if self.proc.poll() is not None:
                raise KernelError(
                    f"kernel {self.name} exited with {self.proc.returncode} at start: "
                    f"{self._log_tail() or '(no output)'}\n(its log: {self.log_path})"
                )
            wait.wait(0.05)
        self.stop()
        raise KernelError(f"kernel {self.name} did not start within {timeout:.0f}s; see {self.log_path}")

    def _log_tail(self) -> str:
        """What this start wrote to the log (its last lines): why the kernel exited."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The process's exit status once it ended (None while it runs, or before start())."""
        return None if self.proc is None else self.proc.returncode

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def kernel_python(sampler: str) -> str:
    """The interpreter a kernel runs when its group names none: a vLLM kernel's is $OPENRL_LAB_VLLM_PYTHON if
    set (vLLM's own environment, `make vllm-env`), else the control plane's."""
    vllm_python = settings().lab_vllm_python
    if sampler == "vllm" and vllm_python:
        return str(vllm_python)
    return sys.executable


def core_sets(n: int) -> list[tuple[int, ...]]:
    """This process's CPU cores split into n disjoint, contiguous sets (the last ones share if n > cores)."""
    cores = sorted(os.sched_getaffinity(0))
    if n <= len(cores):
        size = len(cores) // n
        return [tuple(cores[i * size : (i + 1) * size]) if i < n - 1 else tuple(cores[i * size :]) for i in range(n)]
    return [(cores[i % len(cores)],) for i in range(n)]


def _runs_on_cpu(device: str) -> bool:
    if device == "auto":  # the kernel picks CUDA if it finds a GPU; ask the same way, without torch
        from openrl_lab.orchestrator.config import discover_devices

        return discover_devices() == ["cpu"]
    return device.split(":")[0] == "cpu"
