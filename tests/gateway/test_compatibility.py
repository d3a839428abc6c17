"""Every public method of the tinker SDK's clients, called through the real SDK against a real server.

The expectations table below says, for each method, whether OpenRL Lab supports it, refuses it with a clear
error, or whether the SDK answers it without the server. The test fails when the installed SDK has a public
method the table does not list (or the table lists one the SDK no longer has), when a supported method fails,
or when a method marked not supported succeeds or fails without saying it is not supported. When every
check ran and passed it rewrites docs/tinker-compatibility.md.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import inspect
import json
import logging
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.lib.api_future_impl import QueueState
from tinker.lib.public_interfaces.api_future import APIFuture

from .helpers import MODEL, logprobs_of, sft_batch

REPORT = Path(__file__).resolve().parents[2] / "docs" / "tinker-compatibility.md"
TIMEOUT = 60

SUPPORTED, NOT_SUPPORTED, CLIENT_ONLY = "supported", "not supported", "client-only"
CLASSES: dict[str, type] = {"ServiceClient": tinker.ServiceClient, "TrainingClient": tinker.TrainingClient,
                            "SamplingClient": tinker.SamplingClient, "RestClient": tinker.RestClient,
                            "APIFuture": APIFuture}

_KEEP = "checkpoints stay on this server: no external (HF-format) export, no download URLs"
_ADMIN = "admin-only (AdminClient); there are no organizations, billing or admin roles"
_TELEMETRY = ("returns the SDK's telemetry object; None here because the tests set TINKER_TELEMETRY=0 "
              "(POST /telemetry is accepted and discarded otherwise)")

# method -> (expected status, what it does here / why not). Deprecated `*_async` twins are listed too.
EXPECTED: dict[str, dict[str, tuple[str, str]]] = {
    "ServiceClient": {
        "close": (SUPPORTED, "POST /sessions/{id}/finish; the server then answers the session's heartbeat with 410"),
        "copy_weights": (NOT_SUPPORTED, "there are no projects to copy checkpoints between; publish a checkpoint "
                                        "to let other users load it"),
        "create_custom_loss": (SUPPORTED, "the loss is traced client-side (server sends custom_loss_server_side="
                                          "false) and runs through forward_backward_custom"),
        "create_lora_training_client": (SUPPORTED, "create_model + get_info; only the adamw optimizer"),
        "create_lora_training_client_async": (SUPPORTED, "deprecated twin; same initial logprobs as the sync call"),
        "create_rest_client": (SUPPORTED, "deprecated; returns a working RestClient"),
        "create_sampling_client": (SUPPORTED, "from a base model or a tinker://…/sampler_weights (or weights) path"),
        "create_sampling_client_async": (SUPPORTED, "deprecated twin"),
        "create_training_client_from_state": (SUPPORTED, "load_weights without optimizer state; weights restored "
                                                         "exactly"),
        "create_training_client_from_state_async": (SUPPORTED, "deprecated twin"),
        "create_training_client_from_state_with_optimizer": (SUPPORTED, "load_weights with the AdamW state"),
        "create_training_client_from_state_with_optimizer_async": (SUPPORTED, "deprecated twin"),
        "get_console_url": (CLIENT_ONLY, "builds a tinker.thinkingmachines.ai console link for the session; "
                                         "OpenRL Lab has no console, so the link is of no use"),
        "get_server_capabilities": (SUPPORTED, "deprecated; GET /get_server_capabilities lists the built-in models"),
        "get_server_capabilities_async": (SUPPORTED, "deprecated twin; equal to the sync answer"),
        "get_telemetry": (CLIENT_ONLY, _TELEMETRY),
        "holder": (CLIENT_ONLY, "deprecated property: the SDK's internal session holder (creates the session "
                                "lazily)"),
    },
    "TrainingClient": {
        "create_sampling_client": (SUPPORTED, "sampler from a saved checkpoint path"),
        "create_sampling_client_async": (SUPPORTED, "deprecated twin"),
        "forward": (SUPPORTED, "per-datum target logprobs, no gradients"),
        "forward_async": (SUPPORTED, "deprecated twin; equal to forward"),
        "forward_backward": (SUPPORTED, "protobuf request/response; loss:sum = -Σ w·logp; cross_entropy, "
                                        "importance_sampling, ppo, cispo, dro"),
        "forward_backward_async": (SUPPORTED, "deprecated twin; equal to forward_backward"),
        "forward_backward_custom": (SUPPORTED, "runs client-side: a forward pass, then a cross_entropy backward "
                                               "with weights = -dLoss/dlogp (needs torch)"),
        "forward_backward_custom_async": (SUPPORTED, "deprecated twin; also with a create_custom_loss handle"),
        "get_console_url": (CLIENT_ONLY, "builds a tinker.thinkingmachines.ai console link for the training run; "
                                         "of no use with OpenRL Lab"),
        "get_info": (SUPPORTED, "answered from the server's get_info, fetched when the client was created"),
        "get_info_async": (SUPPORTED, "deprecated twin; same answer"),
        "get_telemetry": (CLIENT_ONLY, _TELEMETRY),
        "get_tokenizer": (SUPPORTED, "loads the tokenizer from the local path the server reports "
                                     "(model_data.tokenizer_id): works on the server's machine"),
        "load_state": (SUPPORTED, "deprecated (legacy load_weights on the existing model); weights restored exactly"),
        "load_state_async": (SUPPORTED, "deprecated twin"),
        "load_state_with_optimizer": (SUPPORTED, "deprecated; also restores the AdamW state"),
        "load_state_with_optimizer_async": (SUPPORTED, "deprecated twin"),
        "optim_step": (SUPPORTED, "AdamW (adam_params); dimuon params are refused"),
        "optim_step_async": (SUPPORTED, "deprecated twin"),
        "save_state": (SUPPORTED, "tinker://<run>/weights/<name>: weights + optimizer state"),
        "save_state_async": (SUPPORTED, "deprecated twin"),
        "save_weights_and_get_sampling_client": (SUPPORTED, "snapshot sampler of the current weights "
                                                            "(kind='inflight' is served as a snapshot)"),
        "save_weights_and_get_sampling_client_async": (SUPPORTED, "deprecated twin"),
        "save_weights_external": (NOT_SUPPORTED, _KEEP),
        "save_weights_external_async": (NOT_SUPPORTED, _KEEP),
        "save_weights_for_sampler": (SUPPORTED, "tinker://<run>/sampler_weights/<name>"),
        "save_weights_for_sampler_async": (SUPPORTED, "deprecated twin"),
    },
    "SamplingClient": {
        "compute_logprobs": (SUPPORTED, "prompt logprobs (first is None), prompt_logprobs_last_n honoured; match "
                                        "the trainer's forward"),
        "compute_logprobs_async": (SUPPORTED, "deprecated twin; equal to compute_logprobs"),
        "create": (SUPPORTED, "static; SamplingClient.create(holder, base_model=…)"),
        "from_sampler_handle": (SUPPORTED, "static; a client rebuilt from a handle samples the same sampler "
                                           "(pass api_key=: the handle carries no credentials)"),
        "get_base_model": (SUPPORTED, "known since creation (GET /samplers/{id} for path-based samplers)"),
        "get_base_model_async": (SUPPORTED, "deprecated twin"),
        "get_sampler_handle": (CLIENT_ONLY, "encodes the sampler id, session and server config as base64 JSON; "
                                            "no request"),
        "get_telemetry": (CLIENT_ONLY, _TELEMETRY),
        "get_tokenizer": (SUPPORTED, "loads the base model's tokenizer from the local HF cache, where the server "
                                     "registers its built-in models (same machine)"),
        "on_queue_state_change": (CLIENT_ONLY, "callback the SDK uses to log a paused queue; the server only "
                                               "ever reports queue_state 'active'"),
        "sample": (SUPPORTED, "seeded, temperature/top_k/top_p/stop; topk/alt-token/target logprobs are refused"),
        "sample_async": (SUPPORTED, "deprecated twin; same tokens for the same seed"),
    },
    "RestClient": {
        "assign_session_project": (SUPPORTED, "PUT /sessions/{id}/project; stored with the session"),
        "assign_session_project_async": (SUPPORTED, "deprecated twin"),
        "copy_weights": (NOT_SUPPORTED, "there are no projects to copy checkpoints between; publish a checkpoint "
                                        "to let other users load it"),
        "copy_weights_async": (NOT_SUPPORTED, "deprecated twin of copy_weights"),
        "delete_checkpoint": (SUPPORTED, "removes the files and the record"),
        "delete_checkpoint_async": (SUPPORTED, "deprecated twin"),
        "delete_checkpoint_from_tinker_path": (SUPPORTED, "same, by tinker:// path"),
        "delete_checkpoint_from_tinker_path_async": (SUPPORTED, "deprecated twin"),
        "export_session_trace": (NOT_SUPPORTED, "no request traces are recorded"),
        "export_session_trace_async": (NOT_SUPPORTED, "deprecated twin of export_session_trace"),
        "get_audit_log": (NOT_SUPPORTED, _ADMIN),
        "get_audit_log_async": (NOT_SUPPORTED, _ADMIN),
        "get_billing_usage": (NOT_SUPPORTED, _ADMIN),
        "get_billing_usage_async": (NOT_SUPPORTED, _ADMIN),
        "get_current_checkpoint_storage_usage": (NOT_SUPPORTED, _ADMIN),
        "get_current_checkpoint_storage_usage_async": (NOT_SUPPORTED, _ADMIN),
        "get_external_weights_urls": (NOT_SUPPORTED, _KEEP),
        "get_external_weights_urls_async": (NOT_SUPPORTED, _KEEP),
        "get_sampler": (SUPPORTED, "sampler id, base model, model path"),
        "get_sampler_async": (SUPPORTED, "deprecated twin"),
        "get_server_capabilities": (SUPPORTED, "the built-in models with their context length"),
        "get_session": (SUPPORTED, "the session's training runs and samplers"),
        "get_session_async": (SUPPORTED, "deprecated twin"),
        "get_telemetry": (CLIENT_ONLY, _TELEMETRY),
        "get_training_run": (SUPPORTED, "base model, LoRA rank, last checkpoints"),
        "get_training_run_async": (SUPPORTED, "deprecated twin"),
        "get_training_run_by_tinker_path": (SUPPORTED, "the run a checkpoint path belongs to"),
        "get_training_run_by_tinker_path_async": (SUPPORTED, "deprecated twin"),
        "get_weights_info_by_tinker_path": (SUPPORTED, "base model and LoRA config of a checkpoint"),
        "list_checkpoints": (SUPPORTED, "a run's training and sampler checkpoints"),
        "list_checkpoints_async": (SUPPORTED, "deprecated twin"),
        "list_sessions": (SUPPORTED, "the caller's sessions, newest first"),
        "list_sessions_async": (SUPPORTED, "deprecated twin"),
        "list_training_runs": (SUPPORTED, "the caller's runs, paged"),
        "list_training_runs_async": (SUPPORTED, "deprecated twin"),
        "list_user_checkpoints": (SUPPORTED, "all of the caller's checkpoints, paged"),
        "list_user_checkpoints_async": (SUPPORTED, "deprecated twin"),
        "publish_checkpoint_from_tinker_path": (SUPPORTED, "makes a checkpoint readable by every user"),
        "publish_checkpoint_from_tinker_path_async": (SUPPORTED, "deprecated twin"),
        "search_sessions": (NOT_SUPPORTED, "experimental in the SDK; use list_sessions and get_session"),
        "set_checkpoint_ttl_from_tinker_path": (SUPPORTED, "sets or clears expires_at; expired checkpoints are "
                                                           "deleted by a sweep"),
        "set_checkpoint_ttl_from_tinker_path_async": (SUPPORTED, "deprecated twin"),
        "unpublish_checkpoint_from_tinker_path": (SUPPORTED, "makes a checkpoint private again"),
        "unpublish_checkpoint_from_tinker_path_async": (SUPPORTED, "deprecated twin"),
        "whoami": (CLIENT_ONLY, "decodes the JWT the SDK holds; the server leaves JWT auth off, so it raises "
                                "RuntimeError('whoami requires JWT auth …') without a request"),
    },
    "APIFuture": {
        "coroutine": (SUPPORTED, "the future as a coroutine"),
        "future": (SUPPORTED, "the underlying concurrent.futures.Future"),
        "result": (SUPPORTED, "blocks for the result, with an optional timeout"),
        "result_async": (SUPPORTED, "awaits the result, with an optional timeout"),
    },
}

# --- the SDK's public surface -------------------------------------------------------------------------------
def public_members(cls: type) -> dict[str, dict[str, Any]]:
    members = {}
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, staticmethod):
            kind, fn = "static method", raw.__func__
        elif isinstance(raw, classmethod):
            kind, fn = "class method", raw.__func__
        elif isinstance(raw, property):
            kind, fn = "property", raw.fget
        elif inspect.isfunction(raw):
            kind, fn = "method", raw
        else:
            continue
        note = getattr(fn, "__deprecated__", None)
        flag = ("experimental" if "experimental" in note.lower() else "deprecated") if note else ""
        members[name] = {"kind": kind, "flag": flag}
    return members


def table_mismatches() -> list[str]:
    problems = []
    for cls_name, cls in CLASSES.items():
        sdk, table = set(public_members(cls)), set(EXPECTED[cls_name])
        if sdk - table:
            problems.append(f"{cls_name}: public SDK methods missing from EXPECTED: {sorted(sdk - table)}")
        if table - sdk:
            problems.append(f"{cls_name}: EXPECTED lists methods the SDK no longer has: {sorted(table - sdk)}")
    return problems


def test_expectations_table_matches_the_installed_sdk():
    problems = table_mismatches()
    assert not problems, "\n".join(problems)


# --- helpers ------------------------------------------------------------------------------------------------
def R(future):
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


def perturb(trainer, data) -> None:
    trainer.forward_backward(data, "cross_entropy")
    R(trainer.optim_step(types.AdamParams(learning_rate=5e-2)))


def server_message(err: BaseException) -> str:
    body = getattr(err, "body", None)
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])
    return str(err)


def checkpoints(c) -> dict[str, types.Checkpoint]:
    return {ck.tinker_path: ck for ck in R(c.rest.list_checkpoints(c.t.model_id)).checkpoints}


def session_project(home: Path, session_id: str) -> str | None:
    db = sqlite3.connect(f"file:{home / 'state.db'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT project_id FROM sessions WHERE session_id=?", (session_id,)).fetchone()[0]
    finally:
        db.close()


def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def custom_nll(data, logprobs_list):
    loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list))
    return loss, {"nll:sum": float(loss.detach())}


# --- the checks, run in this order; each raises on failure -------------------------------------------------
PLAN: list[tuple[str, str, Callable[[SimpleNamespace], None]]] = []


def check(cls: str, method: str):
    def register(fn):
        PLAN.append((cls, method, fn))
        return fn
    return register


@check("ServiceClient", "create_lora_training_client")
def _(c):
    c.t = R(c.svc.create_lora_training_client(MODEL, rank=4, seed=11))
    c.session_id = c.svc.holder.get_session_id()
    assert c.t.model_id.startswith(f"{c.session_id}:train:")
    c.tok = c.t.get_tokenizer()
    c.texts = ["1+2=3", "10+5=15"]
    c.batch = sft_batch(c.tok, c.texts)
    c.ids0 = c.tok.encode(c.texts[0], add_special_tokens=False) + [c.tok.eos_token_id]


@check("TrainingClient", "get_info")
def _(c):
    info = c.t.get_info()
    assert info.model_id == c.t.model_id and info.is_lora and info.lora_rank == 4
    assert info.model_data.model_name == MODEL


@check("TrainingClient", "get_info_async")
def _(c):
    assert arun(c.t.get_info_async()) == c.t.get_info()


@check("TrainingClient", "get_tokenizer")
def _(c):
    tok = c.t.get_tokenizer()
    assert tok.decode(tok.encode("12+3=15", add_special_tokens=False)) == "12+3=15"


@check("TrainingClient", "forward")
def _(c):
    c.lp_init = logprobs_of(R(c.t.forward(c.batch, "cross_entropy")))
    assert [len(x) for x in c.lp_init] == [d.model_input.length for d in c.batch]
    assert all((x <= 0).all() for x in c.lp_init)


@check("TrainingClient", "forward_async")
def _(c):
    assert_same(logprobs_of(arun(c.t.forward_async(c.batch, "cross_entropy"))), c.lp_init)


@check("ServiceClient", "create_lora_training_client_async")
def _(c):
    twin = arun(c.svc.create_lora_training_client_async(MODEL, rank=4, seed=11))
    assert isinstance(twin, tinker.TrainingClient) and twin.model_id != c.t.model_id
    assert twin.get_info().lora_rank == 4
    assert_same(lps(twin, c.batch), c.lp_init)  # same seed, same start


@check("TrainingClient", "forward_backward")
def _(c):
    out = R(c.t.forward_backward(c.batch, "cross_entropy"))
    assert_same(logprobs_of(out), c.lp_init)
    c.ce_loss = out.metrics["loss:sum"]
    assert c.ce_loss == pytest.approx(-sum(float(x.sum()) for x in c.lp_init), rel=1e-4)


@check("TrainingClient", "forward_backward_async")
def _(c):
    out = arun(c.t.forward_backward_async(c.batch, "cross_entropy"))
    assert out.metrics["loss:sum"] == pytest.approx(c.ce_loss, rel=1e-5)


@check("TrainingClient", "forward_backward_custom")
def _(c):
    out = R(c.t.forward_backward_custom(c.batch, custom_nll))
    assert out.metrics["loss:sum"] == pytest.approx(c.ce_loss, rel=1e-4)
    assert out.metrics["nll:sum"] == pytest.approx(c.ce_loss, rel=1e-4)
    # the server's backward pass ran the surrogate cross_entropy with weights = -dLoss/dlogp = the datum weights
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(c.ce_loss, rel=1e-4)


@check("ServiceClient", "create_custom_loss")
def _(c):
    c.loss_handle = R(c.svc.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}))
    assert c.loss_handle.loss_id is None  # not uploaded: the server leaves custom_loss_server_side off
    assert c.loss_handle.session_id == c.session_id  # used by forward_backward_custom_async below


@check("TrainingClient", "forward_backward_custom_async")
def _(c):
    out = arun(c.t.forward_backward_custom_async(c.batch, c.loss_handle))
    assert out.metrics["loss:sum"] == pytest.approx(c.ce_loss, rel=1e-4)
    assert out.metrics["custom/neg_ll:sum"] == pytest.approx(c.ce_loss, rel=1e-4)


@check("TrainingClient", "optim_step")
def _(c):
    R(c.t.optim_step(types.AdamParams(learning_rate=1e-2)))
    c.lp_trained = lps(c.t, c.batch)
    assert any(not np.allclose(x, y) for x, y in zip(c.lp_trained, c.lp_init))


@check("TrainingClient", "optim_step_async")
def _(c):
    c.t.forward_backward(c.batch, "cross_entropy")
    arun(c.t.optim_step_async(types.AdamParams(learning_rate=1e-2)))
    after = lps(c.t, c.batch)
    assert any(not np.allclose(x, y) for x, y in zip(after, c.lp_trained))


@check("TrainingClient", "save_state")
def _(c):
    c.state_path = R(c.t.save_state("compat-a")).path
    assert c.state_path == f"tinker://{c.t.model_id}/weights/compat-a"
    c.lp_saved = lps(c.t, c.batch)


@check("TrainingClient", "save_state_async")
def _(c):
    perturb(c.t, c.batch)
    c.state_path_b = arun(c.t.save_state_async("compat-b")).path
    assert c.state_path_b == f"tinker://{c.t.model_id}/weights/compat-b"
    c.lp_b = lps(c.t, c.batch)
    assert any(not np.allclose(x, y) for x, y in zip(c.lp_b, c.lp_saved))


@check("TrainingClient", "save_weights_for_sampler")
def _(c):
    c.sampler_path = R(c.t.save_weights_for_sampler("compat-s")).path
    assert c.sampler_path == f"tinker://{c.t.model_id}/sampler_weights/compat-s"


@check("TrainingClient", "save_weights_for_sampler_async")
def _(c):
    c.sampler_path_2 = arun(c.t.save_weights_for_sampler_async("compat-s2")).path
    assert c.sampler_path_2 == f"tinker://{c.t.model_id}/sampler_weights/compat-s2"


@check("TrainingClient", "save_weights_and_get_sampling_client")
def _(c):
    c.s = R(c.t.save_weights_and_get_sampling_client())
    c.full0 = types.ModelInput.from_ints(c.ids0)
    c.clp = R(c.s.compute_logprobs(c.full0))
    assert c.clp[0] is None
    np.testing.assert_allclose(c.clp[1:], c.lp_b[0], atol=1e-4)  # the sampler serves the trainer's weights


@check("TrainingClient", "save_weights_and_get_sampling_client_async")
def _(c):
    twin = arun(c.t.save_weights_and_get_sampling_client_async())
    assert R(twin.compute_logprobs(c.full0)) == c.clp


@check("TrainingClient", "create_sampling_client")
def _(c):
    s = R(c.t.create_sampling_client(c.sampler_path))
    assert s.get_base_model() == MODEL
    assert R(s.compute_logprobs(c.full0)) == c.clp


@check("TrainingClient", "create_sampling_client_async")
def _(c):
    s = arun(c.t.create_sampling_client_async(c.sampler_path))
    assert R(s.compute_logprobs(c.full0)) == c.clp


@check("TrainingClient", "get_console_url")
def _(c):
    url = c.t.get_console_url()
    assert url.startswith("https://") and c.t.model_id in url


@check("TrainingClient", "get_telemetry")
def _(c):
    assert c.t.get_telemetry() is None


def _load_state_check(method: str, is_async: bool):
    def run(c):
        # alternate between checkpoints A and B, so that every load changes the weights
        path, expected = (c.state_path_b, c.lp_b) if is_async else (c.state_path, c.lp_saved)
        out = arun(getattr(c.t, method)(path)) if is_async else R(getattr(c.t, method)(path))
        assert out.path == path
        assert_same(lps(c.t, c.batch), expected, atol=1e-6)
    return run


for _name in ("load_state", "load_state_async", "load_state_with_optimizer", "load_state_with_optimizer_async"):
    check("TrainingClient", _name)(_load_state_check(_name, _name.endswith("_async")))


def _save_external_check(is_async: bool):
    def run(c):
        try:
            call = c.t.save_weights_external_async("compat-x") if is_async else c.t.save_weights_external("compat-x")
            arun(call) if is_async else R(call)
        finally:
            # the refused request's seq_id is skipped at once: the next request does not wait 5 s for it
            try:
                c.t.forward(c.batch[:1], "cross_entropy").result(timeout=4)
            except concurrent.futures.TimeoutError:
                raise AssertionError("after the refused save_weights_external, the trainer's next request "
                                     "waited for its seq_id") from None
    return run


check("TrainingClient", "save_weights_external")(_save_external_check(False))
check("TrainingClient", "save_weights_external_async")(_save_external_check(True))


def _from_state_check(method: str):
    def run(c):
        call = getattr(c.svc, method)(c.state_path)
        client = arun(call) if method.endswith("_async") else R(call)
        assert client.model_id.startswith(f"{c.session_id}:train:") and client.model_id != c.t.model_id
        assert client.get_info().lora_rank == 4
        assert_same(lps(client, c.batch), c.lp_saved, atol=1e-6)
    return run


for _name in ("create_training_client_from_state", "create_training_client_from_state_async",
              "create_training_client_from_state_with_optimizer",
              "create_training_client_from_state_with_optimizer_async"):
    check("ServiceClient", _name)(_from_state_check(_name))


@check("ServiceClient", "create_sampling_client")
def _(c):
    s = R(c.svc.create_sampling_client(model_path=c.sampler_path))
    assert s.get_base_model() == MODEL and R(s.compute_logprobs(c.full0)) == c.clp
    from_state = R(c.svc.create_sampling_client(model_path=c.state_path))  # a save_state checkpoint works too
    np.testing.assert_allclose(R(from_state.compute_logprobs(c.full0))[1:], c.lp_saved[0], atol=1e-4)


@check("ServiceClient", "create_sampling_client_async")
def _(c):
    s = arun(c.svc.create_sampling_client_async(base_model=MODEL))
    assert s.get_base_model() == MODEL
    lp = R(s.compute_logprobs(c.full0))  # the base model: LoRA starts as a no-op, so these are the initial ones
    np.testing.assert_allclose(lp[1:], c.lp_init[0], atol=1e-4)


@check("ServiceClient", "create_rest_client")
def _(c):
    rest = c.svc.create_rest_client()
    assert isinstance(rest, tinker.RestClient)
    assert c.t.model_id in {r.training_run_id for r in R(rest.list_training_runs(limit=100)).training_runs}


@check("ServiceClient", "get_server_capabilities")
def _(c):
    c.caps = c.svc.get_server_capabilities()
    assert MODEL in [m.model_name for m in c.caps.supported_models]


@check("ServiceClient", "get_server_capabilities_async")
def _(c):
    assert arun(c.svc.get_server_capabilities_async()) == c.caps


@check("ServiceClient", "get_console_url")
def _(c):
    url = c.svc.get_console_url()
    assert url.startswith("https://") and c.session_id in url


@check("ServiceClient", "get_telemetry")
def _(c):
    assert c.svc.get_telemetry() is None


@check("ServiceClient", "holder")
def _(c):
    assert c.svc.holder.get_session_id() == c.session_id


@check("ServiceClient", "copy_weights")
def _(c):
    R(c.svc.copy_weights(c.state_path))  # this client has a project_id, so the SDK sends the request


# --- SamplingClient ---
@check("SamplingClient", "sample")
def _(c):
    c.prompt = types.ModelInput.from_ints(c.tok.encode("12+3=", add_special_tokens=False))
    c.params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])
    c.sampled = R(c.s.sample(c.prompt, num_samples=2, sampling_params=c.params))
    assert len(c.sampled.sequences) == 2
    for seq in c.sampled.sequences:
        assert len(seq.tokens) == 4 and len(seq.logprobs) == 4 and seq.stop_reason == "length"


@check("SamplingClient", "sample_async")
def _(c):
    out = arun(c.s.sample_async(c.prompt, num_samples=2, sampling_params=c.params))
    assert [s.tokens for s in out.sequences] == [s.tokens for s in c.sampled.sequences]


@check("SamplingClient", "compute_logprobs")
def _(c):
    lp = R(c.s.compute_logprobs(c.full0))
    assert lp == c.clp and len(lp) == len(c.ids0)
    last2 = R(c.s.compute_logprobs(c.full0, prompt_logprobs_last_n=2))
    assert last2[:-2] == [None] * (len(lp) - 2)
    np.testing.assert_allclose(last2[-2:], lp[-2:], atol=1e-6)


@check("SamplingClient", "compute_logprobs_async")
def _(c):
    assert arun(c.s.compute_logprobs_async(c.full0)) == c.clp


@check("SamplingClient", "get_base_model")
def _(c):
    assert c.s.get_base_model() == MODEL


@check("SamplingClient", "get_base_model_async")
def _(c):
    assert arun(c.s.get_base_model_async()) == MODEL


@check("SamplingClient", "get_tokenizer")
def _(c):
    assert c.s.get_tokenizer().encode("7+7=14") == c.tok.encode("7+7=14")


@check("SamplingClient", "get_sampler_handle")
def _(c):
    c.handle = c.s.get_sampler_handle()
    fields = json.loads(base64.urlsafe_b64decode(c.handle))
    c.sampler_id = fields["sampling_session_id"]
    assert c.sampler_id.startswith(f"{c.session_id}:sample:")
    assert fields["holder"]["api_key"] is None  # the handle carries no credentials


@check("SamplingClient", "from_sampler_handle")
def _(c):
    clone = tinker.SamplingClient.from_sampler_handle(c.handle, api_key=c.lab.api_key)
    out = R(clone.sample(c.prompt, num_samples=2, sampling_params=c.params))
    assert [s.tokens for s in out.sequences] == [s.tokens for s in c.sampled.sequences]


@check("SamplingClient", "create")
def _(c):
    s = R(tinker.SamplingClient.create(c.svc.holder, base_model=MODEL))
    assert s.get_base_model() == MODEL
    out = R(s.sample(c.prompt, num_samples=1, sampling_params=c.params))
    assert len(out.sequences[0].tokens) == 4


@check("SamplingClient", "on_queue_state_change")
def _(c):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    sdk_log = logging.getLogger("tinker.lib.public_interfaces.sampling_client")
    sdk_log.addHandler(handler)
    try:
        assert c.s.on_queue_state_change(QueueState.ACTIVE, None) is None
        assert not records
        c.s.on_queue_state_change(QueueState.PAUSED_CAPACITY, "test")
    finally:
        sdk_log.removeHandler(handler)
    assert any("Sampling is paused" in r.getMessage() for r in records)


@check("SamplingClient", "get_telemetry")
def _(c):
    assert c.s.get_telemetry() is None


# --- RestClient ---
@check("RestClient", "get_server_capabilities")
def _(c):
    caps = R(c.rest.get_server_capabilities())
    assert caps == c.caps
    assert all(m.max_context_length and m.max_context_length > 0 for m in caps.supported_models)


@check("RestClient", "get_training_run")
def _(c):
    c.run = R(c.rest.get_training_run(c.t.model_id))
    assert c.run.training_run_id == c.t.model_id and c.run.base_model == MODEL
    assert c.run.is_lora and c.run.lora_rank == 4 and c.run.last_checkpoint is not None


@check("RestClient", "get_training_run_async")
def _(c):
    twin = arun(c.rest.get_training_run_async(c.t.model_id))
    assert (twin.training_run_id, twin.base_model, twin.lora_rank) == (c.run.training_run_id, MODEL, 4)


@check("RestClient", "get_training_run_by_tinker_path")
def _(c):
    assert R(c.rest.get_training_run_by_tinker_path(c.state_path)).training_run_id == c.t.model_id


@check("RestClient", "get_training_run_by_tinker_path_async")
def _(c):
    assert arun(c.rest.get_training_run_by_tinker_path_async(c.sampler_path)).training_run_id == c.t.model_id


@check("RestClient", "get_weights_info_by_tinker_path")
def _(c):
    info = R(c.rest.get_weights_info_by_tinker_path(c.state_path))
    assert info.base_model == MODEL and info.is_lora and info.lora_rank == 4


@check("RestClient", "list_checkpoints")
def _(c):
    listed = checkpoints(c)
    assert {c.state_path, c.state_path_b, c.sampler_path, c.sampler_path_2} <= set(listed)
    assert listed[c.state_path].checkpoint_type == "training"
    assert listed[c.sampler_path].checkpoint_type == "sampler"
    assert listed[c.state_path].checkpoint_id == "weights/compat-a"


@check("RestClient", "list_checkpoints_async")
def _(c):
    listed = {ck.tinker_path for ck in arun(c.rest.list_checkpoints_async(c.t.model_id)).checkpoints}
    assert listed == set(checkpoints(c))


@check("RestClient", "list_user_checkpoints")
def _(c):
    listed = {ck.tinker_path for ck in R(c.rest.list_user_checkpoints(limit=1000)).checkpoints}
    assert {c.state_path, c.sampler_path} <= listed


@check("RestClient", "list_user_checkpoints_async")
def _(c):
    out = arun(c.rest.list_user_checkpoints_async(limit=1, offset=0))
    assert len(out.checkpoints) == 1 and out.cursor.total_count >= 4


@check("RestClient", "list_training_runs")
def _(c):
    out = R(c.rest.list_training_runs(limit=100))
    assert c.t.model_id in {r.training_run_id for r in out.training_runs}


@check("RestClient", "list_training_runs_async")
def _(c):
    out = arun(c.rest.list_training_runs_async(limit=2, offset=0))
    assert len(out.training_runs) == 2 and out.cursor.total_count >= 5


@check("RestClient", "list_sessions")
def _(c):
    assert c.session_id in R(c.rest.list_sessions(limit=100)).sessions


@check("RestClient", "list_sessions_async")
def _(c):
    assert c.session_id in arun(c.rest.list_sessions_async(limit=100)).sessions


@check("RestClient", "get_session")
def _(c):
    c.sess = R(c.rest.get_session(c.session_id))
    assert c.t.model_id in c.sess.training_run_ids and c.sampler_id in c.sess.sampler_ids


@check("RestClient", "get_session_async")
def _(c):
    assert arun(c.rest.get_session_async(c.session_id)) == c.sess


@check("RestClient", "get_sampler")
def _(c):
    out = R(c.rest.get_sampler(c.sampler_id))
    assert out.sampler_id == c.sampler_id and out.base_model == MODEL


@check("RestClient", "get_sampler_async")
def _(c):
    path_sampler = next(s for s in c.sess.sampler_ids if s != c.sampler_id
                        and R(c.rest.get_sampler(s)).model_path == c.sampler_path)
    out = arun(c.rest.get_sampler_async(path_sampler))
    assert out.base_model == MODEL and out.model_path == c.sampler_path


@check("RestClient", "publish_checkpoint_from_tinker_path")
def _(c):
    R(c.rest.publish_checkpoint_from_tinker_path(c.state_path))
    assert checkpoints(c)[c.state_path].public


@check("RestClient", "unpublish_checkpoint_from_tinker_path")
def _(c):
    R(c.rest.unpublish_checkpoint_from_tinker_path(c.state_path))
    assert not checkpoints(c)[c.state_path].public


@check("RestClient", "publish_checkpoint_from_tinker_path_async")
def _(c):
    arun(c.rest.publish_checkpoint_from_tinker_path_async(c.sampler_path))
    assert checkpoints(c)[c.sampler_path].public


@check("RestClient", "unpublish_checkpoint_from_tinker_path_async")
def _(c):
    arun(c.rest.unpublish_checkpoint_from_tinker_path_async(c.sampler_path))
    assert not checkpoints(c)[c.sampler_path].public


@check("RestClient", "set_checkpoint_ttl_from_tinker_path")
def _(c):
    R(c.rest.set_checkpoint_ttl_from_tinker_path(c.sampler_path, 3600))
    expires = checkpoints(c)[c.sampler_path].expires_at
    assert expires is not None and expires > datetime.now(timezone.utc) + timedelta(minutes=55)


@check("RestClient", "set_checkpoint_ttl_from_tinker_path_async")
def _(c):
    arun(c.rest.set_checkpoint_ttl_from_tinker_path_async(c.sampler_path, None))
    assert checkpoints(c)[c.sampler_path].expires_at is None


@check("RestClient", "delete_checkpoint")
def _(c):
    R(c.rest.delete_checkpoint(c.t.model_id, "weights/compat-b"))
    assert c.state_path_b not in checkpoints(c)


@check("RestClient", "delete_checkpoint_async")
def _(c):
    arun(c.rest.delete_checkpoint_async(c.t.model_id, "sampler_weights/compat-s2"))
    assert c.sampler_path_2 not in checkpoints(c)


@check("RestClient", "delete_checkpoint_from_tinker_path")
def _(c):
    path = R(c.t.save_state("compat-del")).path
    assert path in checkpoints(c)
    R(c.rest.delete_checkpoint_from_tinker_path(path))
    assert path not in checkpoints(c)


@check("RestClient", "delete_checkpoint_from_tinker_path_async")
def _(c):
    path = R(c.t.save_weights_for_sampler("compat-del-s")).path
    arun(c.rest.delete_checkpoint_from_tinker_path_async(path))
    assert path not in checkpoints(c)


@check("RestClient", "assign_session_project")
def _(c):
    assert session_project(c.lab.home, c.session_id) == "compat-project"  # sent by ServiceClient(project_id=)
    R(c.rest.assign_session_project(c.session_id, "compat-moved"))
    assert session_project(c.lab.home, c.session_id) == "compat-moved"


@check("RestClient", "assign_session_project_async")
def _(c):
    arun(c.rest.assign_session_project_async(c.session_id, "compat-moved-again"))
    assert session_project(c.lab.home, c.session_id) == "compat-moved-again"


@check("RestClient", "whoami")
def _(c):
    with pytest.raises(RuntimeError, match="whoami requires JWT auth"):
        R(c.rest.whoami())


@check("RestClient", "get_telemetry")
def _(c):
    assert c.rest.get_telemetry() is None


_NOT_SUPPORTED_REST: dict[str, Callable[[SimpleNamespace], Any]] = {
    "copy_weights": lambda c: R(c.rest.copy_weights(c.state_path, "compat-project")),
    "copy_weights_async": lambda c: arun(c.rest.copy_weights_async(c.state_path, "compat-project")),
    "export_session_trace": lambda c: R(c.rest.export_session_trace(c.session_id)),
    "export_session_trace_async": lambda c: arun(c.rest.export_session_trace_async(c.session_id)),
    "get_external_weights_urls": lambda c: R(c.rest.get_external_weights_urls(
        f"tinker://{c.t.model_id}/external_weights/compat-x")),
    "get_external_weights_urls_async": lambda c: arun(c.rest.get_external_weights_urls_async(
        f"tinker://{c.t.model_id}/external_weights/compat-x")),
    "search_sessions": lambda c: R(c.rest.search_sessions(types.SessionSearchRequest())),
    "get_audit_log": lambda c: R(c.rest.get_audit_log()),
    "get_audit_log_async": lambda c: arun(c.rest.get_audit_log_async()),
    "get_billing_usage": lambda c: R(c.rest.get_billing_usage("2025-01-01", "2025-02-01")),
    "get_billing_usage_async": lambda c: arun(c.rest.get_billing_usage_async("2025-01-01", "2025-02-01")),
    "get_current_checkpoint_storage_usage": lambda c: R(c.rest.get_current_checkpoint_storage_usage()),
    "get_current_checkpoint_storage_usage_async":
        lambda c: arun(c.rest.get_current_checkpoint_storage_usage_async()),
}
for _name, _call in _NOT_SUPPORTED_REST.items():
    check("RestClient", _name)(_call)


# --- APIFuture (on a RestClient future) ---
@check("APIFuture", "result")
def _(c):
    c.fut = c.rest.get_server_capabilities()
    assert isinstance(c.fut, APIFuture) and c.fut.result(timeout=TIMEOUT) == c.caps


@check("APIFuture", "future")
def _(c):
    f = c.fut.future()
    assert isinstance(f, concurrent.futures.Future) and f.result(timeout=TIMEOUT) == c.caps


@check("APIFuture", "result_async")
def _(c):
    assert asyncio.run(c.rest.get_server_capabilities().result_async(timeout=TIMEOUT)) == c.caps


@check("APIFuture", "coroutine")
def _(c):
    coro = c.rest.get_server_capabilities().coroutine()
    assert inspect.iscoroutine(coro) and asyncio.run(coro) == c.caps


# --- options of supported methods that the server refuses: (the call, words its error must contain) ---
VARIANTS: list[tuple[str, str, Callable[[SimpleNamespace], Any]]] = [
    ("create_lora_training_client(optimizer=DimuonOptimizerConfig())", "not supported",
     lambda c: R(c.svc.create_lora_training_client(MODEL, rank=4, optimizer=types.DimuonOptimizerConfig()))),
    ("create_training_client_from_state(path, optimizer=DimuonOptimizerConfig())", "not supported",
     lambda c: R(c.svc.create_training_client_from_state(c.state_path, optimizer=types.DimuonOptimizerConfig()))),
    ("optim_step(DimuonParams(...))", "only AdamW",
     lambda c: R(c.t.optim_step(types.DimuonParams(learning_rate=1e-3)))),
    ("sample(..., topk_sample_logprobs=2)", "not supported",
     lambda c: R(c.s.sample(c.prompt, 1, c.params, topk_sample_logprobs=2))),
    ("sample(..., prompt_alt_tokens_k=2)", "not supported",
     lambda c: R(c.s.sample(c.prompt, 1, c.params, prompt_alt_tokens_k=2))),
]


def run_variants(c) -> dict[str, str | None]:
    """Each refused option's error message (None: it was not refused)."""
    errors: dict[str, str | None] = {}
    for what, _words, call in VARIANTS:
        try:
            call(c)
            errors[what] = None
        except Exception as e:  # noqa: BLE001
            errors[what] = server_message(e)
    return errors


