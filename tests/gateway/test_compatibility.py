"""Every public method of the tinker SDK's clients, called through the real SDK against a real server.

The table `EXPECTED` (openrl_lab/tools/compat_doc.py) says, for each method, whether OpenRL Lab supports it,
refuses it with a clear error, or whether the SDK answers it without the server; docs/tinker-compatibility.md
is rendered from it by `python -m openrl_lab.tools.compat_doc`. Here every method is its own test,
`test_sdk_method[<class>.<method>]` (select one with `-k 'TrainingClient.forward]'`): a supported method's
result is checked, a refused one must fail with a server error saying it is not supported. The checks share
read-only state made once (`world`); whatever a check changes (training steps, loads, checkpoints it
publishes or deletes, a session's project) is its own. Other tests keep the table equal to the installed SDK
and the committed doc equal to what the command renders. Nothing here writes into the repository.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import functools
import inspect
import itertools
import json
import logging
import sqlite3
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import safetensors.numpy
import tinker
from tinker import types
from tinker.lib.api_future_impl import QueueState
from tinker.lib.public_interfaces.api_future import APIFuture

from openrl_lab.tools.compat_doc import EXPECTED, NOT_SUPPORTED, REFUSED_OPTIONS, render, table_mismatches

from .helpers import MODEL, logprobs_of, sft_batch

DOC = Path(__file__).resolve().parents[2] / "docs" / "tinker-compatibility.md"
TIMEOUT = 60
SEED = 11  # the shared run's seed: a fresh client with it starts where the shared run started

# deprecated `*_async` twins and their FutureWarnings are what some checks call on purpose
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


# --- helpers ------------------------------------------------------------------------------------------------
def R(future):  # noqa: N802 - a one-letter helper, read as R(future)
    return future.result(timeout=TIMEOUT)


def arun(coro):
    """Drives a deprecated `*_async` twin; some return an APIFuture, which is awaited too."""

    async def go():
        out = await coro
        if isinstance(out, APIFuture):
            out = await out
        return out

    return asyncio.run(go())


def lps(client, data) -> list[np.ndarray]:
    return logprobs_of(R(client.forward(data, "cross_entropy")))


def assert_same(a: list[np.ndarray], b: list[np.ndarray], atol: float = 0.0) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def assert_differs(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert any(not np.allclose(x, y) for x, y in zip(a, b))


def train_step(trainer, data, learning_rate: float) -> None:
    trainer.forward_backward(data, "cross_entropy")
    R(trainer.optim_step(types.AdamParams(learning_rate=learning_rate)))


def server_message(err: BaseException) -> str:
    body = getattr(err, "body", None)
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    return str(err)


def checkpoints(w) -> dict[str, types.Checkpoint]:
    return {ck.tinker_path: ck for ck in R(w.rest.list_checkpoints(w.t.model_id)).checkpoints}


def session_project(home: Path, session_id: str) -> str | None:
    db = sqlite3.connect(f"file:{home / 'state.db'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT project_id FROM sessions WHERE session_id=?", (session_id,)).fetchone()[0]
    finally:
        db.close()


def sampler_id(sampler: tinker.SamplingClient) -> str:
    return json.loads(base64.urlsafe_b64decode(sampler.get_sampler_handle()))["sampling_session_id"]


def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def custom_nll(data, logprobs_list):
    loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list))
    return loss, {"nll:sum": float(loss.detach())}


# --- what the checks share ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(lab):
    """Made once, only read by the checks: a session (project "compat-project"), a run `t` (LoRA rank 4, seed
    SEED) with training checkpoints A (one step) and B (one more), a sampler checkpoint and a snapshot sampler
    `s` of B, and the logprobs of `batch` at the start (`lp_init`), at A (`lp_saved`) and at B (`lp_b`)."""
    svc = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key, project_id="compat-project")
    w = SimpleNamespace(lab=lab, svc=svc, rest=tinker.RestClient(base_url=lab.base_url, api_key=lab.api_key))
    w.t = R(svc.create_lora_training_client(MODEL, rank=4, seed=SEED))
    w.session_id = svc.holder.get_session_id()
    w.tok = w.t.get_tokenizer()
    w.batch = sft_batch(w.tok, ["1+2=3", "10+5=15"])
    w.ids0 = [*w.tok.encode("1+2=3", add_special_tokens=False), w.tok.eos_token_id]
    w.full0 = types.ModelInput.from_ints(w.ids0)
    w.lp_init = lps(w.t, w.batch)
    train_step(w.t, w.batch, 1e-2)
    w.state_path, w.lp_saved = R(w.t.save_state("compat-a")).path, lps(w.t, w.batch)
    train_step(w.t, w.batch, 5e-2)
    w.state_path_b, w.lp_b = R(w.t.save_state("compat-b")).path, lps(w.t, w.batch)
    w.sampler_path = R(w.t.save_weights_for_sampler("compat-s")).path
    w.s = R(w.t.save_weights_and_get_sampling_client())
    w.prompt = types.ModelInput.from_ints(w.tok.encode("12+3=", add_special_tokens=False))
    w.params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    yield w
    with contextlib.suppress(Exception):
        R(svc.close("success"))


_names = itertools.count()


def fresh_trainer(w, seed: int | None = SEED, svc: tinker.ServiceClient | None = None):
    """A run of the check's own; with the default seed its weights start as the shared run's did."""
    return R((svc or w.svc).create_lora_training_client(MODEL, rank=4, seed=seed))


def own_checkpoint(w, kind: str = "weights") -> tuple[str, str]:
    """A new checkpoint of the shared run's weights, for a check that changes or deletes it: (path, id)."""
    name = f"compat-own-{next(_names)}"
    save = w.t.save_state if kind == "weights" else w.t.save_weights_for_sampler
    return R(save(name)).path, f"{kind}/{name}"


