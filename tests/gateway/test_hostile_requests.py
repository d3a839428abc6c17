"""Hostile and malformed requests (issue 9, findings 4b, 6 and 7): each is refused with a 4xx that names the
problem, nothing of it is stored, and no answer shows where the server keeps its files. Real server, raw HTTP
where the SDK would refuse to send the request itself."""

from __future__ import annotations

import re
import shutil
import socket
import time

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from prometheus_client.parser import text_string_to_metric_families
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from openrl_lab.gateway.bodies import MAX_BODY
from openrl_lab.gateway.gateway import MAX_CHECKPOINT_NAME_BYTES
from openrl_lab.gateway.store import Store

from .helpers import MODEL, new_trainer
from .test_wire_and_bad_input import Api, _datum

NAN = b'{"tags": [], "user_metadata": {"loss": NaN}, "sdk_version": "raw", "type": "create_session"}'
HOSTILE_BODIES = {  # body -> words the 400 must contain
    "malformed JSON": (b'{"session_id": "s", ', "not valid JSON"),
    "invalid UTF-8": (b'{"session_id": "\xff\xfe"}', "UTF-8"),
    "a JSON list": (b"[1, 2, 3]", "dictionary"),
    "NaN": (b'{"tinker_path": NaN, "session_id": NaN}', "NaN"),
    "1e999": (b'{"tinker_path": 1e999, "session_id": 1e999}', "finite"),
    "an int past int64": (b'{"tinker_path": 9223372036854775808, "session_id": 9223372036854775808}', "64 bits"),
    "a lone surrogate": (b'{"tinker_path": "\\ud800", "session_id": "\\ud800"}', "surrogate"),
}


@pytest.fixture(scope="module")
def api(lab):
    return Api(lab.base_url, lab.api_key)


@pytest.fixture(scope="module")
def model_id(api):
    return api.model(api.session(), 0, {"rank": 2})


def json_routes(lab) -> list[tuple[str, str]]:
    """(method, URL) of every route the OpenAPI schema gives a JSON body, path parameters filled in (the Tinker
    API's under /api/v1, the sandbox's at the root)."""
    schema = httpx.get(f"{lab.base_url}/openapi.json").json()
    routes = [
        (method.upper(), lab.base_url + path.replace("{", "").replace("}", ""))
        for path, ops in schema["paths"].items()
        for method, op in ops.items()
        if "application/json" in op.get("requestBody", {}).get("content", {}) and not path.endswith("/telemetry")
    ]  # telemetry is discarded unread
    assert len(routes) >= 24 and (("POST", f"{lab.base_url}/sandbox/run_code") in routes), routes
    return routes