# --- last: closing the ServiceClient ends its trainers and samplers, so the refused options run just before ---
@check("ServiceClient", "close")
def _(c):
    c.variant_errors = run_variants(c)
    assert R(c.svc.close("success")) is None
    r = httpx.post(f"{c.lab.base_url}/api/v1/session_heartbeat", headers={"X-API-Key": c.lab.api_key},
                   json={"session_id": c.session_id, "type": "session_heartbeat"}, timeout=30)
    assert r.status_code == 410 and "finished" in r.json()["detail"]


# --- the run --------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
def test_every_sdk_method_against_the_server(lab):
    planned = {(cls, m) for cls, m, _ in PLAN}
    assert len(planned) == len(PLAN), "a method is checked twice"
    unchecked = {(cls, m) for cls, table in EXPECTED.items() for m in table} - planned
    assert not unchecked, f"methods in EXPECTED without a check: {sorted(unchecked)}"

    c = SimpleNamespace(lab=lab, rest=tinker.RestClient(base_url=lab.base_url, api_key=lab.api_key),
                        svc=tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key,
                                                 project_id="compat-project"))
    outcomes: dict[tuple[str, str], tuple[str, str]] = {}  # (cls, method) -> (observed status, detail)
    problems: list[str] = []
    try:
        for cls, method, fn in PLAN:
            expected, _reason = EXPECTED[cls][method]
            try:
                fn(c)
            except Exception as e:  # noqa: BLE001
                message = server_message(e)
                from_server = isinstance(e, (tinker.APIStatusError, tinker.RequestFailedError))
                if expected == NOT_SUPPORTED and from_server and "not supported" in message.lower():
                    outcomes[cls, method] = (NOT_SUPPORTED, message)
                else:
                    outcomes[cls, method] = ("FAILED", f"{type(e).__name__}: {message}")
                    problems.append(f"{cls}.{method} (expected {expected}) raised {type(e).__name__}: {message}")
                continue
            if expected == NOT_SUPPORTED:
                outcomes[cls, method] = ("FAILED", "succeeded")
                problems.append(f"{cls}.{method} is marked not supported but succeeded")
            else:
                outcomes[cls, method] = (expected, "")
    finally:
        with contextlib.suppress(Exception):
            R(c.svc.close("errored"))  # a no-op when the close check already ran
    variant_errors = getattr(c, "variant_errors", {})
    for what, words, _call in VARIANTS:
        got = variant_errors.get(what, "not run")
        if got is None or words.lower() not in got.lower():
            problems.append(f"{what}: expected an error saying {words!r}, got {got!r}")
    problems += table_mismatches()  # the report must list exactly the SDK's methods
    assert not problems, "\n".join(problems)

    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(render_report(outcomes, variant_errors))


