"""Every `OPENRL_*` environment variable in one place (pydantic-settings): its name, type, default and meaning.

Code reads them through `settings()` where it uses them, at run time, never at import: a bad value is then a
`SettingsError` whose one line names the variable, the value it got and what it takes. Every entry point
(`openrl-lab ...`, a kernel process, the orchestrator) calls `check()` first, so a typo stops the program at
start with that line instead of a traceback later. An empty variable counts as unset.

docs/settings.md is generated from this class (`python -m openrl_lab.tools.settings_doc`); a test checks that
it is current and that no module reads an `OPENRL_*` variable past this one.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Literal

import pydantic
import pydantic_settings
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(text: str | int) -> int:
    """'4096', '512MiB', '1.5 GiB' -> bytes; ValueError naming the value otherwise."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size: use bytes, or a number with KiB, MiB, GiB or TiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


Bytes = Annotated[int, pydantic.BeforeValidator(parse_bytes), Field(gt=0)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class SettingsError(ValueError):
    """An environment variable with a value it does not take; the message is one line that names it."""


class Settings(BaseSettings):
    """The environment, validated. Field names are the variables without `OPENRL_`, lower case."""

    model_config = SettingsConfigDict(case_sensitive=True, env_ignore_empty=True, extra="ignore")

    # --- the lab: control plane and clients ---------------------------------------------------------------
    lab_home: Path | None = Field(
        None,
        validation_alias="OPENRL_LAB_HOME",
        description="The lab's home folder (databases, checkpoints, logs, connection.json). "
        "Default: $XDG_DATA_HOME/openrl-lab, else ~/.local/share/openrl-lab.",
    )
    lab_url: str | None = Field(
        None,
        validation_alias="OPENRL_LAB_URL",
        description="The control plane a notebook or client connects to. Default: the one serving the home.",
    )
    lab_api_key: str | None = Field(
        None,
        validation_alias="OPENRL_LAB_API_KEY",
        repr=False,
        description="The API key clients send. Default: $TINKER_API_KEY, else the key in the home's connection.json.",
    )
    lab_job: str | None = Field(
        None,
        validation_alias="OPENRL_LAB_JOB",
        description="The job name a time-slicing client acquires slices under (shown in status). "
        "Default: <host>-<pid>.",
    )
    lab_orchestrator_config: Path | None = Field(
        None,
        validation_alias="OPENRL_LAB_ORCHESTRATOR_CONFIG",
        description="The orchestrator's groups and policies (.toml or .json). Default: groups found on the machine.",
    )
    lab_session_timeout_s: Seconds = Field(
        120.0,
        validation_alias="OPENRL_LAB_SESSION_TIMEOUT_S",
        description="Seconds without a heartbeat after which a client session ends and its runs are freed.",
    )
    lab_lost_poll_grace_s: float = Field(
        15.0,
        ge=0,
        allow_inf_nan=False,
        validation_alias="OPENRL_LAB_LOST_POLL_GRACE_S",
        description="Seconds a future whose client stopped polling is kept before its session counts as gone.",
    )
    lab_fwdbwd_chunk_len: int | None = Field(
        None,
        gt=0,
        validation_alias="OPENRL_LAB_FWDBWD_CHUNK_LEN",
        description="The most datums per forward_backward request the SDK is told to send (a smaller value "
        "splits calls; tests). Default and upper bound: what one request may carry.",
    )
    lab_pipeline_depth: Annotated[int, Field(ge=1, le=64)] = Field(
        2,
        validation_alias="OPENRL_LAB_PIPELINE_DEPTH",
        description="A model's training calls (forward_backward, forward, optim_step) out to its kernel at once: "
        "the next is sent while the previous runs, so the kernel never idles between them. 1: each waits for the "
        "previous to finish (no pipelining).",
    )
    lab_models: dict[str, str] = Field(
        {},
        validation_alias="OPENRL_LAB_MODELS",
        description="The operator's catalog of served models, as JSON: name -> a model directory, or a Hugging Face "
        'repo id found in the HF cache ("" for the name itself); `serve --model` and `--models FILE` set it for '
        "the control plane and its kernels. When it names any model, only these and the built-in models are served. "
        "Default: none (built-in models, any model directory on the server, any model in its HF cache).",
    )
    lab_tokenizer_aliases: dict[str, str] = Field(
        {},
        validation_alias="OPENRL_LAB_TOKENIZER_ALIASES",
        description="More repo ids for the /hf mirror, as JSON: repo id -> a served model's name, whose tokenizer "
        "the mirror then serves under that id too (for client tools that load a model's tokenizer from a repo of "
        "their own: tinker-cookbook asks for thinkingmachineslabinc/meta-llama-3-instruct-tokenizer for every "
        "meta-llama/Llama-3* model). `serve --tokenizer-alias REPO=MODEL` and a catalog file's [tokenizers] table "
        "set it.",
    )
    lab_tokenizer_paths: bool = Field(
        True,
        validation_alias="OPENRL_LAB_TOKENIZER_PATHS",
        description="0: get_info names a tokenizer by its repo id (served by the /hf mirror) even for a client "
        "on the server's machine, which otherwise gets the model's directory.",
    )
    lab_vllm_python: Path | None = Field(
        None,
        validation_alias="OPENRL_LAB_VLLM_PYTHON",
        description="The Python a vLLM kernel runs (vLLM's own environment, `make vllm-env`). "
        "Default: the control plane's.",
    )
    cookbook_python: Path | None = Field(
        None,
        validation_alias="OPENRL_COOKBOOK_PYTHON",
        description="The Python of tinker-cookbook's environment (`%openrl cookbook`). "
        "Default: a .venv-cookbook in the working directory or above it.",
    )
    lab_no_warmup: bool = Field(
        False,
        validation_alias="OPENRL_LAB_NO_WARMUP",
        description="1: `%load_ext openrl_lab` does not import torch and tinker in the background.",
    )
    lab_no_status_guard: bool = Field(
        False,
        validation_alias="OPENRL_LAB_NO_STATUS_GUARD",
        description="1: leave ipykernel's busy/idle reporting as it is (the guard keeps a live plot's "
        "widget messages from showing the kernel idle mid-cell).",
    )

    # --- the sandbox service (/sandbox/run_code: model-written code run in isolation) ----------------------
    sandbox_pool_size: Annotated[int, Field(ge=1, le=256)] = Field(
        4,
        validation_alias="OPENRL_SANDBOX_POOL_SIZE",
        description="Warm sandboxes kept ready (each started ahead, used once): the programs that start at once "
        "without paying a sandbox's start-up.",
    )
    sandbox_per_user: Annotated[int, Field(ge=1, le=1024)] = Field(
        4,
        validation_alias="OPENRL_SANDBOX_PER_USER",
        description="Programs one user runs at once; the others queue (so one RL group does not hold every "
        "sandbox while another user's run waits).",
    )
    sandbox_queue_per_user: Annotated[int, Field(ge=1)] = Field(
        4096,
        validation_alias="OPENRL_SANDBOX_QUEUE_PER_USER",
        description="Programs of one user that may wait; past it a request is refused (HTTP 429).",
    )
    sandbox_max_wall_s: Seconds = Field(
        300.0,
        validation_alias="OPENRL_SANDBOX_MAX_WALL_S",
        description="The longest run_timeout a request may ask for (seconds); a longer one is refused (400).",
    )
    sandbox_memory_bytes: Bytes = Field(
        512 << 20,
        validation_alias="OPENRL_SANDBOX_MEMORY_BYTES",
        description="A program's memory (address space) when its request sets none (memory_limit_MB -1).",
    )
    sandbox_lab_packages: bool = Field(
        True,
        validation_alias="OPENRL_SANDBOX_LAB_PACKAGES",
        description="Programs see the lab's own Python packages (numpy and the like, which graders import), "
        "read-only; 0: the bare interpreter and its standard library.",
    )
    sandbox_max_memory_bytes: Bytes = Field(
        4 << 30,
        validation_alias="OPENRL_SANDBOX_MAX_MEMORY_BYTES",
        description="The most memory a request may ask for (memory_limit_MB).",
    )
    sandbox_remote_url: str | None = Field(
        None,
        validation_alias="OPENRL_SANDBOX_REMOTE_URL",
        description="A sandbox server's base URL (`openrl-lab sandbox serve`, the chart's sandbox Service): the "
        "gateway forwards each program there instead of running it on its own host; per-user limits, queue and "
        "accounting stay in the gateway. Unset: programs run in the gateway's own pool.",
    )
    sandbox_remote_token_file: Path | None = Field(
        None,
        validation_alias="OPENRL_SANDBOX_REMOTE_TOKEN_FILE",
        description="A file holding the sandbox server's service token (sent as `Authorization: Bearer`); "
        "needed with OPENRL_SANDBOX_REMOTE_URL.",
    )
    sandbox_isolation: Literal["bubblewrap", "pod"] = Field(
        "bubblewrap",
        validation_alias="OPENRL_SANDBOX_ISOLATION",
        description="How each program is isolated: `bubblewrap` (namespaces, seccomp, rlimits on this host) or "
        "`pod` (inside a sandbox Pod, where the Pod is the boundary: a plain child process per program with the "
        "same rlimits and seccomp filter, in a private scratch directory). `pod` refuses to start outside a "
        "Kubernetes Pod unless OPENRL_SANDBOX_POD_FORCE=1.",
    )
    sandbox_pod_force: bool = Field(
        False,
        validation_alias="OPENRL_SANDBOX_POD_FORCE",
        description="Let `pod` isolation start outside a Kubernetes Pod (tests): it then isolates far less than "
        "bubblewrap does.",
    )
    sandbox_scratch_dir: Path | None = Field(
        None,
        validation_alias="OPENRL_SANDBOX_SCRATCH_DIR",
        description="`pod` isolation: where each program's private scratch directory is made (a tmpfs or "
        "emptyDir; the chart mounts one). Default: the system's temporary directory.",
    )

    # --- kernels -------------------------------------------------------------------------------------------
    kernel_call_timeout_s: Seconds = Field(
        1800.0,
        validation_alias="OPENRL_KERNEL_CALL_TIMEOUT_S",
        description="Seconds the control plane waits for a kernel's answer (a call may queue for its slice).",
    )
    kernel_lost_after_s: Seconds = Field(
        5.0,
        validation_alias="OPENRL_KERNEL_LOST_AFTER_S",
        description="Seconds a kernel may stay silent before the fleet counts it lost and fails its calls.",
    )
    kernel_gang_timeout_s: Seconds = Field(
        300.0,
        validation_alias="OPENRL_KERNEL_GANG_TIMEOUT_S",
        description="Seconds a rank of a run on several devices waits for its peers in a collective (the "
        "rendezvous included) before its call fails; a peer that dies fails them at once.",
    )
    kernel_max_stream_bytes: Bytes = Field(
        16 << 30,
        validation_alias="OPENRL_KERNEL_MAX_STREAM_BYTES",
        description="The largest call a kernel accepts (bytes, or with a unit: 16GiB).",
    )
    kernel_memory_bytes: Bytes | None = Field(
        None,
        validation_alias="OPENRL_KERNEL_MEMORY_BYTES",
        description="The device memory a kernel admits jobs against (bytes, or 40GiB). "
        "Default: the whole CUDA device; on CPU, the machine's memory.",
    )
    kernel_threads: Annotated[int, Field(ge=1)] | Literal["auto"] | None = Field(
        None,
        validation_alias="OPENRL_KERNEL_THREADS",
        description="torch's intra-op threads in a kernel: a number (for all its work), or auto (torch's choice). "
        "Default: one per pinned core, else $OMP_NUM_THREADS, else the cores but one, and for forward/backward "
        "passes of 512 tokens or more the cores (each at least 1, at most 2).",
    )
    kernel_sample_batch_tokens: Annotated[int, Field(ge=1)] = Field(
        65536,
        validation_alias="OPENRL_KERNEL_SAMPLE_BATCH_TOKENS",
        description="The torch sampler's batch size, in tokens (rows x (prompt + max_tokens)): concurrent sample "
        "requests join one batch up to it; a request larger than it runs alone.",
    )
    kernel_sample_mix: bool = Field(
        True,
        validation_alias="OPENRL_KERNEL_SAMPLE_MIX",
        description="Concurrent sample requests on different samplers of one base model (LoRA snapshots, the base "
        "model) whose phases run under one lease share the torch sampler's batch, each row through its own "
        "weights; 0 keeps each sampler's requests to a batch of their own.",
    )
    kernel_authkey: str | None = Field(
        None,
        validation_alias="OPENRL_KERNEL_AUTHKEY",
        repr=False,
        description="Set by the control plane for a kernel it starts: the key its calls carry.",
    )
    kernel_join_token: str | None = Field(
        None,
        validation_alias="OPENRL_KERNEL_JOIN_TOKEN",
        repr=False,
        description="`openrl-lab kernel join`: the join token (`openrl-lab tokens create --kernel`).",
    )
    orchestrator_target: str | None = Field(
        None,
        validation_alias="OPENRL_ORCHESTRATOR_TARGET",
        description="Set by the control plane for a kernel it starts: the orchestrator's host:port.",
    )
    orchestrator_key: str | None = Field(
        None,
        validation_alias="OPENRL_ORCHESTRATOR_KEY",
        repr=False,
        description="Set by the control plane for a kernel it starts: its key for the orchestrator.",
    )

    # --- the vLLM sampler (a kernel started with --sampler vllm) ---------------------------------------------
    vllm_lora: Literal["adapter", "merge"] | None = Field(
        None,
        validation_alias="OPENRL_VLLM_LORA",
        description="How LoRA snapshots are sampled: adapter (vLLM's LoRA kernels) or merge (merged into the "
        "weights). Default: adapter on CUDA, merge on CPU.",
    )
    vllm_max_lora_rank: int = Field(
        64, gt=0, validation_alias="OPENRL_VLLM_MAX_LORA_RANK", description="The largest LoRA rank vLLM serves."
    )
    vllm_max_loras: int = Field(
        4, gt=0, validation_alias="OPENRL_VLLM_MAX_LORAS", description="Adapters in one vLLM batch."
    )
    vllm_max_num_seqs: int = Field(
        1024,
        gt=0,
        validation_alias="OPENRL_VLLM_MAX_NUM_SEQS",
        description="Sequences in one vLLM batch (an RL step: prompts x group size).",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        le=1,
        validation_alias="OPENRL_VLLM_GPU_MEMORY_UTILIZATION",
        description="The share of a GPU's memory vLLM takes (it shares the device with training).",
    )
    vllm_dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32",
        validation_alias="OPENRL_VLLM_DTYPE",
        description="vLLM's dtype; float32, as the trainer computes, keeps the importance ratio at 1.",
    )


