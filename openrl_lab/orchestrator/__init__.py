"""Cooperative time-slicing of accelerator groups between users' jobs (docs/architecture.md, "Time-slicing").

    from openrl_lab.orchestrator import TimeSliceOrchestratorClient
    orchestrator = TimeSliceOrchestratorClient(target="localhost:50051")

    @orchestrator.on_accelerators(group_id="trainer-group")
    def train_phase(model, trajectories): ...

Parts (none imports torch):
- `scheduler.Scheduler`: groups, leases, queues, lazy yield, holder timeouts and the per-group
  `max_phase_s`, the timeline; pure Python, testable without gRPC. Its parts: `records` (the mutable
  records), `policies` (weighted / lrs / fifo, a registry), `reporting` (status, lease info, timeline
  records and duty cycles as each viewer may see them: other users' names redacted).
- `service.serve_orchestrator(...)`: the gRPC service over one Scheduler (grpcio, default port 50051).
- `lane`: the hand-off lane, Acquire / Release / ReportEvicted on a loopback socket beside the gRPC port
  (a hand-off over gRPC woke ~8 threads; see the module), used by clients on the same machine.
- `client.TimeSliceOrchestratorClient`: acquire / release / on_accelerators / get_status / list_groups /
  timeline, retries while the service is unavailable, background heartbeats; `client.ServiceOrchestratorClient`
  adds what only services (the kernels) may do: leases for a user, `drop_stale_residency`.
- `gate.OrchestratorGate`: the kernel's PhaseGate on top of the client (evict / restore callbacks).
- `store.OrchestratorStore`: SQLite (WAL): leases survive a restart of the control plane.
- `config`: groups from a TOML/JSON file or from the devices found on this machine.

The wire protocol is `orchestrator.proto`; `orchestrator_pb2.py` and `orchestrator_pb2_grpc.py` are generated
from it and committed. After editing the .proto, regenerate them with
    .venv/bin/python -m openrl_lab.tools.regen_protos
(needs grpcio-tools; the generated code needs protobuf >= 7.35.1 and grpcio >= 1.85.1 at runtime).

The client, gate and service import grpc; `Scheduler` and the types do not (they are loaded lazily here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from openrl_lab.orchestrator.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OrchestratorError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

if TYPE_CHECKING:  # what __getattr__ loads on first use, for type checkers (the same names as _LAZY)
    from openrl_lab.orchestrator.client import ServiceOrchestratorClient, TimeSliceOrchestratorClient
    from openrl_lab.orchestrator.config import GroupSpec, OrchestratorConfig, load_config
    from openrl_lab.orchestrator.gate import OrchestratorGate
    from openrl_lab.orchestrator.scheduler import Scheduler
    from openrl_lab.orchestrator.service import DEFAULT_PORT, OrchestratorServer, serve_orchestrator

_LAZY = {
    "TimeSliceOrchestratorClient": "openrl_lab.orchestrator.client",
    "ServiceOrchestratorClient": "openrl_lab.orchestrator.client",
    "OrchestratorGate": "openrl_lab.orchestrator.gate",
    "serve_orchestrator": "openrl_lab.orchestrator.service",
    "OrchestratorServer": "openrl_lab.orchestrator.service",
    "DEFAULT_PORT": "openrl_lab.orchestrator.service",
    "Scheduler": "openrl_lab.orchestrator.scheduler",
    "OrchestratorConfig": "openrl_lab.orchestrator.config",
    "GroupSpec": "openrl_lab.orchestrator.config",
    "load_config": "openrl_lab.orchestrator.config",
}

__all__ = [
    "DEFAULT_PORT",
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GroupSpec",
    "InvalidArgument",
    "NotFound",
    "OrchestratorConfig",
    "OrchestratorError",
    "OrchestratorGate",
    "OrchestratorServer",
    "PermissionDenied",
    "ResourceExhausted",
    "Scheduler",
    "ServiceOrchestratorClient",
    "TimeSliceOrchestratorClient",
    "Unauthenticated",
    "Unavailable",
    "load_config",
    "serve_orchestrator",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
