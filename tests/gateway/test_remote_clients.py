"""What a client on another machine gets: /metrics only with a key, and no directory of the server's home
as a tokenizer id but a repo id of the /hf mirror (a client on the server's machine gets the model directory,
to load it offline).

The gateway runs in-process behind httpx's ASGI transport, which lets a test choose the client's address;
its kernel is a real one, started on the first request that needs it."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from openrl_lab.cluster.fleet import Fleet
from openrl_lab.gateway.app import create_app
from openrl_lab.gateway.store import Store
from tests.gateway.helpers import MODEL

pytestmark = pytest.mark.server  # starts a lab of its own (LabServer)

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
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, client=(host, 40000)),
        base_url="http://lab/",
        headers={"X-API-Key": key} if key else {},
        timeout=120,
    )


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


async def _new_model(http: httpx.AsyncClient, base_model: str) -> str:
    sid = (
        await http.post(
            "api/v1/create_session",
            json={"tags": [], "user_metadata": {}, "sdk_version": "t", "type": "create_session"},
        )
    ).json()["session_id"]
    rid = (
        await http.post(
            "api/v1/create_model",
            json={
                "session_id": sid,
                "model_seq_id": 0,
                "base_model": base_model,
                "lora_config": {"rank": 2},
                "type": "create_model",
            },
        )
    ).json()["request_id"]
    while (done := (await http.post("api/v1/retrieve_future", json={"request_id": rid})).json()).get(
        "type"
    ) == "try_again":
        pass
    return done["model_id"]


async def _tokenizer_id(app, host: str, key: str, model_id: str) -> str:
    async with _client(app, host, key) as http:
        info = await http.post("api/v1/get_info", json={"model_id": model_id, "type": "get_info"})
        return info.json()["model_data"]["tokenizer_id"]


def test_tokenizer_id_is_a_directory_only_for_clients_on_the_servers_machine(app, tmp_path, monkeypatch):
    app, key = app

    async def tokenizer_ids() -> dict[str, str]:
        async with _client(app, LOCAL, key) as http:
            model_id = await _new_model(http, MODEL)
        ids = {host: await _tokenizer_id(app, host, key, model_id) for host in (LOCAL, REMOTE)}
        monkeypatch.setenv("OPENRL_LAB_TOKENIZER_PATHS", "0")  # names for everyone (tests of the remote path)
        ids["forced"] = await _tokenizer_id(app, LOCAL, key, model_id)
        return ids

    ids = asyncio.run(tokenizer_ids())
    assert ids[REMOTE] == ids["forced"] == MODEL
    assert ids[LOCAL].startswith(str(tmp_path)) and ids[LOCAL].endswith(MODEL)


def test_a_model_named_by_its_directory_is_served_under_an_alias(app, tmp_path):
    """A directory is no Hugging Face repo id: a client elsewhere gets an alias, which the /hf mirror serves;
    a client here gets the directory only while it exists on this machine."""
    app, key = app
    model_dir = tmp_path / "models" / MODEL

    async def check():
        async with _client(app, LOCAL, key) as http:
            await _new_model(http, MODEL)  # builds the built-in model's directory
            model_id = await _new_model(http, str(model_dir))
        assert await _tokenizer_id(app, LOCAL, key, model_id) == str(model_dir)
        alias = await _tokenizer_id(app, REMOTE, key, model_id)
        assert alias.startswith("openrl-lab-local/tiny-llama-1m-") and str(tmp_path) not in alias
        async with _client(app, REMOTE) as http:
            got = await http.get(f"hf/{alias}/resolve/main/tokenizer.json", headers={"Authorization": f"Bearer {key}"})
        assert got.status_code == 200 and got.content == (model_dir / "tokenizer.json").read_bytes()
        # the directory gone from this machine (the kernel elsewhere): a name, even for a client here
        cards = app.state.gateway.cards
        cards[str(model_dir)] = dataclasses.replace(cards[str(model_dir)], path="/nowhere/x")
        assert await _tokenizer_id(app, LOCAL, key, model_id) == alias

    asyncio.run(check())
