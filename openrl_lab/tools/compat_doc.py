"""The Tinker SDK compatibility table and docs/tinker-compatibility.md, rendered from it.

`EXPECTED` says, for every public method of the SDK's clients, whether OpenRL Lab supports it, refuses it with
an error saying it is not supported, or whether the SDK answers it without the server.
tests/gateway/test_compatibility.py checks each row through the real SDK against a real server, and that the
committed doc is what this module renders. Regenerate the doc (from the repository root) with

    python -m openrl_lab.tools.compat_doc

The doc is rendered from the table and the installed SDK alone, so it needs no running server and cannot
drift from what the tests check.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

import tinker
from tinker.lib.public_interfaces.api_future import APIFuture

DOC = Path("docs/tinker-compatibility.md")
COMMAND = "python -m openrl_lab.tools.compat_doc"

SUPPORTED, NOT_SUPPORTED, CLIENT_ONLY = "supported", "not supported", "client-only"
CLASSES: dict[str, type] = {
    "ServiceClient": tinker.ServiceClient,
    "TrainingClient": tinker.TrainingClient,
    "SamplingClient": tinker.SamplingClient,
    "RestClient": tinker.RestClient,
    "APIFuture": APIFuture,
}

_ADMIN = "admin-only (AdminClient); there are no organizations, billing or admin roles"
_TELEMETRY = (
    "returns the SDK's telemetry object; None here because the tests set TINKER_TELEMETRY=0 "
    "(POST /telemetry is accepted and discarded otherwise)"
)

# method -> (expected status, what it does here / why not). Deprecated `*_async` twins are listed too.
EXPECTED: dict[str, dict[str, tuple[str, str]]] = {
    "ServiceClient": {
        "close": (SUPPORTED, "POST /sessions/{id}/finish; the server then answers the session's heartbeat with 410"),
        "copy_weights": (
            NOT_SUPPORTED,
            "there are no projects to copy checkpoints between; publish a checkpoint to let other users load it",
        ),
        "create_custom_loss": (
            SUPPORTED,
            (
                "the loss is traced client-side (server sends custom_loss_server_side="
                "false) and runs through forward_backward_custom"
            ),
        ),
        "create_lora_training_client": (
            SUPPORTED,
            (
                "create_model + get_info; only the adamw optimizer; seed=None "
                "gives each adapter a fresh random init, a seed a repeatable one; "
                "rank=0 asks for full fine-tuning (no adapter, every weight "
                "trained, get_info says is_lora false): one that does not fit "
                "the kernel's device memory (16 bytes a weight) is a 400 naming "
                "the sizes"
            ),
        ),
        "create_lora_training_client_async": (SUPPORTED, "deprecated twin; same initial logprobs as the sync call"),
        "create_rest_client": (SUPPORTED, "deprecated; returns a working RestClient"),
        "create_sampling_client": (SUPPORTED, "from a base model or a tinker://…/sampler_weights (or weights) path"),
        "create_sampling_client_async": (SUPPORTED, "deprecated twin"),
        "create_training_client_from_state": (
            SUPPORTED,
            "load_weights without optimizer state; weights restored exactly",
        ),
        "create_training_client_from_state_async": (SUPPORTED, "deprecated twin"),
        "create_training_client_from_state_with_optimizer": (SUPPORTED, "load_weights with the AdamW state"),
        "create_training_client_from_state_with_optimizer_async": (SUPPORTED, "deprecated twin"),
        "get_console_url": (
            CLIENT_ONLY,
            (
                "builds a tinker.thinkingmachines.ai console link for the session; "
                "OpenRL Lab has no console, so the link is of no use"
            ),
        ),
        "get_server_capabilities": (
            SUPPORTED,
            (
                "deprecated; GET /get_server_capabilities lists the built-in models and the operator's catalog "
                "(`serve --model`)"
            ),
        ),
        "get_server_capabilities_async": (SUPPORTED, "deprecated twin; equal to the sync answer"),
        "get_telemetry": (CLIENT_ONLY, _TELEMETRY),
        "holder": (CLIENT_ONLY, "deprecated property: the SDK's internal session holder (creates the session lazily)"),
    },
    "TrainingClient": {
        "create_sampling_client": (SUPPORTED, "sampler from a saved checkpoint path"),
        "create_sampling_client_async": (SUPPORTED, "deprecated twin"),
        "forward": (SUPPORTED, "per-datum target logprobs, no gradients"),
        "forward_async": (SUPPORTED, "deprecated twin; equal to forward"),
        "forward_backward": (
            SUPPORTED,
            (
                "protobuf request/response (older SDKs: JSON, see below); loss:sum = -Σ w·logp; cross_entropy, "
                "importance_sampling, ppo, cispo, dro; the last four also report sampler_kl:mean and "
                "sampler_logprob_diff:max (the sampler-vs-trainer mismatch on the sampled tokens)"
            ),
        ),
        "forward_backward_async": (SUPPORTED, "deprecated twin; equal to forward_backward"),
        "forward_backward_custom": (
            SUPPORTED,
            "runs client-side: a forward pass, then a cross_entropy backward with weights = -dLoss/dlogp (needs torch)",
        ),
        "forward_backward_custom_async": (SUPPORTED, "deprecated twin; also with a create_custom_loss handle"),
        "get_console_url": (
            CLIENT_ONLY,
            "builds a tinker.thinkingmachines.ai console link for the training run; of no use with OpenRL Lab",
        ),
        "get_info": (
            SUPPORTED,
            (
                "answered from the server's get_info, fetched when the client was created; the server's answer "
                "also says what the job trains (`trained`: LoRA targets with their parameter counts, fused MoE "
                "experts, whether the router is trained) and where it runs (`placement`), which the SDK's type "
                "drops: read them with a plain POST to /api/v1/get_info"
            ),
        ),
        "get_info_async": (SUPPORTED, "deprecated twin; same answer"),
        "get_telemetry": (CLIENT_ONLY, _TELEMETRY),
        "get_tokenizer": (
            SUPPORTED,
            (
                "loads the tokenizer from model_data.tokenizer_id: the model's directory on "
                "the server's machine; elsewhere a name served by the lab's /hf mirror "
                "(set HF_ENDPOINT=<base_url>/hf, HF_TOKEN=<lab key>)"
            ),
        ),
        "load_state": (SUPPORTED, "deprecated (legacy load_weights on the existing model); weights restored exactly"),
        "load_state_async": (SUPPORTED, "deprecated twin"),
        "load_state_with_optimizer": (SUPPORTED, "deprecated; also restores the AdamW state"),
        "load_state_with_optimizer_async": (SUPPORTED, "deprecated twin"),
        "optim_step": (SUPPORTED, "AdamW (adam_params); dimuon params are refused"),
        "optim_step_async": (SUPPORTED, "deprecated twin"),
        "save_state": (SUPPORTED, "tinker://<run>/weights/<name>: weights + optimizer state"),
        "save_state_async": (SUPPORTED, "deprecated twin"),
        "save_weights_and_get_sampling_client": (
            SUPPORTED,
            "snapshot sampler of the current weights (kind='inflight' is served as a snapshot)",
        ),
        "save_weights_and_get_sampling_client_async": (SUPPORTED, "deprecated twin"),
        "save_weights_external": (
            SUPPORTED,
            (
                "tinker://<run>/external_weights/<name>: the weights as a PEFT adapter "
                "(LoRA) or a Hugging Face model (full fine-tuning), for "
                "get_external_weights_urls; no age encryption"
            ),
        ),
        "save_weights_external_async": (SUPPORTED, "deprecated twin"),
        "save_weights_for_sampler": (SUPPORTED, "tinker://<run>/sampler_weights/<name>"),
        "save_weights_for_sampler_async": (SUPPORTED, "deprecated twin"),
    },
    "SamplingClient": {
        "compute_logprobs": (
            SUPPORTED,
            "prompt logprobs (first is None), prompt_logprobs_last_n honoured; match the trainer's forward",
        ),
        "compute_logprobs_async": (SUPPORTED, "deprecated twin; equal to compute_logprobs"),
        "create": (SUPPORTED, "static; SamplingClient.create(holder, base_model=…)"),
        "from_sampler_handle": (
            SUPPORTED,
            (
                "static; a client rebuilt from a handle samples the same sampler "
                "(pass api_key=: the handle carries no credentials)"
            ),
        ),
        "get_base_model": (SUPPORTED, "known since creation (GET /samplers/{id} for path-based samplers)"),
        "get_base_model_async": (SUPPORTED, "deprecated twin"),
        "get_sampler_handle": (
            CLIENT_ONLY,
            "encodes the sampler id, session and server config as base64 JSON; no request",
        ),
        "get_telemetry": (CLIENT_ONLY, _TELEMETRY),
        "get_tokenizer": (
            SUPPORTED,
            (
                "loads the base model's tokenizer by name: from the local HF cache, where the "
                "server registers its built-in models (same machine), elsewhere from the "
                "lab's /hf mirror (HF_ENDPOINT=<base_url>/hf, HF_TOKEN=<lab key>)"
            ),
        ),
        "on_queue_state_change": (
            CLIENT_ONLY,
            "callback the SDK uses to log a paused queue; the server only ever reports queue_state 'active'",
        ),
        "sample": (
            SUPPORTED,
            (
                "seeded, temperature/top_k/top_p/stop; topk_prompt_logprobs and "
                "topk_sample_logprobs up to k=20 (torch and vLLM samplers); alt tokens and target logprobs "
                "are refused"
            ),
        ),
        "sample_async": (SUPPORTED, "deprecated twin; same tokens for the same seed"),
    },
    "RestClient": {
        "assign_session_project": (SUPPORTED, "PUT /sessions/{id}/project; stored with the session"),
        "assign_session_project_async": (SUPPORTED, "deprecated twin"),
        "copy_weights": (
            NOT_SUPPORTED,
            "there are no projects to copy checkpoints between; publish a checkpoint to let other users load it",
        ),
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
        "get_external_weights_urls": (
            SUPPORTED,
            (
                "signed URLs, one per file, valid 30 min, fetched without a key "
                "(what `tinker checkpoint download` does); the server also answers "
                "for weights/ and sampler_weights/ paths, and ?format=merged merges "
                "a LoRA run into its base model"
            ),
        ),
        "get_external_weights_urls_async": (SUPPORTED, "deprecated twin"),
        "get_sampler": (SUPPORTED, "sampler id, base model, model path"),
        "get_sampler_async": (SUPPORTED, "deprecated twin"),
        "get_server_capabilities": (
            SUPPORTED,
            (
                "the built-in models and the operator's catalog (`serve --model`), each with its context length; the "
                "raw answer also names its family, architecture, size and what is validated for it"
            ),
        ),
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
        "set_checkpoint_ttl_from_tinker_path": (
            SUPPORTED,
            "sets or clears expires_at; expired checkpoints are deleted by a sweep",
        ),
        "set_checkpoint_ttl_from_tinker_path_async": (SUPPORTED, "deprecated twin"),
        "unpublish_checkpoint_from_tinker_path": (SUPPORTED, "makes a checkpoint private again"),
        "unpublish_checkpoint_from_tinker_path_async": (SUPPORTED, "deprecated twin"),
        "whoami": (
            CLIENT_ONLY,
            (
                "decodes the JWT the SDK holds; the server leaves JWT auth off, so it raises "
                "RuntimeError('whoami requires JWT auth …') without a request"
            ),
        ),
    },
    "APIFuture": {
        "coroutine": (SUPPORTED, "the future as a coroutine"),
        "future": (SUPPORTED, "the underlying concurrent.futures.Future"),
        "result": (SUPPORTED, "blocks for the result, with an optional timeout"),
        "result_async": (SUPPORTED, "awaits the result, with an optional timeout"),
    },
}


# Options of supported methods that the server refuses: the call, and words its error must contain.
REFUSED_OPTIONS: dict[str, str] = {
    "create_lora_training_client(optimizer=DimuonOptimizerConfig())": "not supported",
    "create_training_client_from_state(path, optimizer=DimuonOptimizerConfig())": "not supported",
    "optim_step(DimuonParams(...))": "only AdamW",
    "save_weights_external(name, age_encryption_recipients=[...])": "not supported",
    "sample(..., prompt_alt_tokens_k=2)": "not supported",
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


# Older SDKs (tests/gateway/test_sdk_versions.py runs each from its own environment; the Makefile's SDK_VERSIONS).
OLDER_SDKS = """\
## Older SDK versions

