"""The HTTP API below the SDK: ordering, dedup, bad input, ownership. Real server, raw HTTP where the SDK
would refuse to send the bad request itself."""

from __future__ import annotations

import base64
import json
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from ..conftest import make_key
from .helpers import MODEL, TEXTS, new_trainer, sft_batch


class Api:
    def __init__(self, base_url: str, key: str):
        self.http = httpx.Client(base_url=base_url + "/api/v1", headers={"X-API-Key": key}, timeout=60)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.http.post(path, **kw)

    def result(self, request_id: str, proto: bool = True) -> httpx.Response:
        """The future's result; `proto`: accepting protobuf, as the SDK does for forward_backward and sample results
        (else they come as JSON)."""
        headers = {"Accept": "application/x-protobuf, application/json"} if proto else {}
        while True:
            r = self.post(
                "/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False}, headers=headers
            )
            if r.headers["content-type"].startswith("application/json") and r.json().get("type") == "try_again":
                continue
            return r

    def session(self) -> str:
        return self.post(
            "/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "raw", "type": "create_session"}
        ).json()["session_id"]

    def model(self, session_id: str, seq: int = 0, lora: dict | None = None) -> str:
        body = {"session_id": session_id, "model_seq_id": seq, "base_model": MODEL, "type": "create_model"}
        if lora is not None:
            body["lora_config"] = lora
        r = self.post("/create_model", json=body)
        assert r.status_code == 200, r.text
        out = self.result(r.json()["request_id"])
        assert out.status_code == 200 and "model_id" in out.json(), out.text
        return out.json()["model_id"]

    def fb(
        self, model_id: str, seq: int, data, loss_fn="cross_entropy", forward_only=False, config=None
    ) -> httpx.Response:
        req = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
            model_id=model_id,
            seq_id=seq,
        )
        msg = forward_backward_request_to_proto(req)
        msg.forward_only = forward_only
        return self.post(
            "/forward_backward", content=msg.SerializeToString(), headers={"Content-Type": "application/x-protobuf"}
        )

    def fb_json(
        self, model_id: str, seq: int, data, loss_fn="cross_entropy", forward_only=False, config=None
    ) -> httpx.Response:
        """The same request as JSON, as tinker SDKs before 0.25 send it (`forward_only`: to /forward)."""
        given = {"data": [datum_json(d) for d in data], "loss_fn": loss_fn}
        if config is not None:
            given["loss_fn_config"] = config
        key, path = ("forward_input", "/forward") if forward_only else ("forward_backward_input", "/forward_backward")
        body = json.dumps({key: given, "model_id": model_id, "seq_id": seq})  # NaN as Python writes it: refused
        return self.post(path, content=body, headers={"Content-Type": "application/json"})


def datum_json(d: types.Datum) -> dict:
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": d.model_input.to_ints()}]},
        "loss_fn_inputs": {
            k: {"data": v.tolist(), "dtype": v.dtype, "shape": list(v.shape)} for k, v in d.loss_fn_inputs.items()
        },
    }


def decode_logprobs(body: bytes) -> list[np.ndarray]:
    from tinker.proto.response_conv import deserialize_forward_backward_output

    out = deserialize_forward_backward_output(body)
    return [np.asarray(o["logprobs"].tolist()) for o in out.loss_fn_outputs]


@pytest.fixture(scope="module")
def api(lab):
    return Api(lab.base_url, lab.api_key)


@pytest.fixture(scope="module")
def tok(service):
    return new_trainer(service).get_tokenizer()


