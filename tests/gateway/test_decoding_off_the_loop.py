"""A forward_backward body is decoded in a worker thread: while a large (or hostile) body is being decoded,
the server keeps answering. The gateway runs in this process (real uvicorn on loopback, real SQLite) so the
test can watch the decoder: `wire.parse_forward_backward` is wrapped to record the thread it runs on and to
hold until a health check, sent meanwhile, has been answered."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from openrl_lab.cluster.fleet import Fleet
from openrl_lab.gateway import wire
from openrl_lab.gateway.app import create_app
from openrl_lab.gateway.store import Store

from .test_hostile_requests import zstd_bomb

pytestmark = pytest.mark.server  # starts the gateway under uvicorn in a thread, on loopback


@pytest.fixture
def gateway_here(tmp_path):
    """(base URL, key) of a gateway served by a thread of this process. No kernel is started: the requests
    here are refused before one is needed."""
    store = Store(tmp_path / "state.db")
    key = store.add_key("alice", "test")
    server = uvicorn.Server(uvicorn.Config(create_app(tmp_path, store, Fleet(tmp_path)), log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the gateway did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/api/v1", key
    server.should_exit = True
    thread.join()
    store.close()


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_a_zstd_bomb_is_decoded_off_the_event_loop(gateway_here, monkeypatch):
    url, key = gateway_here
    decoding, health_answered = threading.Event(), threading.Event()
    seen = {}
    parse = wire.parse_forward_backward

    def watched_parse(body, content_encoding):
        seen["on the event loop"] = _on_event_loop()
        decoding.set()
        # On the event loop this would wait out its timeout: the health check could not be answered meanwhile.
        seen["health answered meanwhile"] = health_answered.wait(timeout=30)
        return parse(body, content_encoding)

    monkeypatch.setattr(wire, "parse_forward_backward", watched_parse)
    with ThreadPoolExecutor(1) as pool:
        bomb = pool.submit(
            httpx.post,
            f"{url}/forward_backward",
            content=zstd_bomb(declared=True),
            timeout=120,
            headers={"X-API-Key": key, "Content-Encoding": "zstd"},
        )
        assert decoding.wait(timeout=60)
        assert httpx.get(f"{url}/healthz", timeout=60).json() == {"status": "ok"}
        health_answered.set()
        refused = bomb.result()
    assert refused.status_code == 400 and "declares" in refused.json()["detail"], refused.text
    assert seen == {"on the event loop": False, "health answered meanwhile": True}
