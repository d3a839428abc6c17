"""Which groups exist and how the orchestrator behaves: from a config file, or from this machine's devices.

A config file (TOML or JSON) names the groups; every other key is an `OrchestratorConfig` field:

    holder_timeout_s = 10
    [[groups]]
    id = "trainer-group"
    devices = ["cuda:0", "cuda:1"]
    policy = "weighted"          # weighted (default) | lrs | fifo
    max_phase_s = 600            # this group's own limit (default: the top-level max_phase_s)
    [[groups]]
    id = "sampler-group"
    devices = ["cuda:2"]
    sampler = "vllm"             # torch (default) | vllm: this group's kernel samples with vLLM
    sampler_fallback = true      # models vLLM cannot serve are sampled by torch instead of refused
    sampler_models = ["openrl-lab/tiny-llama-1m"]  # engines started with the kernel (else at first use)
    kernel_python = "/opt/openrl/.venv-vllm/bin/python"  # the interpreter of its kernel (e.g. `make vllm-env`'s)

Without one, `discover_groups()` makes one group per accelerator found (CUDA devices seen by the driver and
allowed by CUDA_VISIBLE_DEVICES; on a machine without GPUs, `cpu` counts as one): see `fleet_groups`. On a
single device that is `default`, with the aliases `trainer-group` and `sampler-group` (training and sampling
phases are time-sliced on it). Discovery never imports torch (it asks `nvidia-smi`, then /proc).

`sampler`, `sampler_fallback` and `kernel_python` are for the launchers that start the group's kernels (the
orchestrator ignores them). A vllm group without `kernel_python` runs $OPENRL_LAB_VLLM_PYTHON, else the control
plane's own interpreter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    ValidationError,
    model_validator,
)
from pydantic.dataclasses import dataclass

from openrl_lab.orchestrator.errors import InvalidArgument
from openrl_lab.orchestrator.policies import POLICIES
from openrl_lab.sample import SAMPLERS
from openrl_lab.settings import settings
from openrl_lab.validation import one_line

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}")
DEFAULT_ALIASES = ("trainer-group", "sampler-group")


def group_name(v: str) -> str:
    if not NAME.fullmatch(v):
        raise ValueError(f"group name {v!r} is not allowed: letters, digits and ._:@/+- (max 128)")
    return v


def _one_of(what: str, allowed: tuple[str, ...]):
    def check(v: str) -> str:
        if v not in allowed:
            raise ValueError(f"unknown {what} {v!r} (one of {', '.join(allowed)})")
        return v

    return AfterValidator(check)


# The types a group's fields have wherever groups are configured (here, and launcher.json: cluster/kubernetes.py).
GroupName = Annotated[str, AfterValidator(group_name)]
Policy = Annotated[str, _one_of("policy", tuple(POLICIES))]
Sampler = Annotated[str, _one_of("sampler", SAMPLERS)]
Seconds = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]  # strict: true is not 1 second
_names = BeforeValidator(lambda v: (v,) if isinstance(v, str) else v)  # a bare name is a list of one
_STRICT = ConfigDict(extra="forbid")  # a misspelt key would otherwise be ignored silently


@dataclass(frozen=True, config=_STRICT)
class GroupSpec:
    id: GroupName
    devices: Annotated[tuple[str, ...], _names, Field(min_length=1)]
    policy: Policy = "weighted"
    aliases: Annotated[tuple[GroupName, ...], _names] = ()
    max_phase_s: Seconds | None = None  # None: the config's `max_phase_s`
    sampler: Sampler = "torch"  # the sampler backend of this group's kernels: torch | vllm
    sampler_fallback: StrictBool = False  # vllm: a model vLLM cannot serve is sampled by torch instead of refused
    # the interpreter that runs this group's kernels (None: see the docstring)
    kernel_python: Annotated[str, Field(min_length=1)] | None = None
    # vllm: base models whose engines start with the kernel; one vLLM cannot serve stops the kernel at start
    sampler_models: Annotated[tuple[str, ...], _names] = ()

    @model_validator(mode="after")
    def _vllm_only(self) -> GroupSpec:
        for key in ("sampler_models", "sampler_fallback"):
            if getattr(self, key) and self.sampler != "vllm":
                raise ValueError(f'{key} goes with sampler = "vllm"')
        return self


@dataclass(frozen=True, config=_STRICT)
class OrchestratorConfig:
    groups: tuple[GroupSpec, ...] = ()
    # A slice whose holder has not heartbeaten it for this long is revoked (the holder died or hung).
    holder_timeout_s: Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)] = 10.0
    # A phase that has held its group this long while another job waits is revoked, heartbeats or not:
    # the waiter gets the group at once (0: no limit). Groups may set their own (`GroupSpec.max_phase_s`).
    max_phase_s: Seconds = 300.0
    # Waiting for a live job to report its eviction gives up after this long (the switch proceeds).
    evict_timeout_s: Seconds = 120.0
    # Weighted policy: when the job that just released is ahead of every waiter and usually comes back
    # within this long, the group is held for it this long instead of switching jobs.
    reacquire_grace_s: Seconds = 0.05
    # Interactive priority: at a phase boundary a waiting `interactive` lease's phase goes before waiting
    # `batch` phases, while the phases that went first this way used less than `interactive_share` of the
    # group's time over the last `interactive_window_s`; past it they queue as batch (by the policy), so
    # batch work is never starved. 0: no priority; 1: no cap.
    interactive_share: Annotated[float, Strict(), Field(ge=0, le=1, allow_inf_nan=False)] = 0.5
    interactive_window_s: Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)] = 60.0
    # A gang phase (one slice of each of N groups, granted all at once) whose N ranks have not all asked this
    # long after the first did fails: the ranks that asked get FailedPrecondition naming the gang.
    gang_assemble_s: Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)] = 60.0
    # Backfill (conservative, as in EASY backfilling): a group reserved for a gang that still waits for a
    # running phase on another of its groups may grant a waiting single-device phase out of order, when that
    # phase is expected to end before the gang could start anyway (the scheduler's docstring, "Gangs").
    gang_backfill: Annotated[bool, Strict()] = True
    default_ttl_s: Seconds = 3600.0
    max_ttl_s: Seconds = 30 * 86400.0
    max_weight: Seconds = 1000.0
    max_quota_s: Seconds = 10 * 365 * 86400.0
    max_leases_per_user: Annotated[int, Field(ge=1)] = 256
    # Slices kept in memory per group for status, duty cycle and streaming (all are kept in SQLite;
    # `timeline` reads older ones from there, duty cycles cover the slices kept here).
    timeline_kept: Annotated[int, Field(ge=1)] = 2000

    @model_validator(mode="after")
    def _groups(self) -> OrchestratorConfig:
        check_groups(self.groups)
        return self

    @property
    def heartbeat_interval_s(self) -> float:
        return self.holder_timeout_s / 4

    def max_phase_for(self, group: GroupSpec) -> float:
        return self.max_phase_s if group.max_phase_s is None else group.max_phase_s


def check_groups(groups: tuple[GroupSpec, ...]) -> None:
    """What holds between groups (each one checks itself): some exist, no name twice, no device in two."""
    if not groups:
        raise ValueError("no groups")
    names: dict[str, str] = {}
    devices: dict[str, str] = {}
    for g in groups:
        for n in (g.id, *g.aliases):
            if n in names:
                raise ValueError(f"group name {n!r} is used twice (by {names[n]!r} and {g.id!r})")
            names[n] = g.id
        for d in g.devices:
            if d in devices:
                raise ValueError(
                    f"device {d!r} is in two groups ({devices[d]!r} and {g.id!r}): groups must not "
                    "overlap, a phase holds its whole group"
                )
            devices[d] = g.id


def group_spec(**fields: Any) -> GroupSpec:
    """A group, checked (InvalidArgument names what is wrong)."""
    try:
        return GroupSpec(**fields)
    except ValidationError as e:
        raise InvalidArgument(f"group {fields.get('id')!r}: {one_line(e, GroupSpec)}") from None


def discover_devices() -> list[str]:
    """CUDA devices this process may use (`cuda:N`, numbered as CUDA numbers them), else ["cpu"]."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "NoDevFiles"):
        return ["cpu"]
    count = _count_gpus()
    if visible is not None:
        count = min(count, len([v for v in visible.split(",") if v.strip()]))
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]