@contextlib.contextmanager
def own_session(w):
    """A session of the check's own (its project starts as "compat-project"; a session registers a custom loss
    once): (ServiceClient, session id)."""
    svc = tinker.ServiceClient(base_url=w.lab.base_url, api_key=w.lab.api_key, project_id="compat-project")
    try:
        yield svc, svc.holder.get_session_id()
    finally:
        with contextlib.suppress(Exception):
            R(svc.close("success"))


# --- the checks: (class, method) -> a function of `world` that raises on failure --------------------------------
CHECKS: dict[tuple[str, str], Callable[[SimpleNamespace], Any]] = {}


def check(cls: str, *methods: str):
    """Registers the check of cls.method; a check of several methods is called with the method's name."""

    def register(fn):
        for method in methods:
            assert (cls, method) not in CHECKS, f"{cls}.{method} is checked twice"
            CHECKS[cls, method] = functools.partial(fn, method=method) if len(methods) > 1 else fn
        return fn

    return register


# --- ServiceClient ---
def first_grad_norm(w, seed: int | None) -> float:
    trainer = fresh_trainer(w, seed)
    R(trainer.forward_backward(w.batch, "cross_entropy"))
    return R(trainer.optim_step(types.AdamParams(learning_rate=1e-3))).metrics["grad_norm:mean"]


@check("ServiceClient", "create_lora_training_client")
def _(w):
    t = fresh_trainer(w)
    assert t.model_id.startswith(f"{w.session_id}:train:") and t.model_id != w.t.model_id
    assert_same(lps(t, w.batch), w.lp_init)
    # LoRA B starts at zero, so the init shows in the first gradient (it depends on A): the SDK documents
    # seed=None as random, a seed as repeatable
    assert first_grad_norm(w, None) != first_grad_norm(w, None)
    assert first_grad_norm(w, 5) == first_grad_norm(w, 5)


@check("ServiceClient", "create_lora_training_client_async")
def _(w):
    twin = arun(w.svc.create_lora_training_client_async(MODEL, rank=4, seed=SEED))
    assert isinstance(twin, tinker.TrainingClient) and twin.model_id != w.t.model_id
    assert twin.get_info().lora_rank == 4
    assert_same(lps(twin, w.batch), w.lp_init)  # same seed, same start


@check("ServiceClient", "create_custom_loss")
def _(w):
    with own_session(w) as (svc, session_id):
        handle = R(svc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}))
    assert handle.loss_id is None  # not uploaded: the server leaves custom_loss_server_side off
    assert handle.session_id == session_id


