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
import math
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, fields, replace
from pathlib import Path

from openrl_lab.orchestrator.errors import InvalidArgument
from openrl_lab.orchestrator.policies import POLICIES
from openrl_lab.sample import SAMPLERS
from openrl_lab.settings import settings

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}")
DEFAULT_ALIASES = ("trainer-group", "sampler-group")


@dataclass(frozen=True)
class GroupSpec:
    id: str
    devices: tuple[str, ...]
    policy: str = "weighted"
    aliases: tuple[str, ...] = ()
    max_phase_s: float | None = None  # None: the config's `max_phase_s`
    sampler: str = "torch"  # the sampler backend of this group's kernels: torch | vllm
    sampler_fallback: bool = False  # vllm: a model vLLM cannot serve is sampled by torch instead of refused
    kernel_python: str | None = None  # the interpreter that runs this group's kernels (None: see the docstring)
    # vllm: base models whose engines start with the kernel; one vLLM cannot serve stops the kernel at start
    sampler_models: tuple[str, ...] = ()


@dataclass(frozen=True)
class OrchestratorConfig:
    groups: tuple[GroupSpec, ...] = ()
    # A slice whose holder has not heartbeaten it for this long is revoked (the holder died or hung).
    holder_timeout_s: float = 10.0
    # A phase that has held its group this long while another job waits is revoked, heartbeats or not:
    # the waiter gets the group at once (0: no limit). Groups may set their own (`GroupSpec.max_phase_s`).
    max_phase_s: float = 300.0
    # Waiting for a live job to report its eviction gives up after this long (the switch proceeds).
    evict_timeout_s: float = 120.0
    # Weighted policy: when the job that just released is ahead of every waiter and usually comes back
    # within this long, the group is held for it this long instead of switching jobs.
    reacquire_grace_s: float = 0.05
    default_ttl_s: float = 3600.0
    max_ttl_s: float = 30 * 86400.0
    max_weight: float = 1000.0
    max_quota_s: float = 10 * 365 * 86400.0
    max_leases_per_user: int = 256
    # Slices kept in memory per group for status, duty cycle and streaming (all are kept in SQLite;
    # `timeline` reads older ones from there, duty cycles cover the slices kept here).
    timeline_kept: int = 2000

    def __post_init__(self):
        for f in fields(self):
            if f.name in ("groups", "max_leases_per_user", "timeline_kept"):
                continue
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidArgument(f"orchestrator config: {f.name} must be a finite number >= 0, got {v!r}")
        if self.holder_timeout_s <= 0:
            raise InvalidArgument("orchestrator config: holder_timeout_s must be > 0")
        if int(self.max_leases_per_user) < 1 or int(self.timeline_kept) < 1:
            raise InvalidArgument("orchestrator config: max_leases_per_user and timeline_kept must be >= 1")
        check_groups(self.groups)

    @property
    def heartbeat_interval_s(self) -> float:
        return self.holder_timeout_s / 4

    def max_phase_for(self, group: GroupSpec) -> float:
        return self.max_phase_s if group.max_phase_s is None else group.max_phase_s


GROUP_KEYS = {f.name for f in fields(GroupSpec)}


def check_groups(groups: tuple[GroupSpec, ...]) -> None:
    if not groups:
        raise InvalidArgument("orchestrator config: no groups")
    names: dict[str, str] = {}
    devices: dict[str, str] = {}
    for g in groups:
        if g.policy not in POLICIES:
            raise InvalidArgument(f"group {g.id!r}: unknown policy {g.policy!r} (one of {', '.join(POLICIES)})")
        if not g.devices:
            raise InvalidArgument(f"group {g.id!r}: no devices")
        m = g.max_phase_s
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m < 0):
            raise InvalidArgument(f"group {g.id!r}: max_phase_s must be a finite number >= 0 (0: no limit), got {m!r}")
        if g.sampler not in SAMPLERS:
            raise InvalidArgument(f"group {g.id!r}: unknown sampler {g.sampler!r} (one of {', '.join(SAMPLERS)})")
        if not isinstance(g.sampler_fallback, bool):
            raise InvalidArgument(f"group {g.id!r}: sampler_fallback must be true or false, got {g.sampler_fallback!r}")
        if g.sampler_models and g.sampler != "vllm":
            raise InvalidArgument(f'group {g.id!r}: sampler_models goes with sampler = "vllm"')
        if g.sampler_fallback and g.sampler != "vllm":
            raise InvalidArgument(f'group {g.id!r}: sampler_fallback goes with sampler = "vllm"')
        if g.kernel_python is not None and (not isinstance(g.kernel_python, str) or not g.kernel_python):
            raise InvalidArgument(
                f"group {g.id!r}: kernel_python must be an interpreter's path, got {g.kernel_python!r}"
            )
        for n in (g.id, *g.aliases):
            if not NAME.fullmatch(n):
                raise InvalidArgument(f"group name {n!r} is not allowed: letters, digits and ._:@/+- (max 128)")
            if n in names:
                raise InvalidArgument(f"group name {n!r} is used twice (by {names[n]!r} and {g.id!r})")
            names[n] = g.id
        for d in g.devices:
            if d in devices:
                raise InvalidArgument(
                    f"device {d!r} is in two groups ({devices[d]!r} and {g.id!r}): groups must not "
                    "overlap, a phase holds its whole group"
                )
            devices[d] = g.id


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


def _as_list(value) -> list:
    return [value] if isinstance(value, str) else list(value)


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
    known = {f.name for f in fields(OrchestratorConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidArgument(f"orchestrator config: unknown keys {unknown} (known: {sorted(known)})")
    groups = data.pop("groups", None)
    if groups:
        specs = []
        for g in groups:
            if isinstance(g, GroupSpec):
                specs.append(g)
                continue
            extra = sorted(set(g) - GROUP_KEYS)
            if extra or "id" not in g:
                raise InvalidArgument(
                    f"orchestrator config: a group needs `id` and `devices` (and may have "
                    f"{', '.join(f'`{k}`' for k in sorted(GROUP_KEYS - {'id', 'devices'}))}); "
                    f"got keys {sorted(g)}"
                )
            devs = g.get("devices") or []
            specs.append(
                GroupSpec(
                    id=str(g["id"]),
                    devices=tuple(map(str, _as_list(devs))),
                    policy=str(g.get("policy", "weighted")),
                    aliases=tuple(map(str, g.get("aliases", ()))),
                    max_phase_s=g.get("max_phase_s"),
                    sampler=g.get("sampler", "torch"),
                    sampler_fallback=g.get("sampler_fallback", False),
                    kernel_python=g.get("kernel_python"),
                    sampler_models=tuple(map(str, _as_list(g.get("sampler_models", ())))),
                )
            )
        data["groups"] = tuple(specs)
    else:
        data["groups"] = discover_groups()
    return OrchestratorConfig(**data)
