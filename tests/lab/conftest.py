"""Fixtures shared by tests/lab's modules."""

from __future__ import annotations

import pytest

from openrl_lab.orchestrator import TimeSliceOrchestratorClient


@pytest.fixture
def clients(orch):
    """`clients(job, key)`: orchestrator clients of the module's `orch` (its gRPC server), closed after the test."""
    made = []

    def make(job: str, key: str = "key-alice") -> TimeSliceOrchestratorClient:
        c = TimeSliceOrchestratorClient(orch.target, api_key=key, job=job, retry_timeout_s=5)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