@check(
    "ServiceClient",
    "create_training_client_from_state",
    "create_training_client_from_state_async",
    "create_training_client_from_state_with_optimizer",
    "create_training_client_from_state_with_optimizer_async",
)
def _(w, method):
    call = getattr(w.svc, method)(w.state_path)
    client = arun(call) if method.endswith("_async") else R(call)
    assert client.model_id.startswith(f"{w.session_id}:train:") and client.model_id != w.t.model_id
    assert client.get_info().lora_rank == 4
    assert_same(lps(client, w.batch), w.lp_saved, atol=1e-6)


@check("ServiceClient", "create_sampling_client")
def _(w):
    s = R(w.svc.create_sampling_client(model_path=w.sampler_path))
    assert s.get_base_model() == MODEL
    assert R(s.compute_logprobs(w.full0)) == R(w.s.compute_logprobs(w.full0))
    from_state = R(w.svc.create_sampling_client(model_path=w.state_path))  # a save_state checkpoint works too
    np.testing.assert_allclose(R(from_state.compute_logprobs(w.full0))[1:], w.lp_saved[0], atol=1e-4)


@check("ServiceClient", "create_sampling_client_async")
def _(w):
    s = arun(w.svc.create_sampling_client_async(base_model=MODEL))
    assert s.get_base_model() == MODEL
    lp = R(s.compute_logprobs(w.full0))  # the base model: LoRA starts as a no-op, so these are the initial ones
    np.testing.assert_allclose(lp[1:], w.lp_init[0], atol=1e-4)


@check("ServiceClient", "create_rest_client")
def _(w):
    rest = w.svc.create_rest_client()
    assert isinstance(rest, tinker.RestClient)
    assert w.t.model_id in {r.training_run_id for r in R(rest.list_training_runs(limit=100)).training_runs}


@check("ServiceClient", "get_server_capabilities")
def _(w):
    assert MODEL in [m.model_name for m in w.svc.get_server_capabilities().supported_models]


@check("ServiceClient", "get_server_capabilities_async")
def _(w):
    assert arun(w.svc.get_server_capabilities_async()) == w.svc.get_server_capabilities()


@check("ServiceClient", "get_console_url")
def _(w):
    url = w.svc.get_console_url()
    assert url.startswith("https://") and w.session_id in url


@check("ServiceClient", "holder")
def _(w):
    assert w.svc.holder.get_session_id() == w.session_id


@check("ServiceClient", "copy_weights")
def _(w):
    R(w.svc.copy_weights(w.state_path))  # this client has a project_id, so the SDK sends the request


@check("ServiceClient", "close")
def _(w):
    with own_session(w) as (svc, session_id):
        assert R(svc.close("success")) is None
    r = httpx.post(
        f"{w.lab.base_url}/api/v1/session_heartbeat",
        headers={"X-API-Key": w.lab.api_key},
        json={"session_id": session_id, "type": "session_heartbeat"},
        timeout=30,
    )
    assert r.status_code == 410 and "finished" in r.json()["detail"]


def _telemetry_is_off(w, client: str):
    assert getattr(w, client).get_telemetry() is None


_CLIENTS = {"ServiceClient": "svc", "TrainingClient": "t", "SamplingClient": "s", "RestClient": "rest"}
for _cls, _client in _CLIENTS.items():
    check(_cls, "get_telemetry")(functools.partial(_telemetry_is_off, client=_client))


# --- TrainingClient ---
@check("TrainingClient", "get_info")
def _(w):
    info = w.t.get_info()
    assert info.model_id == w.t.model_id and info.is_lora and info.lora_rank == 4
    assert info.model_data.model_name == MODEL


@check("TrainingClient", "get_info_async")
def _(w):
    assert arun(w.t.get_info_async()) == w.t.get_info()


@check("TrainingClient", "get_tokenizer")
def _(w):
    tok = w.t.get_tokenizer()
    assert tok.decode(tok.encode("12+3=15", add_special_tokens=False)) == "12+3=15"


@check("TrainingClient", "forward")
def _(w):
    lp = logprobs_of(R(w.t.forward(w.batch, "cross_entropy")))
    assert [len(x) for x in lp] == [d.model_input.length for d in w.batch]
    assert all((x <= 0).all() for x in lp)
    assert_same(lp, w.lp_b)  # forward changes nothing


@check("TrainingClient", "forward_async")
def _(w):
    assert_same(logprobs_of(arun(w.t.forward_async(w.batch, "cross_entropy"))), w.lp_b)