def test_requests_run_in_seq_order_whatever_order_they_arrive(api, tok):
    batch = sft_batch(tok, TEXTS[:2])
    sid = api.session()
    ref, test = api.model(sid, 0, {"rank": 4, "seed": 1}), api.model(sid, 1, {"rank": 4, "seed": 1})
    adam = {"learning_rate": 0.05, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    # In order on `ref`: fb(1), optim(2), forward(3).
    r1 = api.fb(ref, 1, batch).json()["request_id"]
    r2 = api.post("/optim_step", json={"model_id": ref, "seq_id": 2, "adam_params": adam, "type": "optim_step"}).json()[
        "request_id"
    ]
    r3 = api.fb(ref, 3, batch, forward_only=True).json()["request_id"]
    api.result(r1), api.result(r2)
    expected = decode_logprobs(api.result(r3).content)
    # Reversed on `test`: forward(3) arrives first, then optim(2), then fb(1).
    t3 = api.fb(test, 3, batch, forward_only=True).json()["request_id"]
    t2 = api.post(
        "/optim_step", json={"model_id": test, "seq_id": 2, "adam_params": adam, "type": "optim_step"}
    ).json()["request_id"]
    time.sleep(0.3)
    t1 = api.fb(test, 1, batch).json()["request_id"]
    got = decode_logprobs(api.result(t3).content)
    for x, y in zip(expected, got):
        np.testing.assert_array_equal(x, y)
    assert api.result(t1).status_code == 200 and api.result(t2).status_code == 200
    # A resent request (same model, same seq_id) is the same request, not a second step.
    assert api.fb(test, 1, batch).json()["request_id"] == t1


def test_full_fine_tuning_without_lora(api, tok):
    sid = api.session()
    model_id = api.model(sid, 0, lora=None)
    info = api.post("/get_info", json={"model_id": model_id, "type": "get_info"}).json()
    assert info["is_lora"] is False
    batch = sft_batch(tok, TEXTS)
    adam = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 1.0}
    losses = []
    for step in range(4):
        r = api.fb(model_id, 2 * step + 1, batch).json()["request_id"]
        o = api.post(
            "/optim_step",
            json={"model_id": model_id, "seq_id": 2 * step + 2, "adam_params": adam, "type": "optim_step"},
        ).json()["request_id"]
        from tinker.proto.response_conv import deserialize_forward_backward_output

        losses.append(deserialize_forward_backward_output(api.result(r).content).metrics["loss:sum"])
        assert api.result(o).status_code == 200
    assert losses[-1] < losses[0]


# --- bad input: every case a 4xx whose message names the problem, and the server keeps serving -------


def _datum(ids, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(ids), loss_fn_inputs=inputs)


BAD_FORWARD_BACKWARD = {
    "token id outside vocab": (
        lambda vocab: [_datum([1, 2, vocab + 5], target_tokens=[2, 3, 4])],
        "cross_entropy",
        "outside the vocabulary",
    ),
    "target outside vocab": (
        lambda vocab: [_datum([1, 2, 3], target_tokens=[2, 3, -1])],
        "cross_entropy",
        "outside the vocabulary",
    ),
    "empty data": (lambda vocab: [], "cross_entropy", "no data"),
    "length mismatch": (lambda vocab: [_datum([1, 2, 3], target_tokens=[2, 3])], "cross_entropy", "same length"),
    "nan advantages": (
        lambda vocab: [_datum([1, 2], target_tokens=[2, 3], logprobs=[-1.0, -1.0], advantages=[float("nan"), 1.0])],
        "importance_sampling",
        "NaN or inf",
    ),
    "inf advantages": (
        lambda vocab: [_datum([1, 2], target_tokens=[2, 3], logprobs=[-1.0, -1.0], advantages=[1.0, float("inf")])],
        "ppo",
        "NaN or inf",
    ),
    "unknown loss": (lambda vocab: [_datum([1, 2], target_tokens=[2, 3])], "hinge", "unknown loss_fn"),
    "missing inputs": (lambda vocab: [_datum([1, 2], target_tokens=[2, 3])], "ppo", "needs loss_fn_inputs"),
    "past the context": (lambda vocab: [_datum([1] * 600, target_tokens=[1] * 600)], "cross_entropy", "context"),
}


@pytest.mark.parametrize("wire", ["protobuf", "json"])
@pytest.mark.parametrize("case", sorted(BAD_FORWARD_BACKWARD))
def test_bad_forward_backward_gets_a_named_4xx(api, case, wire):
    make, loss_fn, words = BAD_FORWARD_BACKWARD[case]
    if wire == "json" and ("nan" in case or "inf" in case):
        words = "numbers must be finite"  # JSON has no NaN or infinity: refused as the body is read
    sid = api.session()
    model_id = api.model(sid, 0, {"rank": 2})
    send = api.fb if wire == "protobuf" else api.fb_json
    r = send(model_id, 1, make(vocab_size(api, model_id)), loss_fn=loss_fn)
    assert 400 <= r.status_code < 500, r.text
    assert words in r.json()["detail"], r.json()
    # still serving, and the refused seq_id does not block the next request
    ok = send(model_id, 2, [_datum([1, 2], target_tokens=[2, 3])])
    assert ok.status_code == 200 and api.result(ok.json()["request_id"]).status_code == 200