Projects pin older SDKs. `tests/gateway/test_sdk_versions.py` drives one real lab from each of these versions,
each installed in an environment of its own (`make sdk-envs`: `.venv-sdk/<version>`; part of `make test`), with
the calls they all share (`tests/gateway/sdk_versions_driver.py`: a LoRA client, get_info, get_tokenizer,
forward_backward + optim_step until the loss falls, forward, an importance_sampling step, save_state +
load_state, a sampler snapshot sampled twice with one seed, compute_logprobs equal to the sampled logprobs, a
base-model sampler, the checkpoint listing):

| tinker | what it sends and reads | the calls above |
|---|---|---|
| 0.18.1 (OpenRL's target) | forward_backward and forward (`POST /forward`) as JSON; decodes only sample results from protobuf, so it gets forward_backward results as JSON (it does not `Accept` protobuf for them). It imports `orjson` without declaring it: install `orjson` beside it | pass |
| 0.24.1 (the newest SkyRL 0.3.0 accepts) | JSON unless client/config says `proto_write_fwdbwd`, which the lab does (and `fwd_via_fwdbwd`: forward goes through forward_backward); protobuf results | pass |
| 0.25.0 (the first that always sends protobuf) | protobuf both ways | pass |
| 0.38.0 (this project's) | protobuf both ways; every method above | pass |

How the lab tells them apart: a forward_backward body with `Content-Type: application/json` is read as the
JSON request (`forward_backward_input` of datums whose tensors are `{data, dtype, shape}`), checked as strictly as
protobuf (the same per-datum checks, after it is turned into the same protobuf) and limited to 32 MiB (64 MiB for
protobuf); a protobuf result goes to a `retrieve_future` without `Accept: application/x-protobuf` as the JSON
the SDK's pydantic types read. An SDK before 0.28 (it says its version in `X-Stainless-Package-Version`) knows
no `external` checkpoints and fails to read a listing that holds one: its listings leave them out.
"""

# The doc's last section: tinker-cookbook's recipes against the lab (tests/cookbook checks the two it names).
COOKBOOK = """\
## tinker-cookbook recipes

[tinker-cookbook](https://pypi.org/project/tinker-cookbook/) **0.5.8**, the newest that installs beside
tinker 0.38.0 here (0.6 needs a package the registry lacks), runs against the lab unchanged.
`tests/cookbook/test_cookbook_recipes.py` runs two of its recipes as a user would,
`python -m <module> key=value ...`, against a real `openrl-lab serve` (the fourth step of `make test`):

- `tinker_cookbook.recipes.chat_sl.train` (supervised, `tinker_cookbook.supervised.train` underneath) on a
  JSONL dataset the test writes: 6 steps, `train_mean_nll` finite and falling, its checkpoints listed by the
  lab, and a run cut off after a checkpoint resumes from it (`behavior_if_log_dir_exists=resume`) with the
  trained weights and optimizer state;
- `tinker_cookbook.recipes.math_rl.train` with `env=arithmetic` (RL, `tinker_cookbook.rl.train`
  underneath): 2 steps of 2 groups x 4 samples, rewards recorded per step, its checkpoints in the lab.

**Environment.** The cookbook pins a transformers below the lab's band: `make cookbook-env` makes
`.venv-cookbook` (CPU torch 2.13.0 first, then `tinker-cookbook[math-rl]==0.5.8` and `tinker==0.38.0`) and
the lab keeps running from `.venv`. The `math-rl` extra brings the math graders `math_rl` imports even for
`env=arithmetic`.

**Settings a recipe needs here.**

| setting | why |
|---|---|
| `base_url=<lab>`, `TINKER_API_KEY=<key>` | the lab instead of Tinker's service |
| `model_name=openrl-lab/tiny-llama-1m` (or `-10m`, or a local model directory the lab serves) | the lab's models |
| `renderer_name=role_colon` on the built-in models | without it the cookbook looks the model up in its own table of hub models: `Unknown model: openrl-lab/tiny-llama-1m`. `role_colon` (`User: ...` / `Assistant: ...`) needs no special tokens, so it fits any tokenizer. A model served under a hub name the cookbook knows (`serve --model Qwen/Qwen3-8B` on a machine that has it cached) needs no `renderer_name`: the recipe picks its own (`qwen3`), as on hosted Tinker |
| `HF_ENDPOINT=<lab>/hf`, `HF_TOKEN=<key>`, no `HF_HUB_OFFLINE` | the cookbook loads the tokenizer by model name itself; the lab's read-only hub mirror serves it |
| a local dataset (`dataset=/path/chat.jsonl` for chat_sl: one `{"messages": [{"role": ..., "content": ...}, ...]}` per line; `FromConversationFileBuilder` in Python) | no hub is reachable from the lab's machines |
| `learning_rate=...` | recipes that default it with `hyperparam_utils.get_lr(model_name)` raise `Unknown model` too |

**From a notebook.** `openrl_lab.lab.cookbook.CookbookRun.start(lab, "math_rl", log_path, key=value...)` runs
a recipe with these settings in the cookbook's environment (found as `.venv-cookbook`, or
`$OPENRL_COOKBOOK_PYTHON`) as a child process, `run.plot([...])` follows its `metrics.jsonl` on a live plot, and
`run.wait()` raises `CookbookError` with the end of its log if it failed. `notebooks/07-tinker-cookbook.ipynb`
warms the model up with chat_sl on a local dataset of sums and runs math_rl from that checkpoint.

**What does not work, and why.**

- `recipes/sl_basic.py` and `recipes/rl_basic.py` call `model_info.get_recommended_renderer_name(model_name)`
  before they read the command line, so on the built-in models they stop with `Unknown model` whatever
  `renderer_name` says; on a model with a hub name the cookbook knows they run (tested on the Qwen3 stand-in
  below, with their hub datasets swapped on the command line:
  `dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder dataset_builder.file_path=...`,
  `dataset_builder=tinker_cookbook.recipes.math_rl.arithmetic_env:ArithmeticDatasetBuilder ...`).
- Recipes and options that download hub datasets or benchmarks: chat_sl's `no_robots` and `tulu3`, math_rl's
  `math`, `gsm8k`, `polaris`, `deepmath`, `inline_evals=inspect`, and most other recipes' default datasets.
- Renderers for a model family are written for that family's chat tokens. Tested here: `role_colon` on the
  built-in Llama, and `qwen3` (picked by the recipes themselves) on a Qwen3 stand-in with the real Qwen vocabulary,
  Qwen3's added tokens and ChatML (`openrl_lab/train/families.py`: Qwen3-8B's config shrunk to 2 layers, random
  weights), put in a Hugging Face cache as `Qwen/Qwen3-8B` the way a download leaves it and served by that name:
  chat_sl, math_rl, sl_basic and rl_basic run unchanged (`tests/cookbook`). `llama3` (picked by chat_sl itself) on
  a Llama 3.1 Instruct stand-in with the real Llama 3 vocabulary served as `meta-llama/Llama-3.1-8B-Instruct`: the
  cookbook loads every `meta-llama/Llama-3*` model's tokenizer from a repo of its own
  (`thinkingmachineslabinc/meta-llama-3-instruct-tokenizer`), which the lab's mirror serves when told
  (`serve --tokenizer-alias thinkingmachineslabinc/meta-llama-3-instruct-tokenizer=meta-llama/Llama-3.1-8B-Instruct`).
  Other families' renderers (`gemma3`, `gpt_oss`, ...) are untested: their real tokenizers cannot be had offline.

A note, not a fault: chat_sl's `save_every` checkpoint is saved after the cookbook has already submitted the
next step (it keeps one step in flight), so it holds that step's update too, and a resumed run replays the
named step from those weights.
"""


def render() -> str:
    lines = [
        "# Tinker SDK compatibility",
        "",
        (
            f"For **tinker {tinker.__version__}**. Generated by `{COMMAND}` (run at the repository root) from the "
            "table in `openrl_lab/tools/compat_doc.py`; do not edit it by hand. "
            "`tests/gateway/test_compatibility.py` calls every method below through the real SDK against a real "
            "`openrl-lab serve`, one test per method (e.g. `pytest tests/gateway/test_compatibility.py -k "
            "'TrainingClient.forward_backward]'`), and fails when a row is wrong, when the installed SDK's public "
            "methods differ from the table, or when this file differs from what the command generates."
        ),
        "",
        (
            "- **supported**: called against the server and its result checked (shapes, ids, equality with the "
            "sync twin, round trips)."
        ),
        "- **not supported**: the call reaches the server, which refuses it with an error saying so.",
        "- **client-only**: the SDK answers without asking the server.",
        "",
        "Deprecated `*_async` twins are listed separately; they are driven with `asyncio.run`.",
        "",
        "## Summary",
        "",
        "| class | supported | not supported | client-only | total |",
        "|---|---:|---:|---:|---:|",
    ]
    totals = [0, 0, 0, 0]
    for cls_name in CLASSES:
        statuses = [status for status, _ in EXPECTED[cls_name].values()]
        counts = [statuses.count(s) for s in (SUPPORTED, NOT_SUPPORTED, CLIENT_ONLY)] + [len(statuses)]
        totals = [a + b for a, b in zip(totals, counts)]
        lines.append(f"| {cls_name} | " + " | ".join(map(str, counts)) + " |")
    lines.append("| **all** | " + " | ".join(f"**{n}**" for n in totals) + " |")

    for cls_name, cls in CLASSES.items():
        members = public_members(cls)
        lines += ["", f"## {cls_name}", "", "| method | kind | status | notes |", "|---|---|---|---|"]
        for method in sorted(EXPECTED[cls_name]):
            status, notes = EXPECTED[cls_name][method]
            info = members[method]
            kind = info["kind"] + (f", {info['flag']}" if info["flag"] else "")
            lines.append(f"| `{method}` | {kind} | {status} | {notes.replace('|', '/')} |")

    lines += ["", "## Refused options of supported methods", "", "| call | the server's error says |", "|---|---|"]
    lines += [f"| `{call}` | {words} |" for call, words in REFUSED_OPTIONS.items()]
    lines += ["", *OLDER_SDKS.splitlines(), "", *COOKBOOK.splitlines(), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Regenerate the Tinker SDK compatibility doc.")
    parser.add_argument("path", nargs="?", type=Path, default=DOC, help=f"where to write it (default: {DOC})")
    args = parser.parse_args(argv)
    problems = table_mismatches()
    if problems:  # a row per installed SDK method, or the doc would describe another SDK
        print("\n".join(problems), file=sys.stderr)
        return 1
    args.path.write_text(render())
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
