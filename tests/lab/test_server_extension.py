"""The Jupyter server extension in a real jupyter_server (pytest-jupyter), against a real control plane
(`openrl-lab serve` on loopback): authentication, 503 without a control plane, each user's own data only,
the live stream (rate, pause), and JupyterHub-style base URLs."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import tornado.httpclient
import tornado.websocket
from traitlets.config import Config

from tests.conftest import make_key, running_lab, sdk_client

MODEL = "openrl-lab/tiny-llama-1m"
ROUTES = ["connection", "leases", "queue", "timeline", "metrics/anything"]


# --- a control plane with some work of two users on it ----------------------------------------------


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    yield from running_lab(tmp_path_factory.mktemp("ext-lab"))


@pytest.fixture(scope="module")
def bob_key(cp):
    return make_key(cp.home, "bob")


@pytest.fixture(scope="module")
def work(cp, bob_key):
    """The local user: an orchestrator lease with one finished phase, and a lab lease with metrics.
    Bob: an orchestrator lease with one finished phase."""
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient

    mine = TimeSliceOrchestratorClient(cp.grpc_target, api_key=cp.api_key, job="ext-mine-job")
    bob = TimeSliceOrchestratorClient(cp.grpc_target, api_key=bob_key, job="bob-secret-job")
    group = mine.canonical_group("default")
    with mine.on_accelerators(group_id="default", kind="ext_phase"):
        pass
    with bob.on_accelerators(group_id="default", kind="bob_phase"):
        pass
    services = sdk_client(cp)
    service = next(services)
    try:
        # a lab lease as Lab.lease makes one: its run's phases under an orchestrator lease of the same name, on a
        # group asked by its alias; a checkpoint saved and recorded; metrics logged
        trainer = service.create_lora_training_client(
            base_model=MODEL, rank=8, seed=0, user_metadata={"openrl_lease": "ext-run", "openrl_group": "trainer-group"}
        )
        trainer = trainer.result() if hasattr(trainer, "result") else trainer
        h = {"X-API-Key": cp.api_key}
        r = httpx.put(
            f"{cp.base_url}/api/v1/lab/leases/ext-run",
            headers=h,
            timeout=30,
            json={"group": "trainer-group", "base_model": MODEL, "rank": 8, "model_id": trainer.model_id},
        )
        assert r.status_code == 200, r.text
        checkpoint = trainer.save_state("ext-ckpt").result().path
        r = httpx.patch(
            f"{cp.base_url}/api/v1/lab/leases/ext-run", headers=h, json={"checkpoint": checkpoint}, timeout=30
        )
        assert r.status_code == 200, r.text
        rows = [{"step": s, "time": 1000.0 + s, "metrics": {"reward": s / 10, "loss": 1.0 - s / 10}} for s in range(5)]
        rows.append({"step": 5, "time": 1005.0, "metrics": {"loss": 0.5}})  # a step that logged no reward
        r = httpx.post(f"{cp.base_url}/api/v1/lab/leases/ext-run/metrics", headers=h, json={"rows": rows}, timeout=30)
        assert r.status_code == 200, r.text
        yield {"group": group, "mine": mine, "bob": bob, "checkpoint": checkpoint, "service": service}
    finally:
        next(services, None)
        mine.close()
        bob.close()


# --- the Jupyter server under test ------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_lab_env(monkeypatch):
    for var in ("OPENRL_LAB_URL", "OPENRL_LAB_API_KEY", "TINKER_API_KEY", "OPENRL_LAB_HOME"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def openrl():
    """Which control plane the extension is pointed at; tests parametrize this."""
    return "local"


@pytest.fixture
def jp_server_config(openrl, request, tmp_path):
    if openrl == "none":
        ext = {"home": str(tmp_path / "empty-lab-home")}
    elif openrl == "dead":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ext = {"url": f"http://127.0.0.1:{port}", "api_key": "some-key"}
    elif openrl == "local":  # the lab home's connection.json: the local user's key
        request.getfixturevalue("work")
        ext = {"home": str(request.getfixturevalue("cp").home)}
    elif openrl == "bob":  # URL + key only: the orchestrator's address comes from GET /api/v1/lab/info
        request.getfixturevalue("work")
        ext = {"url": request.getfixturevalue("cp").base_url, "api_key": request.getfixturevalue("bob_key")}
    else:
        raise ValueError(openrl)
    return Config({"ServerApp": {"jpserver_extensions": {"openrl_lab": True}}, "OpenRLLab": ext})


async def get_json(jp_fetch, *path, **params):
    r = await jp_fetch("openrl", "api", *path, params=params or None, raise_error=False)
    return r.code, json.loads(r.body.decode())


async def read(ws, want: str | None = None) -> dict:
    """The next message (of type `want`, skipping others, when given)."""
    while True:
        raw = await asyncio.wait_for(ws.read_message(), 120)
        assert raw is not None, "the stream closed"
        msg = json.loads(raw)
        if want is None or msg["type"] == want:
            return msg


async def wait_until(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# --- authentication, no control plane ---------------------------------------------------------------


@pytest.mark.parametrize("openrl", ["none"])
async def test_every_route_and_the_stream_need_jupyters_token(jp_fetch, jp_http_port, jp_base_url):
    client = tornado.httpclient.AsyncHTTPClient()
    for route in ROUTES:
        url = f"http://localhost:{jp_http_port}{jp_base_url}openrl/api/{route}"
        r = await client.fetch(url, raise_error=False, follow_redirects=False)
        assert r.code in (401, 403), (route, r.code)
        r = await client.fetch(
            url, raise_error=False, follow_redirects=False, headers={"Authorization": "token not-the-token"}
        )
        assert r.code in (401, 403), (route, r.code)
    with pytest.raises(tornado.httpclient.HTTPClientError) as e:
        await tornado.websocket.websocket_connect(f"ws://localhost:{jp_http_port}{jp_base_url}openrl/api/stream")
    assert e.value.code in (401, 403)
    r = await jp_fetch("openrl", "api", "connection")  # with the token: fine
    assert r.code == 200


@pytest.mark.parametrize("openrl", ["none"])
async def test_without_a_control_plane_the_endpoints_say_how_to_start_one(jp_fetch, jp_ws_fetch):
    code, body = await get_json(jp_fetch, "connection")
    assert code == 200 and body["connected"] is False and "openrl-lab serve" in body["message"]
    for route in ROUTES[1:]:
        code, body = await get_json(jp_fetch, *route.split("/"))
        assert code == 503, route
        assert "openrl-lab serve" in body["message"] and "%openrl connect --local" in body["message"]
    ws = await jp_ws_fetch("openrl", "api", "stream")
    ws.write_message(json.dumps({"subscribe": ["leases"], "hz": 5}))
    assert (await read(ws))["type"] == "subscribed"
    err = await read(ws)
    assert err["type"] == "error" and err["status"] == 503 and "openrl-lab serve" in err["message"]
    ws.close()


@pytest.mark.parametrize("openrl", ["dead"])
async def test_a_configured_url_that_does_not_answer_is_a_503_naming_it(jp_fetch):
    code, body = await get_json(jp_fetch, "leases")
    assert code == 503 and "127.0.0.1" in body["message"] and "healthz" in body["message"]
    assert "some-key" not in json.dumps(body)


# --- with a control plane -----------------------------------------------------------------------------


async def test_connection_says_where_but_never_the_key(jp_fetch, cp):
    code, body = await get_json(jp_fetch, "connection")
    assert code == 200 and body["connected"] is True
    assert body["base_url"] == cp.base_url and body["grpc_target"] == cp.grpc_target
    assert cp.api_key not in json.dumps(body)


async def test_leases_are_the_users_own_orchestrator_and_lab_leases(jp_fetch, cp):
    code, body = await get_json(jp_fetch, "leases")
    assert code == 200, body
    names = [L["name"] for L in body["orchestrator_leases"]]
    assert "ext-mine-job" in names
    mine = next(L for L in body["orchestrator_leases"] if L["name"] == "ext-mine-job")
    assert mine["slices"] >= 1 and mine["state"] in ("idle", "holding", "waiting")
    assert [L["name"] for L in body["lab_leases"]] == ["ext-run"]
    assert body["lab_leases"][0]["base_model"] == MODEL and body["lab_leases"][0]["last_step"] == 5
    assert body["warnings"] == []
    text = json.dumps(body)
    assert "bob-secret-job" not in text and cp.api_key not in text


@pytest.mark.parametrize("openrl", ["bob"])
async def test_another_users_key_sees_only_that_users_leases(jp_fetch, cp, bob_key):
    code, body = await get_json(jp_fetch, "leases")
    assert code == 200, body
    assert [L["name"] for L in body["orchestrator_leases"]] == ["bob-secret-job"]
    assert body["lab_leases"] == []
    code, body = await get_json(jp_fetch, "timeline", group="default")
    recs = body["timelines"][0]["records"]
    assert {r["job"] for r in recs if r["mine"]} == {"bob-secret-job"}
    assert "ext-mine-job" not in json.dumps(body)
    assert "ext_phase" not in json.dumps(body)  # another user's phase kind is a name they chose: hidden
    assert ("", "", False) in [(r["job"], r["kind"], r["mine"]) for r in recs]  # the slice itself is shown
    code, body = await get_json(jp_fetch, "metrics", "ext-run")  # the local user's lab lease
    assert code == 404 and "ext-run" in body["message"]
    assert "reward" not in json.dumps(body)
    code, body = await get_json(jp_fetch, "connection")
    assert body["grpc_target"] == cp.grpc_target and bob_key not in json.dumps(body)


async def test_timeline_has_the_phase_the_test_ran_and_others_unnamed(jp_fetch, work):
    code, body = await get_json(jp_fetch, "timeline", group="default")
    assert code == 200, body
    (tl,) = body["timelines"]
    assert tl["group_id"] == "default"
    mine = [r for r in tl["records"] if r["mine"]]
    assert ("ext-mine-job", "ext_phase", "ok") in [(r["job"], r["kind"], r["outcome"]) for r in mine]
    others = [r for r in tl["records"] if not r["mine"]]
    assert others and all(r["job"] == "" for r in others)  # bob's phase (and the kernel's): no names
    assert "bob-secret-job" not in json.dumps(body)
    assert 0.0 <= tl["duty"]["duty_cycle"] <= 1.0 and tl["duty"]["slices"] >= 2
    # since_seq: nothing after the last one
    code, later = await get_json(jp_fetch, "timeline", group="default", since_seq=tl["last_seq"])
    assert code == 200 and later["timelines"][0]["records"] == []
    code, every = await get_json(jp_fetch, "timeline")  # every group
    assert work["group"] in [t["group_id"] for t in every["timelines"]]
    code, body = await get_json(jp_fetch, "timeline", group="no-such-group")
    assert code == 404 and "no-such-group" in body["message"]
    code, body = await get_json(jp_fetch, "timeline", since_seq="soon")
    assert code == 400 and "since_seq" in body["message"]


async def test_queue_shows_position_and_why_a_job_waits(jp_fetch, work):
    mine, bob, group = work["mine"], work["bob"], work["group"]
    held = bob.acquire("default", kind="bob_hold", timeout=60)
    done = threading.Event()

    def wait_for_slice():
        with mine.on_accelerators(group_id="default", kind="ext_wait"):
            pass
        done.set()

    t = threading.Thread(target=wait_for_slice, daemon=True)
    t.start()
    try:

        async def queued():
            code, body = await get_json(jp_fetch, "queue")
            assert code == 200, body
            g = next(g for g in body["groups"] if g["group_id"] == group)
            return bool(g["queue"])

        await wait_until(queued, "the test's job to queue")
        code, body = await get_json(jp_fetch, "queue")
        g = next(g for g in body["groups"] if g["group_id"] == group)
        assert g["holder"]["mine"] is False and g["holder"]["job"] == ""  # bob holds it: not named
        (entry,) = g["queue"]
        assert entry["mine"] and entry["job"] == "ext-mine-job" and entry["position"] == 1
        assert entry["kind"] == "ext_wait" and "another user's job" in entry["reason"]
        assert entry["expected_wait_s"] is not None and entry["expected_wait_s"] >= 0  # bob's phases are known
        assert "bob-secret-job" not in json.dumps(body)
        # the lease rows say the same: waiting, first in line, the orchestrator's sentence and estimate
        code, leases = await get_json(jp_fetch, "leases")
        row = next(r for r in leases["rows"] if r["name"] == "ext-mine-job")
        assert (row["state"], row["queue_position"], row["group"]) == ("waiting", 1, group)
        assert row["reason"] == entry["reason"] and row["expected_wait_s"] is not None
        assert "bob-secret-job" not in json.dumps(leases)
    finally:
        bob.release(held)
        t.join(60)
    assert done.is_set()
    code, body = await get_json(jp_fetch, "queue")
    assert code == 200 and next(g for g in body["groups"] if g["group_id"] == group)["queue"] == []


async def test_metrics_of_a_lab_lease_after_a_step(jp_fetch):
    code, body = await get_json(jp_fetch, "metrics", "ext-run", after_step=2)
    assert code == 200, body
    assert [r["step"] for r in body["rows"]] == [3, 4, 5]
    assert body["rows"][0]["metrics"] == {"reward": 0.3, "loss": 0.7}
    code, body = await get_json(jp_fetch, "metrics", "ext-run")
    assert [r["step"] for r in body["rows"]] == [0, 1, 2, 3, 4, 5]


async def test_metrics_of_an_unknown_lease_is_a_404_with_a_message(jp_fetch):
    code, body = await get_json(jp_fetch, "metrics", "no-such-lease")
    assert code == 404 and "no-such-lease" in body["message"]
    code, body = await get_json(jp_fetch, "metrics", "ext-run", after_step="x")
    assert code == 400 and "after_step" in body["message"]


# --- the stream ---------------------------------------------------------------------------------------


async def test_stream_pushes_updates_at_the_chosen_rate_and_obeys_pause(jp_ws_fetch, cp):
    ws = await jp_ws_fetch("openrl", "api", "stream")
    ws.write_message(
        json.dumps(
            {"subscribe": ["leases", "queue", "timeline", "metrics:ext-run", "metrics:no-such-lease"], "hz": 1000}
        )
    )
    ack = await read(ws)
    assert ack == {
        "type": "subscribed",
        "topics": ["leases", "queue", "timeline", "metrics:ext-run", "metrics:no-such-lease"],
        "hz": 10.0,
    }  # capped
    first, second = await read(ws, "update"), await read(ws, "update")
    assert second["seq"] == first["seq"] + 1
    assert "ext-mine-job" in [L["name"] for L in first["leases"]["orchestrator_leases"]]
    assert first["queue"]["groups"] and "leases" in second.get("unchanged", []) + list(second)
    recs = [r for t in first["timeline"]["timelines"] for r in t["records"]]
    assert any(r["kind"] == "ext_phase" and r["mine"] for r in recs)
    assert [r["step"] for r in first["metrics:ext-run"]["rows"]] == [0, 1, 2, 3, 4, 5]
    assert [r["name"] for r in first["leases"]["rows"]][:1] == ["ext-run"]  # the same object as the GET
    assert second["metrics:ext-run"]["rows"] == []  # deltas: only rows after the last one sent
    assert first["metrics:no-such-lease"]["status"] == 404
    for msg in (first, second):
        text = json.dumps(msg)
        assert "bob-secret-job" not in text and cp.api_key not in text

    ws.write_message(json.dumps({"pause": True}))
    await read(ws, "paused")  # updates already under way may come before this; none after it
    paused_ticks = 0
    while paused_ticks < 3:  # ticks keep firing while paused, but send nothing
        ws.write_message(json.dumps({"ping": paused_ticks}))
        msg = await read(ws)
        assert msg["type"] == "pong" and msg["paused"] is True, msg
        paused_ticks = msg["paused_ticks"]
        await asyncio.sleep(0.05)
    sent = msg["updates"]
    ws.write_message(json.dumps({"pause": False}))
    assert (await read(ws))["type"] == "resumed"
    after = await read(ws, "update")
    assert after["seq"] == sent + 1
    ws.close()


async def test_stream_refuses_bad_requests_with_a_message(jp_ws_fetch):
    ws = await jp_ws_fetch("openrl", "api", "stream")
    for bad, words in (
        (["leases"], "JSON objects"),
        ({"subscribe": ["gpu-temps"]}, "unknown topic"),
        ({"subscribe": ["leases"], "hz": 0}, "hz"),
        ({"shout": 1}, "unknown field"),
    ):
        ws.write_message(json.dumps(bad))
        msg = await read(ws)
        assert msg["type"] == "error" and msg["status"] == 400 and words in msg["message"], msg
    ws.write_message(json.dumps({"subscribe": ["queue"], "hz": 0.5}))  # the stream still works
    assert (await read(ws))["hz"] == 0.5
    assert "queue" in await read(ws, "update")
    ws.close()


# --- behind JupyterHub's proxy ------------------------------------------------------------------------


@pytest.mark.parametrize("jp_base_url", ["/user/alice/"])
async def test_routes_live_under_the_servers_base_url(jp_fetch, jp_ws_fetch, jp_http_port, jp_auth_header, cp):
    code, body = await get_json(jp_fetch, "connection")  # jp_fetch prefixes /user/alice/
    assert code == 200 and body["base_url"] == cp.base_url
    code, body = await get_json(jp_fetch, "leases")
    assert code == 200 and "ext-mine-job" in [L["name"] for L in body["orchestrator_leases"]]
    r = await tornado.httpclient.AsyncHTTPClient().fetch(
        f"http://localhost:{jp_http_port}/openrl/api/connection", headers=jp_auth_header, raise_error=False
    )
    assert r.code == 404
    ws = await jp_ws_fetch("openrl", "api", "stream")
    ws.write_message(json.dumps({"subscribe": ["leases"], "hz": 5}))
    assert "leases" in await read(ws, "update")
    ws.close()


# --- the joined lease rows and the release route (issue 12) ------------------------------------------


async def test_leases_rows_join_the_lab_lease_with_its_orchestrator_lease(jp_fetch, work):
    from openrl_lab.lab.rows import ROW_KEYS

    code, body = await get_json(jp_fetch, "leases")
    assert code == 200, body
    rows = {r["name"]: r for r in body["rows"]}
    assert all(set(r) == set(ROW_KEYS) for r in body["rows"])
    run = rows["ext-run"]
    print("ROW", json.dumps(run))
    assert run["group"] == work["group"]  # the canonical group its orchestrator lease is on, not the alias asked
    assert run["state"] in ("idle", "evicted", "running") and run["slices"] >= 1  # its phases ran on its lease
    assert (run["reason"], run["queue_position"], run["expected_wait_s"]) == ("", 0, None)  # only when waiting
    assert run["kernel"] == "kernel-default" and run["host"]
    assert run["model_id"] and run["base_model"] == MODEL
    assert run["last_step"] == 5 and run["last_metrics"] == {"loss": 0.5}
    assert run["last_reward"] == pytest.approx(0.4)  # the last reward logged, steps back
    assert run["last_checkpoint"] == work["checkpoint"] and run["last_checkpoint"].startswith("tinker://")
    assert run["checkpoint_time"] and abs(run["checkpoint_time"] - time.time()) < 3600
    assert rows["ext-mine-job"]["kernel"] is None  # an orchestrator lease of the user's own script
    live = [r for r in body["rows"] if r["group"] == work["group"] and r["state"] != "lost"]
    assert sum(r["share"] for r in live) == pytest.approx(1.0)
    assert "bob-secret-job" not in json.dumps(body)


async def post_json(jp_fetch, *path):
    r = await jp_fetch("openrl", "api", *path, method="POST", body="", raise_error=False)
    return r.code, json.loads(r.body.decode())


async def test_release_route_releases_the_users_lab_lease_then_404s(jp_fetch, jp_http_port, jp_base_url, cp, work):
    service = work["service"]
    doomed = service.create_lora_training_client(
        base_model=MODEL, rank=4, seed=1, user_metadata={"openrl_lease": "ext-doomed", "openrl_group": "default"}
    ).result()
    h = {"X-API-Key": cp.api_key}
    r = httpx.put(
        f"{cp.base_url}/api/v1/lab/leases/ext-doomed",
        headers=h,
        timeout=30,
        json={"group": "default", "base_model": MODEL, "rank": 4, "model_id": doomed.model_id},
    )
    assert r.status_code == 200, r.text
    url = f"http://localhost:{jp_http_port}{jp_base_url}openrl/api/leases/ext-doomed/release"
    r = await tornado.httpclient.AsyncHTTPClient().fetch(url, method="POST", body="", raise_error=False)
    assert r.code in (401, 403)  # Jupyter's authentication first
    assert httpx.get(f"{cp.base_url}/api/v1/lab/leases/ext-doomed", headers=h, timeout=30).status_code == 200

    code, body = await post_json(jp_fetch, "leases", "ext-doomed", "release")
    assert (code, body) == (200, {"released": "ext-doomed"})
    assert httpx.get(f"{cp.base_url}/api/v1/lab/leases/ext-doomed", headers=h, timeout=30).status_code == 404
    code, body = await get_json(jp_fetch, "leases")
    assert "ext-doomed" not in [r["name"] for r in body["rows"] if r["state"] != "idle" or r["kernel"]]
    assert "ext-doomed" not in [L["name"] for L in body["lab_leases"]]
    code, body = await post_json(jp_fetch, "leases", "ext-doomed", "release")  # again: none of that name now
    assert code == 404 and "ext-doomed" in body["message"] and body["status"] == 404
    code, body = await post_json(jp_fetch, "leases", "never-was", "release")
    assert code == 404 and "never-was" in body["message"]


@pytest.mark.parametrize("openrl", ["bob"])
async def test_release_of_another_users_lease_is_a_404_and_leaves_it_alone(jp_fetch, cp):
    code, body = await post_json(jp_fetch, "leases", "ext-run", "release")  # the local user's lab lease
    assert code == 404 and "ext-run" in body["message"]
    r = httpx.get(f"{cp.base_url}/api/v1/lab/leases/ext-run", headers={"X-API-Key": cp.api_key}, timeout=30)
    assert r.status_code == 200 and r.json()["model_id"]  # still there, for its owner


@pytest.mark.parametrize("openrl", ["none"])
async def test_release_from_a_browser_session_needs_the_xsrf_token(jp_fetch, jp_http_port, jp_base_url, jp_auth_header):
    """A browser is logged in by a cookie: then, as for every Jupyter POST, the `_xsrf` cookie's value must come
    back in X-XSRFToken (the sidebar sends it), else 403 before anything is released."""
    client = tornado.httpclient.AsyncHTTPClient()
    base = f"http://localhost:{jp_http_port}{jp_base_url}"
    token = jp_auth_header["Authorization"].split()[-1]
    r = await client.fetch(f"{base}api/status?token={token}", raise_error=False, follow_redirects=False)
    cookies = [c.split(";")[0] for c in r.headers.get_list("Set-Cookie")]
    assert cookies, r.headers  # the login cookie
    url = f"{base}openrl/api/leases/some-run/release"
    r = await client.fetch(url, method="POST", body="", raise_error=False, headers={"Cookie": "; ".join(cookies)})
    assert r.code == 403, r.code  # no XSRF token
    r = await client.fetch(
        url,
        method="POST",
        body="",
        raise_error=False,
        headers={"Cookie": "; ".join([*cookies, "_xsrf=abc123"]), "X-XSRFToken": "abc123"},
    )
    assert r.code == 503 and "openrl-lab serve" in json.loads(r.body)["message"]  # through to the extension