def _one_line(e: pydantic.ValidationError) -> str:
    """`NAME='value': what is wrong (what the variable is)`, per bad variable, in one line."""
    by_alias = {f.validation_alias: f for f in Settings.model_fields.values()}
    problems: dict[str, list[str]] = {}
    inputs: dict[str, object] = {}
    for err in e.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        inputs[name] = err.get("input")
        problems.setdefault(name, []).append(err["msg"].removeprefix("Value error, "))
    said = []
    for name, msgs in problems.items():
        field = by_alias.get(name)
        meaning = f" ({field.description.split('. ')[0].rstrip('.')})" if field and field.description else ""
        said.append(f"{name}={inputs[name]!r}: {', or '.join(msgs)}{meaning}")
    return "; ".join(said)


def settings() -> Settings:
    """The environment as it is now, validated (SettingsError, one line, when a variable is bad)."""
    try:
        return Settings()  # pyright: ignore[reportCallIssue] - BaseSettings fills every field from the environment
    except pydantic.ValidationError as e:
        raise SettingsError(_one_line(e)) from None
    except pydantic_settings.SettingsError as e:  # a JSON variable that is not JSON, read before validation
        field = re.search(r'field "(\w+)"', str(e))
        alias = Settings.model_fields[field.group(1)].validation_alias if field else "a variable"
        raise SettingsError(f"{alias}: not valid JSON (it takes a JSON object)") from None


def check(program: str) -> Settings:
    """At an entry point: the settings, or exit with the one line that names the bad variable."""
    try:
        return settings()
    except SettingsError as e:
        sys.exit(f"{program}: {e}")
