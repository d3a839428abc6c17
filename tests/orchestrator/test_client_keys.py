"""Which API key an orchestrator client sends when none is passed: the same lookup as the notebook's
(`home.find_api_key`): $OPENRL_LAB_API_KEY, then $TINKER_API_KEY, then the home's connection.json."""

from __future__ import annotations

import json

import pytest

from openrl_lab.orchestrator import TimeSliceOrchestratorClient, Unauthenticated


@pytest.fixture
def no_keys(monkeypatch, tmp_path):
    for var in ("OPENRL_LAB_API_KEY", "TINKER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENRL_LAB_HOME", str(tmp_path / "home"))
    return monkeypatch, tmp_path / "home"


def owner_seen_by(orch, **kw) -> str:
    with TimeSliceOrchestratorClient(orch.target, job="probe", retry_timeout_s=2, **kw) as c:
        return c.lease("trainer-group").owner


def test_the_key_comes_from_the_argument_then_each_variable_then_the_connection_file(orch, no_keys):
    env, home = no_keys
    with pytest.raises(Unauthenticated, match="missing API key"):
        owner_seen_by(orch)
    home.mkdir()
    (home / "connection.json").write_text(json.dumps({"base_url": "http://127.0.0.1:1", "api_key": "key-alice"}))
    assert owner_seen_by(orch) == "alice"
    env.setenv("TINKER_API_KEY", "key-bob")  # the tinker SDK's variable: a lab key set for the SDK works here too
    assert owner_seen_by(orch) == "bob"
    env.setenv("OPENRL_LAB_API_KEY", "key-alice")
    assert owner_seen_by(orch) == "alice"
    assert owner_seen_by(orch, api_key="key-bob") == "bob"