def test_a_client_that_hangs_up_mid_body_is_a_counted_499_not_a_traceback(lab):
    """Every route with a body, sent half of it by a client that then hangs up (a killed notebook): no
    "Exception in ASGI application" in the server's log, and /metrics counts each as status 499."""
    schema = httpx.get(f"{lab.base_url}/openapi.json").json()
    routes = [
        (method.upper(), re.sub(r"\{[^}]*\}", "x", path), next(iter(op["requestBody"]["content"])))
        for path, ops in schema["paths"].items()
        for method, op in ops.items()
        if op.get("requestBody", {}).get("content") and not path.endswith("/telemetry")  # read by nobody
    ]
    assert any(p == "/api/v1/forward_backward" for _, p, _ in routes), routes  # the raw (protobuf) body too
    log = lab.home / "server.log"
    log_before = log.stat().st_size

    def hung_up() -> float:
        text = httpx.get(f"{lab.base_url}/metrics", timeout=30).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "openrl_http_requests_total" and s.labels["status"] == "499"
        )

    before = hung_up()
    url = httpx.URL(lab.base_url)
    for method, path, content_type in routes:
        with socket.create_connection((url.host, url.port), timeout=10) as conn:
            head = (
                f"{method} {path} HTTP/1.1\r\nHost: {url.host}\r\nX-API-Key: {lab.api_key}\r\n"
                f"Content-Type: {content_type}\r\nContent-Length: 4096\r\n\r\n"
            )
            conn.sendall(head.encode() + b"{" * 100)  # a quarter of what it announced, then gone
    deadline = time.monotonic() + 60
    while hung_up() < before + len(routes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert hung_up() == before + len(routes), "each hang-up is counted once, as a 499"
    with log.open("rb") as f:
        f.seek(log_before)
        new = f.read().decode(errors="replace")
    assert "Traceback" not in new and "Exception in ASGI application" not in new, new[-3000:]
    assert len(new.splitlines()) <= len(routes), f"one line per hang-up at most:\n{new[-3000:]}"


@pytest.mark.parametrize("kind", sorted(HOSTILE_BODIES))
def test_every_json_route_refuses_a_hostile_body_with_a_named_400(lab, api, kind):
    body, words = HOSTILE_BODIES[kind]
    for method, path in json_routes(lab):
        r = api.http.request(method, path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (method, path, r.status_code, r.text)
        assert words in r.json()["detail"], (method, path, r.json())


@pytest.mark.parametrize(
    "headers, words",
    [
        ({}, "missing X-API-Key header"),
        ({"X-API-Key": ""}, "the X-API-Key header is empty"),
        ({"X-API-Key": "tml-schlüssel".encode()}, "X-API-Key is not a key: keys are ASCII"),
        ({"X-API-Key": "tml-not-a-key"}, "unknown API key"),
        ({"Authorization": "Bearer tml-not-a-key"}, "from X-API-Key only, not from the Authorization header"),
        ({"Authorization": ""}, "from X-API-Key only, not from the Authorization header"),
    ],
)
def test_each_bad_api_key_is_a_401_that_names_the_header_sent(lab, headers, words):
    r = httpx.post(f"{lab.base_url}/api/v1/create_session", headers=headers, json={})
    assert r.status_code == 401, r.text
    detail = r.json()["detail"]
    assert words in detail, detail
    if "Authorization" not in headers:
        assert "Authorization" not in detail, f"names a header the client never sent: {detail}"


def test_integers_past_int64_never_reach_sqlite(api, model_id):
    big = 2**63
    for path in (f"/training_runs?limit={big}", f"/checkpoints?offset={big}", f"/sessions?offset={big}"):
        r = api.http.get(path)
        assert r.status_code == 400 and "less than or equal" in r.json()["detail"], (path, r.text)
    r = api.post(
        "/optim_step",
        json={"model_id": model_id, "seq_id": big, "type": "optim_step", "adam_params": {"learning_rate": 0.01}},
    )
    assert r.status_code == 400 and "seq_id: integer 9223372036854775808" in r.json()["detail"], r.text
    leased = api.model(api.session(), 0, {"rank": 2})  # its own: releasing the lease drops the model's job
    r = api.http.put("/lab/leases/big-rank", json={"base_model": MODEL, "model_id": leased, "rank": big})
    assert r.status_code == 400 and "rank" in r.json()["detail"], r.text
    assert api.http.put("/lab/leases/big-rank", json={"base_model": MODEL, "model_id": leased}).status_code == 200
    r = api.http.get(f"/lab/leases/big-rank/metrics?after_step={big}")
    assert r.status_code == 400 and "after_step" in r.json()["detail"], r.text
    assert api.http.delete("/lab/leases/big-rank").status_code == 200


def test_non_finite_numbers_are_refused_and_never_stored(lab, api):
    sessions_before = api.http.get("/sessions?limit=10000").json()["sessions"]
    assert api.post("/create_session", content=NAN).status_code == 400
    assert api.post("/create_session", content=NAN.replace(b"NaN", b"1e999")).status_code == 400
    assert api.http.get("/sessions?limit=10000").json()["sessions"] == sessions_before
    sid = api.session()
    r = api.post(
        "/create_model",
        content=b'{"session_id": "%s", "model_seq_id": 0, "base_model": "%s", '
        b'"user_metadata": {"x": -Infinity}}' % (sid.encode(), MODEL.encode()),
    )
    assert r.status_code == 400 and "Infinity" in r.json()["detail"], r.text
    model = api.model(sid, 1, {"rank": 2})
    assert api.http.put("/lab/leases/finite", json={"base_model": MODEL, "model_id": model}).status_code == 200
    r = api.post("/lab/leases/finite/metrics", content=b'{"rows": [{"step": 0, "time": 1e999, "metrics": {"r": 1}}]}')
    assert r.status_code == 400 and "rows.0.time" in r.json()["detail"], r.text
    r = api.post("/lab/leases/finite/metrics", content=b'{"rows": [{"step": 0, "metrics": {"r": NaN}}]}')
    assert r.status_code == 400 and "NaN" in r.json()["detail"], r.text
    assert api.http.get("/lab/leases/finite/metrics").json() == {"rows": []}
    assert api.http.get("/training_runs?limit=10000").status_code == 200  # every listing still reads
    assert api.http.delete("/lab/leases/finite").status_code == 200


def test_metadata_the_sdk_cannot_read_back_is_refused(api):
    r = api.post("/create_session", json={"tags": [], "user_metadata": {"epochs": 3}, "sdk_version": "raw"})
    assert r.status_code == 400 and "'epochs': values must be strings" in r.json()["detail"], r.text
    r = api.post(
        "/create_model",
        json={"session_id": api.session(), "model_seq_id": 0, "base_model": MODEL, "user_metadata": {"lr": 0.1}},
    )
    assert r.status_code == 400 and "'lr': values must be strings" in r.json()["detail"], r.text


def test_rows_stored_before_the_checks_existed_still_read(lab):
    """Metadata the gateway once let through (a number, NaN) and an expiry past year 9999: the SDK still reads
    the owner's runs."""
    store = Store(lab.home / "state.db")  # the server's own database, written as an older server did
    try:
        store.add_model("legacy:train:0", "local", "legacy", MODEL, None, {"loss": float("nan")}, "old-epoch")
        store.add_checkpoint(
            "tinker://legacy:train:0/weights/old",
            "local",
            "legacy:train:0",
            "weights/old",
            "training",
            str(lab.home / "nowhere"),
            1,
            10**15,
            {"epochs": 3},
        )
    finally:
        store.close()
    rest = tinker.RestClient(base_url=lab.base_url, api_key=lab.api_key)
    run = rest.get_training_run("legacy:train:0").result()
    assert run.user_metadata == {"loss": "NaN"}
    assert run.last_checkpoint.user_metadata == {"epochs": "3"} and run.last_checkpoint.expires_at is None
    assert "legacy:train:0" in {r.training_run_id for r in rest.list_training_runs(limit=10_000).result().training_runs}


def test_a_directory_that_is_not_a_model_is_refused_like_a_missing_one(api, tmp_path):
    (tmp_path / "not-a-model").mkdir()
    details = {}
    for name in ("not-a-model", "missing"):
        r = api.post(
            "/create_model", json={"session_id": api.session(), "model_seq_id": 0, "base_model": str(tmp_path / name)}
        )
        assert r.status_code == 400, r.text
        details[name] = r.json()["detail"].replace(name, "NAME")
    assert details["not-a-model"] == details["missing"]  # the answer does not tell which directories exist


def test_a_checkpoint_name_over_the_limit_is_refused_before_the_kernel(lab, service):
    trainer = new_trainer(service)
    for name in ("n" * 256, "é" * (MAX_CHECKPOINT_NAME_BYTES // 2 + 1)):
        with pytest.raises(tinker.BadRequestError, match="too long") as err:
            trainer.save_state(name).result()
        assert str(lab.home) not in str(err.value)
    assert not (lab.home / "checkpoints" / "local" / trainer.model_id / "weights").exists()
    # the longest name allowed leaves room for the atomic write's temporary siblings
    assert trainer.save_state("n" * MAX_CHECKPOINT_NAME_BYTES).result().path.endswith("n" * MAX_CHECKPOINT_NAME_BYTES)


def test_a_huge_ttl_is_refused_before_any_file_is_written(lab, api, model_id):
    target = lab.home / "checkpoints" / "local" / model_id / "weights" / "ttl"
    for seq, ttl in ((1, 10**400), (2, 10**12)):
        r = api.post("/save_weights", json={"model_id": model_id, "path": "ttl", "seq_id": seq, "ttl_seconds": ttl})
        assert r.status_code == 400 and "ttl_seconds" in r.json()["detail"], r.text
        assert not target.exists()
    ok = api.post("/save_weights", json={"model_id": model_id, "path": "ttl", "seq_id": 3, "ttl_seconds": 3600})
    assert ok.status_code == 200, ok.text
    saved = api.result(ok.json()["request_id"]).json()
    assert saved["path"].endswith("/weights/ttl"), saved
    r = api.http.put(f"/training_runs/{model_id}/checkpoints/weights/ttl/ttl", json={"ttl_seconds": 10**12})
    assert r.status_code == 400 and "ttl_seconds" in r.json()["detail"], r.text
    listed = api.http.get(f"/training_runs/{model_id}/checkpoints").json()["checkpoints"]
    assert [c["expires_at"] is not None for c in listed if c["checkpoint_id"] == "weights/ttl"] == [True]


def _proto(model_id: str, seq: int, n_data: int = 1) -> pb.ForwardBackwardRequest:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[_datum([1, 2, 3], target_tokens=[2, 3, 4])] * n_data, loss_fn="cross_entropy"
        ),
        model_id=model_id,
        seq_id=seq,
    )
    return forward_backward_request_to_proto(req)


def _short_tokens(msg):
    msg.data[0].model_input[0].encoded_text.tokens = b"\x01\x00\x00\x00\x02"


def _unknown_dtype(msg):
    msg.data[0].loss_fn_inputs["target_tokens"].dtype = 99


def _negative_shape(msg):
    msg.data[0].loss_fn_inputs["target_tokens"].shape[0] = -3


def _bad_crow(msg):
    tensor = msg.data[0].loss_fn_inputs["target_tokens"]
    tensor.shape[:] = [3, 1]
    tensor.sparse_csr.values = np.array([2], np.int64).tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 5, 5, 5], np.int64).tobytes()
    tensor.sparse_csr.col_indices = np.array([0], np.int64).tobytes()