# --- the report -----------------------------------------------------------------------------------------------
def render_report(outcomes: dict[tuple[str, str], tuple[str, str]], variant_errors: dict[str, str | None]) -> str:
    version = tinker.__version__
    lines = [
        "# Tinker SDK compatibility",
        "",
        f"Generated with **tinker {version}** by `tests/gateway/test_compatibility.py`, which calls every public "
        "method of the SDK's clients through the real SDK against a real `openrl-lab serve` and rewrites this "
        "file when all checks pass. Do not edit it by hand: run "
        "`.venv/bin/pytest tests/gateway/test_compatibility.py` to regenerate it.",
        "",
        "- **supported**: called against the server and its result checked (shapes, ids, equality with the "
        "sync twin, round trips).",
        "- **not supported**: the call reaches the server, which refuses it with an error saying so (quoted).",
        "- **client-only**: the SDK answers without asking the server.",
        "",
        "Deprecated `*_async` twins are listed separately; they were driven with `asyncio.run`.",
        "",
        "## Summary",
        "",
        "| class | supported | not supported | client-only | total |",
        "|---|---:|---:|---:|---:|",
    ]
    totals = [0, 0, 0, 0]
    for cls_name in CLASSES:
        counts = [sum(1 for m in EXPECTED[cls_name] if outcomes[cls_name, m][0] == s)
                  for s in (SUPPORTED, NOT_SUPPORTED, CLIENT_ONLY)]
        counts.append(len(EXPECTED[cls_name]))
        totals = [a + b for a, b in zip(totals, counts)]
        lines.append(f"| {cls_name} | " + " | ".join(map(str, counts)) + " |")
    lines.append("| **all** | " + " | ".join(f"**{n}**" for n in totals) + " |")

    for cls_name, cls in CLASSES.items():
        members = public_members(cls)
        lines += ["", f"## {cls_name}", "", "| method | kind | status | notes |", "|---|---|---|---|"]
        for method in sorted(EXPECTED[cls_name]):
            status, detail = outcomes[cls_name, method]
            _expected, reason = EXPECTED[cls_name][method]
            info = members[method]
            kind = info["kind"] + (f", {info['flag']}" if info["flag"] else "")
            notes = reason + (f' — server: "{detail}"' if status == NOT_SUPPORTED and detail else "")
            lines.append(f"| `{method}` | {kind} | {status} | {notes.replace('|', '/')} |")

    lines += ["", "## Refused options of supported methods", "", "| call | server's error |", "|---|---|"]
    for what, _words, _call in VARIANTS:
        lines.append(f"| `{what}` | {str(variant_errors[what]).replace('|', '/')} |")
    lines.append("")
    return "\n".join(lines)
