"""Which kernel serves a request. Locally: one kernel process per group, started by the control plane.

`epoch` names the current generation of kernels: objects created under an older epoch lost their
resident state when their kernel died, and the gateway says so instead of pretending they exist.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

from openrl_lab.kernel.client import KernelClient, LocalKernel

DEFAULT_GROUP = "default"


class KernelPool:
    def __init__(self, home: Path, device: str = "cpu", group: str = DEFAULT_GROUP,
                 orchestrator: tuple[str, str] | None = None):
        self.home = home
        self.device = device
        self.group = group
        self.orchestrator = orchestrator  # (gRPC target, kernel API key), or None: phases run unarbitrated
        self._kernel: LocalKernel | None = None
        self._lock = threading.Lock()
        self.epoch = uuid.uuid4().hex[:12]
        self._groups = None

    def groups(self):
        """The orchestrator's groups (`GroupInfo`s; asked once), or None when phases run unarbitrated."""
        if self.orchestrator is None:
            return None
        if self._groups is None:
            from openrl_lab.orchestrator import TimeSliceOrchestratorClient

            with TimeSliceOrchestratorClient(self.orchestrator[0], api_key=self.orchestrator[1], job="gateway") as c:
                self._groups = c.list_groups()
        return self._groups

    def kernel(self) -> KernelClient:
        """The group's kernel, (re)started if it is not running."""
        with self._lock:
            if self._kernel is None or not self._kernel.alive():
                if self._kernel is not None:  # it died: everything resident on it is gone
                    self.epoch = uuid.uuid4().hex[:12]
                self._kernel = LocalKernel(self.group, self.home, self.device, orchestrator=self.orchestrator)
                self._kernel.start()
            assert self._kernel.client is not None
            return self._kernel.client

    def running(self) -> KernelClient | None:
        """The kernel's client if it is up, without starting one."""
        k = self._kernel
        return k.client if k is not None and k.alive() else None

    def running_by_name(self) -> dict[str, KernelClient]:
        """Every running kernel's client by kernel name (for /metrics)."""
        k = self._kernel
        return {k.name: k.client} if k is not None and k.alive() and k.client is not None else {}

    def stop(self) -> None:
        with self._lock:
            if self._kernel is not None:
                self._kernel.stop()
                self._kernel = None