def _sparse_rows_bomb(msg):  # 2 million empty rows: 16 MB of crow_indices, a few KB once zstd-encoded
    tensor = msg.data[0].loss_fn_inputs["target_tokens"]
    tensor.shape[:] = [2_000_000, 1]
    tensor.sparse_csr.crow_indices = np.zeros(2_000_001, np.int64).tobytes()


BAD_PROTOS = {  # mutation -> words the 400 must contain
    "short encoded_text.tokens": (_short_tokens, "not a whole number of int32"),
    "unknown tensor dtype": (_unknown_dtype, "unsupported tensor dtype number 99"),
    "negative shape": (_negative_shape, "negative dimension"),
    "inconsistent sparse rows": (_bad_crow, "do not describe"),
    "sparse rows bomb": (_sparse_rows_bomb, "more than the model's context"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROTOS))
def test_bad_protobuf_bodies_are_named_400s(api, model_id, case):
    mutate, words = BAD_PROTOS[case]
    msg = _proto(model_id, 1)
    mutate(msg)
    body = zstandard.ZstdCompressor().compress(msg.SerializeToString())
    r = api.post(
        "/forward_backward",
        content=body,
        headers={"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"},
    )
    assert r.status_code == 400 and words in r.json()["detail"], r.text


def test_too_many_datums_and_unknown_encodings_are_named_400s(api, model_id):
    r = api.post("/forward_backward", content=_proto(model_id, 1, n_data=1025).SerializeToString())
    assert r.status_code == 400 and "at most 1024" in r.json()["detail"], r.text
    r = api.post("/forward_backward", content=b"x", headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "'gzip' is not supported" in r.json()["detail"], r.text


def zstd_bomb(declared: bool) -> bytes:
    """1 GiB of zeros as a ~32 KB zstd frame (declaring its size in the frame header, or not)."""
    compressor = zstandard.ZstdCompressor(write_content_size=declared).compressobj(size=2**30 if declared else -1)
    zeros = bytes(2**20)
    return b"".join(compressor.compress(zeros) for _ in range(1024)) + compressor.flush()


def test_zstd_bombs_are_refused_without_being_decoded(api):
    r = api.post("/forward_backward", content=zstd_bomb(declared=True), headers={"Content-Encoding": "zstd"})
    assert r.status_code == 400 and "declares 1073741824 bytes" in r.json()["detail"], r.text  # read from the header
    r = api.post("/forward_backward", content=zstd_bomb(declared=False), headers={"Content-Encoding": "zstd"})
    assert r.status_code == 400 and "decompresses to more than" in r.json()["detail"], r.text


def test_bodies_over_the_documented_limit_get_a_413_and_are_not_stored(lab, api):
    assert f"at most {MAX_BODY // 1024} KiB" in httpx.get(f"{lab.base_url}/openapi.json").json()["info"]["description"]
    sessions_before = api.http.get("/sessions?limit=10000").json()["sessions"]
    big = b'{"tags": [], "sdk_version": "raw", "user_metadata": {"blob": "%s"}}' % (b"x" * MAX_BODY)
    assert api.post("/create_session", content=big).status_code == 413
    chunked = api.post("/create_session", content=iter([big[:1000], big[1000:]]))  # no Content-Length
    assert chunked.status_code == 413 and "Too Large" in chunked.text
    assert api.http.get("/sessions?limit=10000").json()["sessions"] == sessions_before


def test_errors_show_no_server_path(lab, service):
    """A checkpoint whose files went missing behind the server's back: the kernel's error names the file, but
    neither the HTTP answer nor the future's error shows the server's home."""
    trainer = new_trainer(service)
    state = trainer.save_state("vanishing").result().path
    sampler = trainer.save_weights_for_sampler("vanishing-s").result().path
    for segment in ("weights/vanishing", "sampler_weights/vanishing-s"):
        shutil.rmtree(lab.home / "checkpoints" / "local" / trainer.model_id / segment)
    with pytest.raises(tinker.RequestFailedError) as in_future:
        service.create_training_client_from_state(state).result()
    with pytest.raises(tinker.BadRequestError) as in_answer:
        service.create_sampling_client(model_path=sampler).result()
    for err in (in_future, in_answer):
        assert "vanishing" in str(err.value) and str(lab.home) not in str(err.value), err.value


@pytest.mark.parametrize(
    "method,path,status,words",
    [
        ("GET", "/api/v1/no/such/route", 404, "no such endpoint: GET /api/v1/no/such/route"),
        ("POST", "/api/v1/nothing-here", 404, "no such endpoint: POST /api/v1/nothing-here"),
        ("DELETE", "/api/v1/healthz", 405, "DELETE is not allowed on /api/v1/healthz (allowed: GET)"),
    ],
)
def test_unrouted_requests_get_the_same_error_body_as_every_refusal(lab, method, path, status, words):
    r = httpx.request(method, f"{lab.base_url}{path}", headers={"X-API-Key": lab.api_key})
    assert r.status_code == status and r.json() == {"detail": words, "error": words}, (r.status_code, r.text)
    if status == 405:
        assert r.headers["allow"] == "GET"