def vocab_size(api, model_id):
    caps = api.http.get("/get_server_capabilities").json()
    assert caps["supported_models"]
    from transformers import AutoTokenizer

    info = api.post("/get_info", json={"model_id": model_id, "type": "get_info"}).json()
    return len(AutoTokenizer.from_pretrained(info["model_data"]["tokenizer_id"]))


def test_malformed_bodies(api):
    r = api.post("/forward_backward", content=b"\xff\x00garbage", headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and "protobuf" in r.json()["detail"]
    r = api.post("/create_session", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "CreateSessionRequest" in r.json()["detail"]
    r = api.post("/optim_step", json={"model_id": "nope", "type": "optim_step"})
    assert r.status_code == 400 and "optim_params" in r.json()["detail"]
    r = api.post("/get_info", json={"model_id": "nope:train:0", "type": "get_info"})
    assert r.status_code == 404 and "nope:train:0" in r.json()["detail"]
    r = api.post(
        "/create_model",
        json={"session_id": api.session(), "model_seq_id": 0, "base_model": "no/such-model", "type": "create_model"},
    )
    assert r.status_code == 400 and "no/such-model" in r.json()["detail"]
    r = httpx.post(str(api.http.base_url) + "/create_session", json={})
    assert r.status_code == 401 and "X-API-Key" in r.json()["detail"]
    assert api.http.get("/healthz").json() == {"status": "ok"}


def test_client_config_asks_for_protobuf(api):
    """tinker 0.24 sends forward_backward (and, with fwd_via_fwdbwd, forward) as protobuf only when told to."""
    config = api.post("/client/config", json={"sdk_version": "0.24.1"}).json()
    assert config["proto_write_fwdbwd"] is True and config["fwd_via_fwdbwd"] is True


def test_json_and_protobuf_forward_backward_are_the_same_call(api, tok):
    """Two models from the same seed, one trained and read through protobuf, the other through JSON (as tinker
    0.18 sends it; results as JSON too): the same losses and logprobs, bit for bit."""
    batch = sft_batch(tok, TEXTS[:3])
    sid = api.session()
    models = {w: api.model(sid, i, {"rank": 4, "seed": 3}) for i, w in enumerate(("protobuf", "json"))}
    adam = {"learning_rate": 0.02, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    got = {}
    for w, model_id in models.items():
        send, proto = (api.fb, True) if w == "protobuf" else (api.fb_json, False)
        fb = send(model_id, 1, batch).json()["request_id"]
        opt = api.post(
            "/optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": adam, "type": "optim_step"}
        ).json()["request_id"]
        fwd = send(model_id, 3, batch, forward_only=True).json()["request_id"]
        trained, after = api.result(fb, proto), api.result(fwd, proto)
        assert api.result(opt).status_code == 200
        if proto:
            assert trained.headers["content-type"] == "application/x-protobuf"
            got[w] = (loss_and_logprobs(trained.content), loss_and_logprobs(after.content))
        else:
            assert trained.headers["content-type"].startswith("application/json")
            got[w] = (json_loss_and_logprobs(trained.json()), json_loss_and_logprobs(after.json()))
    for (loss_p, lps_p), (loss_j, lps_j) in zip(got["protobuf"], got["json"]):
        assert loss_p == loss_j
        assert [lp.tolist() for lp in lps_p] == [lp.tolist() for lp in lps_j]
    assert got["json"][1][0] < got["json"][0][0]  # the step between them lowered the loss


def loss_and_logprobs(body: bytes) -> tuple[float, list[np.ndarray]]:
    from tinker.proto.response_conv import deserialize_forward_backward_output

    out = deserialize_forward_backward_output(body)
    return out.metrics["loss:sum"], [np.asarray(o["logprobs"].tolist(), np.float32) for o in out.loss_fn_outputs]


def json_loss_and_logprobs(value: dict) -> tuple[float, list[np.ndarray]]:
    """As tinker 0.18 reads a ForwardBackwardOutput: TensorData dicts of data, dtype and shape."""
    outputs = value["loss_fn_outputs"]
    assert all(
        o["logprobs"]["dtype"] == "float32" and o["logprobs"]["shape"] == [len(o["logprobs"]["data"])] for o in outputs
    )
    return value["metrics"]["loss:sum"], [np.asarray(o["logprobs"]["data"], np.float32) for o in outputs]


def test_sample_results_come_as_json_to_a_client_that_does_not_accept_protobuf(service, api):
    from tinker.proto.response_conv import deserialize_proto_response

    trainer = new_trainer(service)
    handle = trainer.save_weights_and_get_sampling_client().result().get_sampler_handle()
    sampler_id = json.loads(base64.urlsafe_b64decode(handle))["sampling_session_id"]
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": 1,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 9, 12]}]},
        "sampling_params": {"max_tokens": 5, "seed": 4, "temperature": 1.0, "stop": []},
        "prompt_logprobs": True,
        "topk_prompt_logprobs": 2,
        "type": "sample",
    }
    r = api.post("/asample", json=body)
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    proto = deserialize_proto_response(api.result(rid).content, types.SampleResponse)
    as_json = api.result(rid, proto=False)
    assert as_json.headers["content-type"].startswith("application/json")
    value = as_json.json()
    assert value["type"] == "sample"
    assert [s["tokens"] for s in value["sequences"]] == [list(s.tokens) for s in proto.sequences]
    assert [s["stop_reason"] for s in value["sequences"]] == ["length", "length"]
    for s, p in zip(value["sequences"], proto.sequences):
        assert np.float32(s["logprobs"]).tolist() == np.float32(p.logprobs).tolist()
    assert value["prompt_logprobs"][0] is None and len(value["prompt_logprobs"]) == 3
    assert np.float32(value["prompt_logprobs"][1:]).tolist() == np.float32(proto.prompt_logprobs[1:]).tolist()
    topk = value["topk_prompt_logprobs"]
    assert topk[0] is None and all(len(row) == 2 for row in topk[1:])
    assert [[t for t, _ in row] for row in topk[1:]] == [[t for t, _ in row] for row in proto.topk_prompt_logprobs[1:]]


def _json_body(**given) -> bytes:
    fbi = {"data": [datum_json(_datum([1, 2], target_tokens=[2, 3]))], "loss_fn": "cross_entropy"}
    fbi.update(given)
    return json.dumps({"forward_backward_input": fbi, "model_id": "{model}", "seq_id": 1}).encode()


def _with_datum(**datum) -> bytes:
    return _json_body(data=[datum])


TEXT = [{"type": "encoded_text", "tokens": [1, 2]}]
HOSTILE_JSON = {
    "not JSON": (b'{"forward_backward_input": [', "not valid JSON"),
    "invalid UTF-8": (b'{"model_id": "\xff\xfe"}', "UTF-8"),
    "an integer past 64 bits": (_json_body(loss_fn_config={"clip": 10**30}), "does not fit in 64 bits"),
    "no forward_backward_input": (b'{"model_id": "{model}", "seq_id": 1}', "forward_backward_input"),
    "a token that is not an integer": (
        _with_datum(model_input={"chunks": [{"type": "encoded_text", "tokens": [1.5, 2]}]}, loss_fn_inputs={}),
        "tokens",
    ),
    "a token id past int32": (
        _with_datum(model_input={"chunks": [{"type": "encoded_text", "tokens": [2**40, 2]}]}, loss_fn_inputs={}),
        "outside int32",
    ),
    "an image chunk": (
        _with_datum(model_input={"chunks": [{"type": "image", "data": "AAAA", "format": "png"}]}, loss_fn_inputs={}),
        "not supported (text tokens only)",
    ),
    "int64 targets that are not whole": (
        _with_datum(
            model_input={"chunks": TEXT}, loss_fn_inputs={"target_tokens": {"data": [2.5, 3], "dtype": "int64"}}
        ),
        "not a whole number",
    ),
    "an unknown dtype": (
        _with_datum(
            model_input={"chunks": TEXT}, loss_fn_inputs={"target_tokens": {"data": [2, 3], "dtype": "complex64"}}
        ),
        "dtype",
    ),
    "half a sparse tensor": (
        _with_datum(
            model_input={"chunks": TEXT},
            loss_fn_inputs={
                "target_tokens": {"data": [2, 3], "dtype": "int64"},
                "weights": {"data": [1.0], "dtype": "float32", "shape": [1, 2], "sparse_crow_indices": [0, 1]},
            },
        ),
        "needs both",
    ),
    "a shape that does not fit the data": (
        _with_datum(
            model_input={"chunks": TEXT},
            loss_fn_inputs={"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [5]}},
        ),
        "do not match",
    ),
    "too many datums": (_json_body(data=[datum_json(_datum([1, 2], target_tokens=[2, 3]))] * 1025), "1024"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_JSON))
def test_hostile_json_forward_backward_gets_a_named_400(api, case):
    body, words = HOSTILE_JSON[case]
    model_id = api.model(api.session(), 0, {"rank": 2})
    r = api.post(
        "/forward_backward",
        content=body.replace(b"{model}", model_id.encode()),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert words in r.json()["detail"], r.json()
    ok = api.fb_json(model_id, 2, [_datum([1, 2], target_tokens=[2, 3])])
    assert ok.status_code == 200 and api.result(ok.json()["request_id"], proto=False).json()["metrics"]


def test_json_forward_backward_limits_and_owners(lab, api):
    model_id = api.model(api.session(), 0, {"rank": 2})
    r = api.post("/forward_backward", content=_json_body().replace(b"{model}", model_id.encode()))
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["detail"]  # JSON sent as protobuf
    huge = b'{"forward_backward_input": {"data": [], "loss_fn": "x", "pad": "' + b"x" * (33 << 20) + b'"}}'
    r = api.post("/forward_backward", content=huge, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "32 MiB" in r.json()["detail"]
    r = api.post("/forward", content=huge)
    assert r.status_code == 413
    other = Api(lab.base_url, make_key(lab.home, "json-stranger"))
    r = other.fb_json(model_id, 1, [_datum([1, 2], target_tokens=[2, 3])])
    assert r.status_code == 404 and model_id in r.json()["detail"]  # another user's model is not there at all
    r = other.fb_json(model_id, 1, [_datum([1, 2], target_tokens=[2, 3])], forward_only=True)
    assert r.status_code == 404


def test_bad_sampling_requests(service, api):
    trainer = new_trainer(service)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="past the model's context"):
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=10_000)).result()
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        sampler.sample(types.ModelInput.from_ints([1, 99_999]), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.BadRequestError, match="top_p"):
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2, top_p=0.0)).result()
    out = sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)).result()
    assert len(out.sequences) == 1


