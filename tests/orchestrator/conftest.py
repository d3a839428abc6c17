"""Fixtures: a real orchestrator gRPC service on loopback (in this process), real clients, a fake clock."""

from __future__ import annotations

import socket

import pytest

KEYS = {"key-alice": "alice", "key-bob": "bob"}
GROUPS = [
    {"id": "trainer-group", "devices": ["accel:0"], "aliases": ["default"]},
    {"id": "sampler-group", "devices": ["accel:1"], "policy": "lrs"},
]
# Real clocks here: a holder heartbeats every timeout/4, so a stall of this process (GIL, a loaded machine) shorter
# than the timeout must not revoke it. No test here waits for this timeout to expire (those set their own).
HOLDER_TIMEOUT_S = 5.0


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def config(**overrides) -> dict:
    return {"groups": GROUPS, "holder_timeout_s": HOLDER_TIMEOUT_S, **overrides}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def orch(request, tmp_path):
    """The service; a test can override config keys with `@pytest.mark.parametrize("orch", [{...}], indirect=True)`."""
    from openrl_lab.orchestrator import serve_orchestrator

    overrides = getattr(request, "param", {})
    server = serve_orchestrator(tmp_path / "orchestrator.db", port=0, authenticate=KEYS.get, config=config(**overrides))
    yield server
    server.stop(grace=0)


@pytest.fixture
def make_client(orch):
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient

    clients = []

    def make(job: str, key: str = "key-alice", **kw) -> TimeSliceOrchestratorClient:
        c = TimeSliceOrchestratorClient(
            orch.target, api_key=key, job=job, retry_timeout_s=kw.pop("retry_timeout_s", 5), **kw
        )
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()