def _count_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=index", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            if out.returncode == 0:
                return len([line for line in out.stdout.splitlines() if line.strip()])
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def fleet_groups(devices: list[str]) -> tuple[GroupSpec, ...]:
    """One group per device, one kernel each: on one device the group `default` (training and sampling are
    time-sliced on it); on several, `gpu0`, `gpu1`... (`cpu0`... for CPU kernels), with `trainer-group` the
    first and `sampler-group` the last, so samplers get their own device."""
    if len(devices) <= 1:
        return (GroupSpec(id="default", devices=tuple(devices or ["cpu"]), aliases=DEFAULT_ALIASES),)

    def name(d: str) -> str:
        kind, _, index = d.partition(":")
        return ("gpu" if kind == "cuda" else kind) + index

    last = len(devices) - 1
    return tuple(
        GroupSpec(
            id=name(d),
            devices=(d,),
            aliases=(("trainer-group",) if i == 0 else ()) + (("sampler-group",) if i == last else ()),
        )
        for i, d in enumerate(devices)
    )


def with_sampler(
    groups: tuple[GroupSpec, ...], sampler: str, fallback: bool = False, name: str = "sampler-group"
) -> tuple[GroupSpec, ...]:
    """`groups` with the sampler of the one that answers to `name` (where samplers go) set to `sampler`."""
    if sampler not in SAMPLERS:
        raise InvalidArgument(f"unknown sampler {sampler!r} (one of {', '.join(SAMPLERS)})")
    if not any(name in (g.id, *g.aliases) for g in groups):
        raise InvalidArgument(
            f"no group is named {name!r} (groups: {', '.join(g.id for g in groups) or 'none'}): "
            "set `sampler` on the groups in the config file instead"
        )
    return tuple(
        replace(g, sampler=sampler, sampler_fallback=fallback) if name in (g.id, *g.aliases) else g for g in groups
    )