def test_bad_checkpoint_names_and_paths(service):
    trainer = new_trainer(service)
    with pytest.raises(tinker.BadRequestError, match="not allowed"):
        trainer.save_state("a/b").result()
    with pytest.raises(tinker.NotFoundError, match="not found"):
        service.create_training_client_from_state("tinker://nobody:train:0/weights/x").result()


def test_another_users_key_sees_nothing(lab, service):
    trainer = new_trainer(service)
    path = trainer.save_state("private").result().path
    sampler_path = trainer.save_weights_for_sampler("private-s").result().path
    other_key = make_key(lab.home, "mallory")
    other = tinker.ServiceClient(base_url=lab.base_url, api_key=other_key)
    api = Api(lab.base_url, other_key)
    assert api.post("/get_info", json={"model_id": trainer.model_id, "type": "get_info"}).status_code == 404
    assert api.fb(trainer.model_id, 99, [_datum([1, 2], target_tokens=[2, 3])]).status_code == 404
    with pytest.raises(tinker.NotFoundError):
        other.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_sampling_client(model_path=sampler_path).result()
    rest = tinker.RestClient(base_url=lab.base_url, api_key=other_key)
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run(trainer.model_id).result()
    assert trainer.model_id not in {
        r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs
    }
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(path).result()
    # a future id from the first user means nothing to the second
    mine = Api(lab.base_url, lab.api_key)
    rid = mine.fb(trainer.model_id, 1000, [_datum([1, 2], target_tokens=[2, 3])], forward_only=True).json()[
        "request_id"
    ]
    assert api.post("/retrieve_future", json={"request_id": rid}).status_code == 404
    other.close("success").result()


def test_keys_create_refuses_path_like_user_names(lab):
    import subprocess
    import sys

    for bad in ("../evil", "a/b", "..", ""):
        out = subprocess.run(
            [sys.executable, "-m", "openrl_lab.cli", "keys", "create", bad, "--home", str(lab.home)],
            capture_output=True,
            text=True,
        )
        assert out.returncode != 0 and "not allowed" in out.stderr, (bad, out.stderr)