@check("TrainingClient", "forward_backward")
def _(w):
    out = R(fresh_trainer(w).forward_backward(w.batch, "cross_entropy"))
    assert_same(logprobs_of(out), w.lp_init)
    assert out.metrics["loss:sum"] == pytest.approx(-sum(float(x.sum()) for x in w.lp_init), rel=1e-4)


@check("TrainingClient", "forward_backward_async")
def _(w):
    out = arun(fresh_trainer(w).forward_backward_async(w.batch, "cross_entropy"))
    assert out.metrics["loss:sum"] == pytest.approx(-sum(float(x.sum()) for x in w.lp_init), rel=1e-4)


@check("TrainingClient", "forward_backward_custom")
def _(w):
    out = R(fresh_trainer(w).forward_backward_custom(w.batch, custom_nll))
    ce_loss = -sum(float(x.sum()) for x in w.lp_init)
    assert out.metrics["loss:sum"] == pytest.approx(ce_loss, rel=1e-4)
    assert out.metrics["nll:sum"] == pytest.approx(ce_loss, rel=1e-4)
    # the server's backward pass ran the surrogate cross_entropy with weights = -dLoss/dlogp = the datum weights
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(ce_loss, rel=1e-4)


@check("TrainingClient", "forward_backward_custom_async")
def _(w):
    with own_session(w) as (svc, _session_id):
        handle = R(svc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}))
        out = arun(fresh_trainer(w, svc=svc).forward_backward_custom_async(w.batch, handle))
    ce_loss = -sum(float(x.sum()) for x in w.lp_init)
    assert out.metrics["loss:sum"] == pytest.approx(ce_loss, rel=1e-4)
    assert out.metrics["custom/neg_ll:sum"] == pytest.approx(ce_loss, rel=1e-4)


@check("TrainingClient", "optim_step", "optim_step_async")
def _(w, method):
    trainer = fresh_trainer(w)
    trainer.forward_backward(w.batch, "cross_entropy")
    call = getattr(trainer, method)(types.AdamParams(learning_rate=1e-2))
    arun(call) if method.endswith("_async") else R(call)
    assert_same(lps(trainer, w.batch), w.lp_saved, atol=1e-6)  # the step that made checkpoint A


@check("TrainingClient", "save_state", "save_state_async", "save_weights_for_sampler", "save_weights_for_sampler_async")
def _(w, method):
    call = getattr(w.t, method)(f"compat-{method}")
    path = (arun(call) if method.endswith("_async") else R(call)).path
    kind = "weights" if method.startswith("save_state") else "sampler_weights"
    assert path == f"tinker://{w.t.model_id}/{kind}/compat-{method}" and path in checkpoints(w)
    s = R(w.svc.create_sampling_client(model_path=path))  # it holds the run's weights now, checkpoint B's
    np.testing.assert_allclose(R(s.compute_logprobs(w.full0))[1:], w.lp_b[0], atol=1e-4)


@check("TrainingClient", "save_weights_and_get_sampling_client", "save_weights_and_get_sampling_client_async")
def _(w, method):
    call = getattr(w.t, method)()
    s = arun(call) if method.endswith("_async") else R(call)
    lp = R(s.compute_logprobs(w.full0))
    assert lp[0] is None
    np.testing.assert_allclose(lp[1:], w.lp_b[0], atol=1e-4)  # the sampler serves the trainer's weights


@check("TrainingClient", "create_sampling_client", "create_sampling_client_async")
def _(w, method):
    call = getattr(w.t, method)(w.sampler_path)
    s = arun(call) if method.endswith("_async") else R(call)
    assert s.get_base_model() == MODEL
    assert R(s.compute_logprobs(w.full0)) == R(w.s.compute_logprobs(w.full0))


@check("TrainingClient", "get_console_url")
def _(w):
    url = w.t.get_console_url()
    assert url.startswith("https://") and w.t.model_id in url


@check(
    "TrainingClient", "load_state", "load_state_async", "load_state_with_optimizer", "load_state_with_optimizer_async"
)
def _(w, method):
    trainer = fresh_trainer(w)  # its weights are the initial ones: loading A or B visibly changes them
    path, expected = (w.state_path_b, w.lp_b) if method.endswith("_async") else (w.state_path, w.lp_saved)
    call = getattr(trainer, method)(path)
    assert (arun(call) if method.endswith("_async") else R(call)).path == path
    assert_same(lps(trainer, w.batch), expected, atol=1e-6)


