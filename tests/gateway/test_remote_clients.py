"""What a client on another machine gets: /metrics only with a key, and no directory of the server's home
as a tokenizer id (a client on the server's machine gets the model directory, to load it offline).

The gateway runs in-process behind httpx's ASGI transport, which lets a test choose the client's address;
its kernel is a real one, started on the first request that needs it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from openrl_lab.gateway.app import create_app
from openrl_lab.gateway.store import Store
from openrl_lab.cluster.fleet import Fleet
from tests.gateway.helpers import MODEL

REMOTE, LOCAL = "10.1.2.3", "127.0.0.1"


@pytest.fixture
def app(tmp_path):
    store = Store(tmp_path / "state.db")
    kernels = Fleet(tmp_path)
    kernels.add_local("default", "cpu")
    kernels.start()
    yield create_app(tmp_path, store, kernels), store.add_key("alice", "default")
    kernels.stop()
    store.close()


def _client(app, host: str, key: str | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(host, 40000)), base_url="http://lab/",
                             headers={"X-API-Key": key} if key else {}, timeout=120)


def test_metrics_off_loopback_need_a_key(app):
    app, key = app

    async def status(host: str, key: str | None = None) -> int:
        async with _client(app, host, key) as http:
            r = await http.get("/metrics")
            assert r.status_code != 401 or "X-API-Key" in r.json()["detail"]
            return r.status_code

    assert asyncio.run(status(LOCAL)) == 200 and asyncio.run(status("::1")) == 200
    assert asyncio.run(status(REMOTE)) == 401
    assert asyncio.run(status(REMOTE, key)) == 200


def test_tokenizer_id_is_a_directory_only_for_clients_on_the_servers_machine(app, tmp_path):
    app, key = app

    async def tokenizer_ids() -> dict[str, str]:
        async with _client(app, LOCAL, key) as http:
            sid = (await http.post("api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "t",
                                                                  "type": "create_session"})).json()["session_id"]
            rid = (await http.post("api/v1/create_model", json={
                "session_id": sid, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 2},
                "type": "create_model"})).json()["request_id"]
            while (done := (await http.post("api/v1/retrieve_future", json={"request_id": rid})).json()).get(
                    "type") == "try_again":
                pass
            model_id = done["model_id"]
        ids = {}
        for host in (LOCAL, REMOTE):
            async with _client(app, host, key) as http:
                info = await http.post("api/v1/get_info", json={"model_id": model_id, "type": "get_info"})
                ids[host] = info.json()["model_data"]["tokenizer_id"]
        return ids

    ids = asyncio.run(tokenizer_ids())
    assert ids[REMOTE] == MODEL
    assert ids[LOCAL].startswith(str(tmp_path)) and ids[LOCAL].endswith(MODEL)