def discover_groups() -> tuple[GroupSpec, ...]:
    return fleet_groups(discover_devices())


def load_config(source: str | os.PathLike | dict | OrchestratorConfig | None = None) -> OrchestratorConfig:
    """A config from a file path (.toml or .json), a dict, or None: $OPENRL_LAB_ORCHESTRATOR_CONFIG, else
    discovered groups with default settings."""
    if isinstance(source, OrchestratorConfig):
        return source
    if source is None:
        source = settings().lab_orchestrator_config or {}
    if not isinstance(source, dict):
        path = Path(source)
        try:
            text = path.read_text()
        except OSError as e:
            raise InvalidArgument(f"orchestrator config {path}: {e.strerror or e}") from None
        try:
            if path.suffix == ".json":
                source = json.loads(text)
            else:
                import tomllib

                source = tomllib.loads(text)
        except ValueError as e:
            raise InvalidArgument(f"orchestrator config {path}: {e}") from None
        if not isinstance(source, dict):
            raise InvalidArgument(
                f"orchestrator config {path}: the top level must be a table, not {type(source).__name__}"
            )
    data = dict(source)
    if not data.get("groups"):
        data["groups"] = discover_groups()
    try:
        return OrchestratorConfig(**data)
    except ValidationError as e:
        raise InvalidArgument(
            f"orchestrator config: {one_line(e, OrchestratorConfig, partial(_where, data))}"
        ) from None


def _where(data: dict, loc: tuple) -> str:
    """A problem's place in the config: a group by its id (else its number), a setting by its key; "" for the
    whole config (what holds between groups)."""
    if loc[:1] == ("groups",) and len(loc) > 1 and isinstance(loc[1], int):
        g = data["groups"][loc[1]]
        name = f"group {g['id']!r}" if isinstance(g, dict) and isinstance(g.get("id"), str) else f"group {loc[1] + 1}"
        return ".".join([name, *map(str, loc[2:])])
    return ".".join(map(str, loc))