def fetch(url: str) -> bytes:
    """A download URL, fetched as the SDK's `tinker checkpoint download` does: a plain GET, no key."""
    with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
        return r.read()


@check("TrainingClient", "save_weights_external", "save_weights_external_async")
def _(w, method):
    name = f"compat-ext-{next(_names)}"
    call = getattr(w.t, method)(name)
    path = (arun(call) if method.endswith("_async") else R(call)).path
    assert path == f"tinker://{w.t.model_id}/external_weights/{name}"
    ck = checkpoints(w)[path]
    assert ck.checkpoint_type == "external" and ck.size_bytes > 0
    config = json.loads(fetch(R(w.rest.get_external_weights_urls(path)).urls["adapter_config.json"]))
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["base_model_name_or_path"] == MODEL


@check("RestClient", "get_external_weights_urls", "get_external_weights_urls_async")
def _(w, method):
    path = R(w.t.save_weights_external(f"compat-ext-{next(_names)}")).path
    call = getattr(w.rest, method)(path)
    answer = arun(call) if method.endswith("_async") else R(call)
    assert set(answer.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    assert answer.expires > datetime.now(UTC)
    tensors = safetensors.numpy.load(fetch(answer.urls["adapter_model.safetensors"]))
    assert tensors and all(
        k.startswith("base_model.model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors
    )


# --- SamplingClient ---
@check("SamplingClient", "sample", "sample_async")
def _(w, method):
    out = R(w.s.sample(w.prompt, num_samples=2, sampling_params=w.params))
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert len(seq.tokens) == 4 and len(seq.logprobs) == 4 and seq.stop_reason == "length"
    topk = R(w.s.sample(w.prompt, 1, w.params, topk_prompt_logprobs=3, topk_sample_logprobs=2))
    assert topk.topk_prompt_logprobs[0] is None
    assert [len(row) for row in topk.topk_prompt_logprobs[1:]] == [3] * (w.prompt.length - 1)
    assert [len(row) for row in topk.sequences[0].topk_logprobs] == [2] * 4
    if method == "sample_async":  # same tokens for the same seed
        twin = arun(w.s.sample_async(w.prompt, num_samples=2, sampling_params=w.params))
        assert [s.tokens for s in twin.sequences] == [s.tokens for s in out.sequences]


@check("SamplingClient", "compute_logprobs")
def _(w):
    lp = R(w.s.compute_logprobs(w.full0))
    assert lp[0] is None and len(lp) == len(w.ids0)
    np.testing.assert_allclose(lp[1:], w.lp_b[0], atol=1e-4)  # the trainer's forward
    last2 = R(w.s.compute_logprobs(w.full0, prompt_logprobs_last_n=2))
    assert last2[:-2] == [None] * (len(lp) - 2)
    np.testing.assert_allclose(last2[-2:], lp[-2:], atol=1e-6)


@check("SamplingClient", "compute_logprobs_async")
def _(w):
    assert arun(w.s.compute_logprobs_async(w.full0)) == R(w.s.compute_logprobs(w.full0))


@check("SamplingClient", "get_base_model")
def _(w):
    assert w.s.get_base_model() == MODEL


@check("SamplingClient", "get_base_model_async")
def _(w):
    assert arun(w.s.get_base_model_async()) == MODEL


@check("SamplingClient", "get_tokenizer")
def _(w):
    assert w.s.get_tokenizer().encode("7+7=14") == w.tok.encode("7+7=14")


@check("SamplingClient", "get_sampler_handle")
def _(w):
    fields = json.loads(base64.urlsafe_b64decode(w.s.get_sampler_handle()))
    assert fields["sampling_session_id"].startswith(f"{w.session_id}:sample:")
    assert fields["holder"]["api_key"] is None  # the handle carries no credentials


@check("SamplingClient", "from_sampler_handle")
def _(w):
    clone = tinker.SamplingClient.from_sampler_handle(w.s.get_sampler_handle(), api_key=w.lab.api_key)
    out = R(clone.sample(w.prompt, num_samples=2, sampling_params=w.params))
    expected = R(w.s.sample(w.prompt, num_samples=2, sampling_params=w.params))
    assert [s.tokens for s in out.sequences] == [s.tokens for s in expected.sequences]


@check("SamplingClient", "create")
def _(w):
    s = R(tinker.SamplingClient.create(w.svc.holder, base_model=MODEL))
    assert s.get_base_model() == MODEL
    assert len(R(s.sample(w.prompt, num_samples=1, sampling_params=w.params)).sequences[0].tokens) == 4


@check("SamplingClient", "on_queue_state_change")
def _(w):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    sdk_log = logging.getLogger("tinker.lib.public_interfaces.sampling_client")
    sdk_log.addHandler(handler)
    # import-linter's run (tests/test_layering.py) configures logging with disable_existing_loggers
    was_disabled, sdk_log.disabled = sdk_log.disabled, False
    try:
        assert w.s.on_queue_state_change(QueueState.ACTIVE, None) is None
        assert not records
        w.s.on_queue_state_change(QueueState.PAUSED_CAPACITY, "test")
    finally:
        sdk_log.removeHandler(handler)
        sdk_log.disabled = was_disabled
    assert any("Sampling is paused" in r.getMessage() for r in records)


# --- RestClient ---
@check("RestClient", "get_server_capabilities")
def _(w):
    caps = R(w.rest.get_server_capabilities())
    assert caps == w.svc.get_server_capabilities()
    assert all(m.max_context_length and m.max_context_length > 0 for m in caps.supported_models)


@check("RestClient", "get_training_run")
def _(w):
    run = R(w.rest.get_training_run(w.t.model_id))
    assert run.training_run_id == w.t.model_id and run.base_model == MODEL
    assert run.is_lora and run.lora_rank == 4 and run.last_checkpoint is not None


@check("RestClient", "get_training_run_async")
def _(w):
    twin = arun(w.rest.get_training_run_async(w.t.model_id))
    assert (twin.training_run_id, twin.base_model, twin.lora_rank) == (w.t.model_id, MODEL, 4)


@check("RestClient", "get_training_run_by_tinker_path")
def _(w):
    assert R(w.rest.get_training_run_by_tinker_path(w.state_path)).training_run_id == w.t.model_id


@check("RestClient", "get_training_run_by_tinker_path_async")
def _(w):
    assert arun(w.rest.get_training_run_by_tinker_path_async(w.sampler_path)).training_run_id == w.t.model_id


@check("RestClient", "get_weights_info_by_tinker_path")
def _(w):
    info = R(w.rest.get_weights_info_by_tinker_path(w.state_path))
    assert info.base_model == MODEL and info.is_lora and info.lora_rank == 4


@check("RestClient", "list_checkpoints")
def _(w):
    listed = checkpoints(w)
    assert {w.state_path, w.state_path_b, w.sampler_path} <= set(listed)
    assert listed[w.state_path].checkpoint_type == "training"
    assert listed[w.sampler_path].checkpoint_type == "sampler"
    assert listed[w.state_path].checkpoint_id == "weights/compat-a"


@check("RestClient", "list_checkpoints_async")
def _(w):
    listed = {ck.tinker_path for ck in arun(w.rest.list_checkpoints_async(w.t.model_id)).checkpoints}
    assert listed == set(checkpoints(w))


@check("RestClient", "list_user_checkpoints", "list_user_checkpoints_async")
def _(w, method):
    everything = R(w.rest.list_user_checkpoints(limit=10_000))
    assert {w.state_path, w.sampler_path} <= {ck.tinker_path for ck in everything.checkpoints}
    assert everything.cursor.total_count == len(everything.checkpoints)
    if method.endswith("_async"):  # paged
        page = arun(w.rest.list_user_checkpoints_async(limit=1, offset=0))
        assert len(page.checkpoints) == 1 and page.cursor.total_count == everything.cursor.total_count


@check("RestClient", "list_training_runs", "list_training_runs_async")
def _(w, method):
    everything = R(w.rest.list_training_runs(limit=10_000))
    assert w.t.model_id in {r.training_run_id for r in everything.training_runs}
    assert everything.cursor.total_count == len(everything.training_runs)
    if method.endswith("_async"):  # paged
        page = arun(w.rest.list_training_runs_async(limit=1, offset=0))
        assert len(page.training_runs) == 1 and page.cursor.total_count == everything.cursor.total_count


@check("RestClient", "list_sessions")
def _(w):
    assert w.session_id in R(w.rest.list_sessions(limit=100)).sessions


@check("RestClient", "list_sessions_async")
def _(w):
    assert w.session_id in arun(w.rest.list_sessions_async(limit=100)).sessions


@check("RestClient", "get_session")
def _(w):
    sess = R(w.rest.get_session(w.session_id))
    assert w.t.model_id in sess.training_run_ids and sampler_id(w.s) in sess.sampler_ids


@check("RestClient", "get_session_async")
def _(w):
    assert arun(w.rest.get_session_async(w.session_id)) == R(w.rest.get_session(w.session_id))


@check("RestClient", "get_sampler")
def _(w):
    out = R(w.rest.get_sampler(sampler_id(w.s)))
    assert out.sampler_id == sampler_id(w.s) and out.base_model == MODEL


@check("RestClient", "get_sampler_async")
def _(w):
    path_sampler = R(w.svc.create_sampling_client(model_path=w.sampler_path))
    out = arun(w.rest.get_sampler_async(sampler_id(path_sampler)))
    assert out.base_model == MODEL and out.model_path == w.sampler_path


@check(
    "RestClient",
    "publish_checkpoint_from_tinker_path",
    "publish_checkpoint_from_tinker_path_async",
    "unpublish_checkpoint_from_tinker_path",
    "unpublish_checkpoint_from_tinker_path_async",
)
def _(w, method):
    path, _ = own_checkpoint(w)
    if method.startswith("unpublish"):
        R(w.rest.publish_checkpoint_from_tinker_path(path))
        assert checkpoints(w)[path].public
    call = getattr(w.rest, method)(path)
    arun(call) if method.endswith("_async") else R(call)
    assert checkpoints(w)[path].public is method.startswith("publish")


@check("RestClient", "set_checkpoint_ttl_from_tinker_path", "set_checkpoint_ttl_from_tinker_path_async")
def _(w, method):
    path, _ = own_checkpoint(w, "sampler_weights")
    R(w.rest.set_checkpoint_ttl_from_tinker_path(path, 3600))
    expires = checkpoints(w)[path].expires_at
    assert expires is not None and expires > datetime.now(UTC) + timedelta(minutes=55)
    if method.endswith("_async"):  # and cleared
        arun(w.rest.set_checkpoint_ttl_from_tinker_path_async(path, None))
        assert checkpoints(w)[path].expires_at is None


@check(
    "RestClient",
    "delete_checkpoint",
    "delete_checkpoint_async",
    "delete_checkpoint_from_tinker_path",
    "delete_checkpoint_from_tinker_path_async",
)
def _(w, method):
    path, checkpoint_id = own_checkpoint(w, "sampler_weights" if method.endswith("_async") else "weights")
    assert path in checkpoints(w)
    args = (path,) if "tinker_path" in method else (w.t.model_id, checkpoint_id)
    call = getattr(w.rest, method)(*args)
    arun(call) if method.endswith("_async") else R(call)
    assert path not in checkpoints(w)


@check("RestClient", "assign_session_project", "assign_session_project_async")
def _(w, method):
    with own_session(w) as (_svc, session_id):
        assert session_project(w.lab.home, session_id) == "compat-project"  # sent by ServiceClient(project_id=)
        call = getattr(w.rest, method)(session_id, f"moved-by-{method}")
        arun(call) if method.endswith("_async") else R(call)
        assert session_project(w.lab.home, session_id) == f"moved-by-{method}"


@check("RestClient", "whoami")
def _(w):
    with pytest.raises(RuntimeError, match="whoami requires JWT auth"):
        R(w.rest.whoami())


_NOT_SUPPORTED_REST: dict[str, Callable[[SimpleNamespace], Any]] = {
    "copy_weights": lambda w: R(w.rest.copy_weights(w.state_path, "compat-project")),
    "copy_weights_async": lambda w: arun(w.rest.copy_weights_async(w.state_path, "compat-project")),
    "export_session_trace": lambda w: R(w.rest.export_session_trace(w.session_id)),
    "export_session_trace_async": lambda w: arun(w.rest.export_session_trace_async(w.session_id)),
    "search_sessions": lambda w: R(w.rest.search_sessions(types.SessionSearchRequest())),
    "get_audit_log": lambda w: R(w.rest.get_audit_log()),
    "get_audit_log_async": lambda w: arun(w.rest.get_audit_log_async()),
    "get_billing_usage": lambda w: R(w.rest.get_billing_usage("2025-01-01", "2025-02-01")),
    "get_billing_usage_async": lambda w: arun(w.rest.get_billing_usage_async("2025-01-01", "2025-02-01")),
    "get_current_checkpoint_storage_usage": lambda w: R(w.rest.get_current_checkpoint_storage_usage()),
    "get_current_checkpoint_storage_usage_async": lambda w: arun(w.rest.get_current_checkpoint_storage_usage_async()),
}
for _name, _call in _NOT_SUPPORTED_REST.items():
    check("RestClient", _name)(_call)


# --- APIFuture (on RestClient futures) ---
@check("APIFuture", "result")
def _(w):
    fut = w.rest.get_server_capabilities()
    assert isinstance(fut, APIFuture) and fut.result(timeout=TIMEOUT) == w.svc.get_server_capabilities()


@check("APIFuture", "future")
def _(w):
    f = w.rest.get_server_capabilities().future()
    assert isinstance(f, concurrent.futures.Future) and f.result(timeout=TIMEOUT) == w.svc.get_server_capabilities()


@check("APIFuture", "result_async")
def _(w):
    caps = asyncio.run(w.rest.get_server_capabilities().result_async(timeout=TIMEOUT))
    assert caps == w.svc.get_server_capabilities()


@check("APIFuture", "coroutine")
def _(w):
    coro = w.rest.get_server_capabilities().coroutine()
    assert inspect.iscoroutine(coro) and asyncio.run(coro) == w.svc.get_server_capabilities()


# --- the tests ----------------------------------------------------------------------------------------------
METHODS = sorted((cls, method) for cls, table in EXPECTED.items() for method in table)


@pytest.mark.parametrize("cls, method", METHODS, ids=[f"{c}.{m}" for c, m in METHODS])
def test_sdk_method(world, cls, method):
    status, _notes = EXPECTED[cls][method]
    run = CHECKS[cls, method]
    if status != NOT_SUPPORTED:
        run(world)
        return
    with pytest.raises((tinker.APIStatusError, tinker.RequestFailedError)) as err:
        run(world)
    assert "not supported" in server_message(err.value).lower()


REFUSED_CALLS: dict[str, Callable[[SimpleNamespace], Any]] = {
    "create_lora_training_client(optimizer=DimuonOptimizerConfig())": lambda w: R(
        w.svc.create_lora_training_client(MODEL, rank=4, optimizer=types.DimuonOptimizerConfig())
    ),
    "create_training_client_from_state(path, optimizer=DimuonOptimizerConfig())": lambda w: R(
        w.svc.create_training_client_from_state(w.state_path, optimizer=types.DimuonOptimizerConfig())
    ),
    "optim_step(DimuonParams(...))": lambda w: R(w.t.optim_step(types.DimuonParams(learning_rate=1e-3))),
    "sample(..., prompt_alt_tokens_k=2)": lambda w: R(w.s.sample(w.prompt, 1, w.params, prompt_alt_tokens_k=2)),
    "save_weights_external(name, age_encryption_recipients=[...])": lambda w: R(
        w.t.save_weights_external("compat-age", age_encryption_recipients=["age1xyz"])
    ),
}


@pytest.mark.parametrize("call", list(REFUSED_OPTIONS))
def test_refused_option(world, call):
    """Options of supported methods that the server refuses, with an error saying so."""
    with pytest.raises(Exception) as err:  # noqa: PT011 (what matters is the message)
        REFUSED_CALLS[call](world)
    assert REFUSED_OPTIONS[call].lower() in server_message(err.value).lower()


def test_expectations_table_matches_the_installed_sdk():
    problems = table_mismatches()
    assert not problems, "\n".join(problems)


def test_every_check_belongs_to_a_listed_method():
    assert set(CHECKS) - set(METHODS) == set()
    assert set(REFUSED_CALLS) == set(REFUSED_OPTIONS)


def test_committed_doc_is_what_the_command_generates():
    assert DOC.read_text() == render(), (
        "docs/tinker-compatibility.md is stale: regenerate it with `python -m openrl_lab.tools.compat_doc`"
    )
