"""The HTTP API below the SDK: ordering, dedup, bad input, ownership. Real server, raw HTTP where the SDK
would refuse to send the bad request itself."""

from __future__ import annotations

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

    def result(self, request_id: str) -> httpx.Response:
        while True:
            r = self.post("/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False})
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


@pytest.mark.parametrize("case", sorted(BAD_FORWARD_BACKWARD))
def test_bad_forward_backward_gets_a_named_4xx(api, case):
    make, loss_fn, words = BAD_FORWARD_BACKWARD[case]
    sid = api.session()
    model_id = api.model(sid, 0, {"rank": 2})
    r = api.fb(model_id, 1, make(vocab_size(api, model_id)), loss_fn=loss_fn)
    assert 400 <= r.status_code < 500, r.text
    assert words in r.json()["detail"], r.json()
    # still serving, and the refused seq_id does not block the next request
    ok = api.fb(model_id, 2, [_datum([1, 2], target_tokens=[2, 3])])
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
