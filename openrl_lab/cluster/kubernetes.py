"""Kernels as Pods: the control plane keeps `kernels` kernel Pods per group existing on Kubernetes (torch-free).

`serve --kernel-launcher kubernetes --launcher-config launcher.json` runs no kernel of its own. For each group of
launcher.json this launcher keeps Pods named `<prefix>-kernel-<group>-<i>` (i < `kernels`): it creates the missing
ones, watches them, deletes and recreates a Pod that Failed, Succeeded or disappeared (a slot whose Pods keep
dying waits longer each time, up to BACKOFF_MAX_S), and deletes them all when the control plane stops. The
kernel inside joins the control plane by itself (`openrl-lab kernel join`, `cluster/join.py`) under the Pod's
name, with the join token and TLS certificate mounted from Secrets; the fleet declares a dead one lost (its jobs
answer naming their last checkpoint) and the replacement joins again under the same name. A group with
`devices` N > 1 claims N GPUs per Pod, whose container runs `kernel join --devices N`: a kernel per device,
`<pod>-<i>` in group `<id>-<i>` (i > 0), on port KERNEL_PORT + i; the N go (and are declared lost) together.

Pods left by an earlier control plane (one that crashed before deleting them) are adopted when they carry the
spec this configuration makes (the `openrl.dev/spec-hash` annotation): their kernels notice that nobody calls
them and rejoin the new control plane by themselves (`kernel/join.py`'s REJOIN_AFTER_S), so no GPU is given back and no
image pulled again. Pods of ours with another spec (a new image, new resources) or a name no group has any more
are deleted (and recreated where a slot needs one). "Ours": in the namespace, carrying `openrl.dev/group` and
podLabels' `app.kubernetes.io/name`/`instance`, named `<prefix>-kernel-...`.

The launcher calls only what `cluster/rbac.py` RULES grant (pods: create, delete, get, list, watch), with the
official `kubernetes` client: in-cluster configuration in a Pod, a kubeconfig ($KUBECONFIG, ~/.kube/config)
elsewhere, or an explicit `kubernetes.client.Configuration` (tests).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from openrl_lab.orchestrator.config import DEFAULT_ALIASES, GroupName, GroupSpec, Sampler
from openrl_lab.settings import settings
from openrl_lab.validation import one_line

if TYPE_CHECKING:  # the client is imported where it is used (an optional extra)
    from kubernetes.client import V1ObjectMeta, V1Pod

log = logging.getLogger("openrl_lab.kubernetes")

GROUP_LABEL = "openrl.dev/group"
SPEC_ANNOTATION = "openrl.dev/spec-hash"
OWNER_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance")  # with GROUP_LABEL: the list/watch selector
CONTAINER = "kernel"
KERNEL_PORT = 7070
CLAIM = "gpu"  # the Pod's name for its ResourceClaim
TOKEN_DIR, TLS_DIR = "/var/run/openrl/join", "/var/run/openrl/tls"
# The emptyDir is mounted at KERNEL_VOLUME, root-owned 0777 by the kubelet: the kernel's home is a directory it
# makes inside, so that it owns it and can make it private (0700) as a non-root user.
KERNEL_VOLUME, CHECKPOINTS = "/var/lib/openrl", "/data/checkpoints"
KERNEL_HOME = f"{KERNEL_VOLUME}/home"

RESYNC_S = 30.0  # a full list this often, whatever the watch says (it may have missed events)
WATCH_S = 300  # the server ends a watch after this long; it is opened again
BACKOFF_BASE_S = 2.0
BACKOFF_MAX_S = 300.0
STABLE_S = 120.0  # a Pod that ran this long before it failed does not count towards its slot's backoff

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
QUANTITY = re.compile(r"[+]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?")
DEVICE = re.compile(r"cpu|cuda(:\d{1,3})?")


class LauncherConfigError(ValueError):
    """launcher.json is unreadable or says something the launcher cannot do; the message says what and where."""


# --- launcher.json ------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    # Unknown keys are refused: a misspelt key would otherwise be ignored silently.
    model_config = ConfigDict(extra="forbid", populate_by_name=False, frozen=True)


class Claim(_Strict):
    """Each Pod its own claim from a ResourceClaimTemplate (`template`), or all Pods of the group one shared
    ResourceClaim (`shared`: several kernels time-slice one device)."""

    template: str | None = None
    shared: str | None = None

    @model_validator(mode="after")
    def _one(self) -> Claim:
        if (self.template is None) == (self.shared is None):
            raise ValueError(
                'a claim names exactly one of "template" (a ResourceClaimTemplate: a device per Pod) '
                'or "shared" (a ResourceClaim the group\'s Pods share)'
            )
        _dns(self.template or self.shared, "claim")
        return self


class Group(_Strict):
    id: str
    device: str = "cpu"
    kernels: int = Field(1, ge=0, le=64)
    # devices per kernel Pod: the Pod runs `kernel join --devices N`, a kernel per device (see LauncherConfig.kernels)
    devices: int = Field(1, ge=1, le=64)
    claim: Claim | None = None
    aliases: tuple[GroupName, ...] = ()  # optional: names the orchestrator also knows the group by
    # the kernels' sampler backend (`kernel join --sampler`); vllm needs an image with vLLM in it
    sampler: Sampler = "torch"
    samplerFallback: bool = False  # noqa: N815 - with vllm: models vLLM cannot serve are sampled by torch

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        # It is part of Pod names and a label value: a DNS label, not the orchestrator's wider NAME.
        if not DNS_LABEL.fullmatch(v) or len(v) > 40:
            raise ValueError(
                f"group id {v!r} must be 1-40 lowercase letters, digits and '-' (it is part of the kernel Pods' names)"
            )
        return v

    @model_validator(mode="after")
    def _device(self) -> Group:
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device {self.device!r} is not cpu, cuda or cuda:N")
        if self.claim is None and self.device != "cpu":
            raise ValueError(f"device {self.device!r} needs a claim (a group without one runs on CPU: device cpu)")
        if self.claim is not None and self.device == "cpu":
            raise ValueError("a group with a claim runs on its GPU: device cuda or cuda:N, not cpu")
        if self.samplerFallback and self.sampler != "vllm":
            raise ValueError("samplerFallback goes with sampler vllm")
        if self.devices > 1 and self.claim is None:
            raise ValueError(
                f"group {self.id!r} asks for {self.devices} devices per kernel Pod but claims no GPU (a CPU kernel "
                "has one device: a CPU run on several devices takes several groups)"
            )
        return self

    def device_of(self, index: int) -> str:
        """The device of kernel `index` of one of this group's Pods (`kernel join --devices N` counts on from
        `device`: cuda:0, cuda:1...; one device: `device` itself)."""
        if self.devices == 1:
            return self.device
        kind, _, first = self.device.partition(":")
        return f"{kind}:{int(first or 0) + index}"

    def group_ids(self) -> list[str]:
        """The orchestrator groups of this group's kernels: its id for each Pod's first kernel, `<id>-<i>` for
        kernel i of a multi-device Pod (each rank of a gang needs a group of its own; `kernel join --devices`)."""
        return [self.id if i == 0 else f"{self.id}-{i}" for i in range(self.devices)]


class Resources(_Strict):
    requests: dict[str, str | int] = {}
    limits: dict[str, str | int] = {}

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, v: dict[str, str | int]) -> dict[str, str]:
        out = {}
        for k, q in v.items():
            if not LABEL_KEY.fullmatch(k) or not QUANTITY.fullmatch(str(q)):
                raise ValueError(f'{k}: {q!r} is not a resource name and quantity (e.g. cpu: "2", memory: "16Gi")')
            out[k] = str(q)
        return out


class Toleration(_Strict):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = None  # noqa: N815 - the Kubernetes field's name


class LauncherConfig(_Strict):
    namespace: str
    image: str = Field(min_length=1)
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"  # noqa: N815 - launcher.json keys
    controlPlane: str  # noqa: N815
    joinTokenSecret: str  # noqa: N815
    tlsSecret: str  # noqa: N815
    checkpointClaim: str  # noqa: N815
    namePrefix: str | None = None  # noqa: N815 - default: podLabels' app.kubernetes.io/instance, else openrl-lab
    podLabels: dict[str, str] = {}  # noqa: N815
    nodeSelector: dict[str, str] = {}  # noqa: N815
    tolerations: tuple[Toleration, ...] = ()
    resources: Resources = Resources()
    groups: tuple[Group, ...]

    @field_validator("groups")
    @classmethod
    def _some(cls, v: tuple[Group, ...]) -> tuple[Group, ...]:
        if not v:
            raise ValueError("no groups: name at least one (id, device, kernels, claim)")
        return v

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if not DNS_LABEL.fullmatch(v) or len(v) > 63:
            raise ValueError(f"namespace {v!r} is not a Kubernetes namespace name")
        return v

    @field_validator("joinTokenSecret", "tlsSecret", "checkpointClaim")
    @classmethod
    def _names(cls, v: str) -> str:
        return _dns(v, "name")

    @field_validator("controlPlane")
    @classmethod
    def _control_plane(cls, v: str) -> str:
        from openrl_lab.sockets import parse_address

        parse_address(v, "address")  # ValueError: "address '...' is not HOST:PORT"
        return v

    @field_validator("podLabels", "nodeSelector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not LABEL_KEY.fullmatch(k) or len(k) > 317 or not LABEL_VALUE.fullmatch(val):
                raise ValueError(
                    f"{k}: {val!r} is not a Kubernetes label (key [prefix/]name, value up to 63 "
                    "letters, digits and -_.)"
                )
        if GROUP_LABEL in v:
            raise ValueError(f"{GROUP_LABEL} is set by the launcher (each Pod's group)")
        return v

    @model_validator(mode="after")
    def _whole(self) -> LauncherConfig:
        ids = [g.id for g in self.groups]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"group ids must be unique; used twice: {', '.join(dup)}")
        made = [(gid, g.id) for g in self.groups for gid in g.group_ids()[1:]]
        for gid, by in made:
            if gid in ids or [m for m, _ in made].count(gid) > 1:
                raise ValueError(
                    f"group {by!r} runs a kernel per device in groups {by}-1, {by}-2...: "
                    f"{gid} is a group id already; rename one of them"
                )
        prefix = self.prefix
        if not DNS_LABEL.fullmatch(prefix):
            raise ValueError(
                f"the Pods' name prefix {prefix!r} (namePrefix, else the app.kubernetes.io/instance "
                "label) must be lowercase letters, digits and '-'"
            )
        for g in self.groups:
            longest = f"{prefix}-kernel-{g.id}-{max(g.kernels - 1, 0)}"
            if len(longest) > 63:
                raise ValueError(
                    f"Pod name {longest!r} is longer than 63 characters: shorten namePrefix or the group id"
                )
        return self

    # --- what the configuration makes -----------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return self.namePrefix or self.podLabels.get("app.kubernetes.io/instance") or "openrl-lab"

    def pod_names(self, group: Group) -> list[str]:
        return [f"{self.prefix}-kernel-{group.id}-{i}" for i in range(group.kernels)]

    def kernel_names(self, group: Group, pod: str) -> list[str]:
        """The names the kernels of Pod `pod` join under: the Pod's, or `<pod>-<i>` for each device of a
        multi-device Pod (`kernel join --devices N --name <pod>`)."""
        return [pod] if group.devices == 1 else [f"{pod}-{i}" for i in range(group.devices)]

    def selector(self) -> str:
        """The label selector of this launcher's Pods (a Role cannot narrow `list`/`watch` by name)."""
        return ",".join([GROUP_LABEL] + [f"{k}={self.podLabels[k]}" for k in OWNER_LABELS if k in self.podLabels])

    def is_ours(self, name: str, labels: dict[str, str] | None) -> bool:
        labels = labels or {}
        return (
            name.startswith(f"{self.prefix}-kernel-")
            and GROUP_LABEL in labels
            and all(labels.get(k) == self.podLabels[k] for k in OWNER_LABELS if k in self.podLabels)
        )

    def group_specs(self) -> tuple[GroupSpec, ...]:
        """The orchestrator's groups: one per launcher group, its "devices" the Pods' names (unique across
        groups even when the Pods share a GPU). Without aliases in launcher.json the first group is also
        `trainer-group` and the last `sampler-group`, as for local kernels (`orchestrator.config.fleet_groups`)."""
        explicit = any(g.aliases for g in self.groups)
        last = len(self.groups) - 1
        specs = []
        for i, g in enumerate(self.groups):
            if explicit:
                aliases = g.aliases
            elif last == 0:
                aliases = DEFAULT_ALIASES
            else:
                aliases = (("trainer-group",) if i == 0 else ()) + (("sampler-group",) if i == last else ())
            pods = self.pod_names(g) or [f"{self.prefix}-kernel-{g.id}"]
            # a multi-device Pod's kernel i joins group <id>-<i> (kernel join --devices): one group per device
            for d, gid in enumerate(g.group_ids()):
                specs.append(
                    GroupSpec(
                        id=gid,
                        devices=tuple(f"{p}/{g.device_of(d)}" for p in pods),
                        aliases=aliases if d == 0 else (),
                        sampler=g.sampler,
                        sampler_fallback=g.samplerFallback,
                    )
                )
        return tuple(specs)

    def pod_manifest(self, group: Group, index: int) -> dict[str, Any]:
        """The kernel Pod of slot `index` of `group` (docs/architecture.md, "Kernels as Pods")."""
        name = f"{self.prefix}-kernel-{group.id}-{index}"
        command = [
            "openrl-lab",
            "kernel",
            "join",
            "--control-plane",
            self.controlPlane,
            "--token-file",
            f"{TOKEN_DIR}/token",
            "--device",
            group.device,
            "--group",
            group.id,
            "--name",
            name,
            "--listen",
            f"0.0.0.0:{KERNEL_PORT}",
            "--advertise",
            "$(POD_IP)",
            "--tls-cert",
            f"{TLS_DIR}/tls.crt",
            "--tls-key",
            f"{TLS_DIR}/tls.key",
            "--ca",
            f"{TLS_DIR}/ca.crt",
            "--home",
            KERNEL_HOME,
        ]
        # only when not the default: torch groups' Pods keep their spec hash (and are adopted, not replaced)
        if group.sampler != "torch":
            command += ["--sampler", group.sampler]
        if group.samplerFallback:
            command += ["--sampler-fallback"]
        ports = [{"name": "kernel", "containerPort": KERNEL_PORT, "protocol": "TCP"}]
        if group.devices > 1:  # a kernel per device, kernel i on port KERNEL_PORT + i (one device: as before)
            command += ["--devices", str(group.devices)]
            ports += [
                {"name": f"kernel-{i}", "containerPort": KERNEL_PORT + i, "protocol": "TCP"}
                for i in range(1, group.devices)
            ]
        resources: dict[str, Any] = {
            k: dict(v) for k, v in (("requests", self.resources.requests), ("limits", self.resources.limits)) if v
        }
        env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        catalog = settings().lab_models
        if catalog:  # the served models by name (their paths as the Pods see them); none: the spec hash stays
            env.append({"name": "OPENRL_LAB_MODELS", "value": json.dumps(catalog)})
        spec: dict[str, Any] = {
            "restartPolicy": "Never",  # the launcher replaces a failed Pod (and tells the fleet at once)
            "automountServiceAccountToken": False,  # kernels make no API call
            "containers": [
                {
                    "name": CONTAINER,
                    "image": self.image,
                    "imagePullPolicy": self.imagePullPolicy,
                    "command": command,
                    "env": env,
                    "ports": ports,
                    "volumeMounts": [
                        {"name": "join-token", "mountPath": TOKEN_DIR, "readOnly": True},
                        {"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
                        {"name": "checkpoints", "mountPath": CHECKPOINTS},
                        {"name": "home", "mountPath": KERNEL_VOLUME},
                    ],
                    "securityContext": {"allowPrivilegeEscalation": False},
                }
            ],
            "volumes": [
                {
                    "name": "join-token",
                    "secret": {"secretName": self.joinTokenSecret, "items": [{"key": "token", "path": "token"}]},
                },
                {
                    "name": "tls",
                    "secret": {
                        "secretName": self.tlsSecret,
                        "items": [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")],
                    },
                },
                {"name": "checkpoints", "persistentVolumeClaim": {"claimName": self.checkpointClaim}},
                {"name": "home", "emptyDir": {}},
            ],
        }
        if group.claim is not None:
            ref = (
                {"resourceClaimTemplateName": group.claim.template}
                if group.claim.template
                else {"resourceClaimName": group.claim.shared}
            )
            spec["resourceClaims"] = [{"name": CLAIM, **ref}]
            resources["claims"] = [{"name": CLAIM}]
        if resources:
            spec["containers"][0]["resources"] = resources
        if self.nodeSelector:
            spec["nodeSelector"] = dict(self.nodeSelector)
        if self.tolerations:
            spec["tolerations"] = [t.model_dump(exclude_none=True) for t in self.tolerations]
        labels = {**self.podLabels, GROUP_LABEL: group.id}
        digest = hashlib.sha256(json.dumps({"labels": labels, "spec": spec}, sort_keys=True).encode()).hexdigest()
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": labels,
                "annotations": {SPEC_ANNOTATION: digest[:32]},
            },
            "spec": spec,
        }


def _dns(v: str, what: str) -> str:
    if not DNS_SUBDOMAIN.fullmatch(v) or len(v) > 253:
        raise ValueError(f"{what} {v!r} is not a Kubernetes object name (lowercase letters, digits, '-' and '.')")
    return v


def load_launcher_config(source: str | os.PathLike | dict) -> LauncherConfig:
    """launcher.json (a path, or its parsed content); LauncherConfigError with one readable line otherwise."""
    where = "launcher config"
    if not isinstance(source, dict):
        where = f"launcher config {source}"
        try:
            source = json.loads(Path(source).read_text())
        except OSError as e:
            raise LauncherConfigError(f"{where}: {e.strerror or e}") from None
        except ValueError as e:
            raise LauncherConfigError(f"{where}: not JSON: {e}") from None
        if not isinstance(source, dict):
            raise LauncherConfigError(f"{where}: must be a JSON object")
    try:
        return LauncherConfig.model_validate(source)
    except ValidationError as e:
        raise LauncherConfigError(f"{where}: {one_line(e, LauncherConfig)}") from None


# --- the launcher -------------------------------------------------------------------------------------------
def client_configuration(context: str | None = None):
    """The Kubernetes client's configuration: $KUBECONFIG when set, else in-cluster (a Pod's service account),
    else ~/.kube/config."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if not os.environ.get("KUBECONFIG") and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        # read $KUBECONFIG now: the client's default is fixed when it is imported
        config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None, context=context, client_configuration=cfg
        )
    return cfg


@dataclass
class _Slot:
    name: str
    group: Group
    index: int
    failures: int = 0
    not_before: float = 0.0  # monotonic: no Pod is created for this slot before then (backoff)
    uid: str | None = None  # the Pod of ours last seen in this slot
    phase: str | None = None
    ip: str | None = None
    running_since: float | None = None
    going: bool = False  # we deleted its Pod: its disappearance is no failure
    last: str = ""  # what happened last, for status()
    last_failure: str = ""


class LauncherError(RuntimeError):
    """The launcher cannot work (e.g. the control plane's service account may not list Pods)."""


class KubernetesLauncher:
    """Keeps the kernel Pods of `config` existing until `stop()`. `on_kernel_gone(kernel name, why, pod IP)` is
    called for each kernel of a Pod that failed or disappeared, so the fleet need not wait out their silence."""

    def __init__(
        self,
        config: LauncherConfig,
        configuration=None,
        on_kernel_gone: Callable[[str, str, str | None], None] | None = None,
        resync_s: float = RESYNC_S,
        watch_s: int = WATCH_S,
        backoff_base_s: float = BACKOFF_BASE_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        stable_s: float = STABLE_S,
    ):
        try:
            from kubernetes import client
        except ImportError:
            raise LauncherError(
                "the kubernetes launcher needs the `kubernetes` package: pip install 'openrl-lab[kubernetes]'"
            ) from None
        self.config = config
        self.configuration = configuration if configuration is not None else client_configuration()
        self.core = client.CoreV1Api(client.ApiClient(self.configuration))
        self.on_kernel_gone = on_kernel_gone
        self.resync_s, self.watch_s = resync_s, watch_s
        self.backoff_base_s, self.backoff_max_s, self.stable_s = backoff_base_s, backoff_max_s, stable_s
        self.slots = {n: _Slot(n, g, i) for g in config.groups for i, n in enumerate(config.pod_names(g))}
        self.manifests = {s.name: config.pod_manifest(s.group, s.index) for s in self.slots.values()}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch = None
        self.last_error = ""

    # --- life ---------------------------------------------------------------------------------------------
    def start(self) -> KubernetesLauncher:
        """Reconciles once here (LauncherError when the API refuses this service account), then in the
        background: a watch that wakes the reconciler, and the reconciler itself."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.reconcile()
        except ApiException as e:
            if e.status in (401, 403, 404):
                raise LauncherError(
                    f"the Kubernetes API refused to list Pods in namespace {self.config.namespace!r} "
                    f"({e.status} {e.reason}): {_api_message(e)}"
                ) from None
            log.error("kubernetes launcher: %s; trying again", _api_message(e))
        except Exception as e:  # noqa: BLE001 - unreachable (urllib3's errors), a bad configuration...
            raise LauncherError(
                f"cannot reach the Kubernetes API at {self.configuration.host}: {_api_message(e)}"
            ) from None
        for target, name in ((self._watch_loop, "k8s-watch"), (self._reconcile_loop, "k8s-reconcile")):
            t = threading.Thread(target=target, daemon=True, name=name)
            t.start()
            self._threads.append(t)
        self._wake.set()  # a second pass soon: what changed before the watch was open, and slots emptied above
        return self

    def stop(self, delete: bool = True, timeout: float = 10.0) -> None:
        """Stops watching and deletes every kernel Pod of ours (the API server lets them terminate gracefully)."""
        self._stop.set()
        self._wake.set()
        watch = self._watch
        if watch is not None:
            watch.stop()  # unblocks the watch's read at once
        for t in self._threads:
            t.join(timeout)
        if delete:
            names = set(self.slots)
            try:
                names |= {p.metadata.name for p in self._list()}
            except Exception as e:  # noqa: BLE001 - still delete the ones we know
                log.error("kubernetes launcher: cannot list kernel Pods at shutdown: %s", _api_message(e))
            for name in sorted(names):
                self._delete(name, "the control plane stopped", quiet=True)

    # --- what is there ------------------------------------------------------------------------------------
    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            return [
                {
                    "pod": s.name,
                    "group": s.group.id,
                    "phase": s.phase,
                    "ip": s.ip,
                    "failures": s.failures,
                    "next_try_in_s": max(0.0, s.not_before - now) if s.uid is None else 0.0,
                    "last": s.last,
                    "last_failure": s.last_failure,
                }
                for s in self.slots.values()
            ]

    def _list(self) -> list:
        pods = self.core.list_namespaced_pod(self.config.namespace, label_selector=self.config.selector())
        return [p for p in pods.items if self.config.is_ours(_meta(p).name, _meta(p).labels)]

    # --- reconciling --------------------------------------------------------------------------------------
    def reconcile(self) -> None:
        """One pass: list our Pods and bring them to what the configuration wants."""
        pods = {p.metadata.name: p for p in self._list()}
        now = time.monotonic()
        for name, pod in pods.items():
            if name not in self.slots and not pod.metadata.deletion_timestamp:
                self._delete(name, "no group has this slot any more")
        for slot in self.slots.values():
            if self._stop.is_set():
                return
            pod = pods.get(slot.name)
            if pod is None:
                if slot.uid is not None:  # our Pod is gone without us deleting it
                    if not slot.going:
                        self._failed(slot, "disappeared (deleted or evicted)", now)
                    slot.uid, slot.going, slot.phase, slot.ip, slot.running_since = None, False, None, None, None
                if now >= slot.not_before:
                    self._create(slot)
                continue
            self._seen(slot, pod, now)
            if pod.metadata.deletion_timestamp:
                continue  # terminating: recreated once it is gone
            phase = pod.status.phase if pod.status else None
            if phase in ("Failed", "Succeeded"):
                if not slot.going:  # counted once, even if its deletion has to be tried again
                    self._failed(slot, _why(pod), now)
                    slot.going = True
                self._delete(slot.name, "its kernel ended")
            elif (pod.metadata.annotations or {}).get(SPEC_ANNOTATION) != self._hash(slot):
                if not slot.going:
                    slot.going = True
                    self._gone(slot, "was replaced: the kernel Pod spec changed")
                self._delete(slot.name, "its spec is not this configuration's")

    def _seen(self, slot: _Slot, pod, now: float) -> None:
        phase = pod.status.phase if pod.status else None
        with self._lock:
            if slot.uid != pod.metadata.uid:  # a new Pod in the slot (ours, or adopted)
                slot.uid, slot.going, slot.running_since, slot.ip = pod.metadata.uid, False, None, None
            slot.phase, slot.ip = phase, (pod.status.pod_ip if pod.status else None) or slot.ip
            if phase == "Running" and slot.running_since is None:
                slot.running_since = now

    def _failed(self, slot: _Slot, why: str, now: float) -> None:
        stable = slot.running_since is not None and now - slot.running_since >= self.stable_s
        with self._lock:
            slot.failures = 1 if stable else slot.failures + 1
            # The first replacement is immediate; a slot that keeps failing waits 2, 4, ... up to the max.
            delay = (
                0.0 if slot.failures <= 1 else min(self.backoff_max_s, self.backoff_base_s * 2 ** (slot.failures - 2))
            )
            slot.not_before = now + delay
            slot.last = slot.last_failure = f"Pod {why}" + (f"; replaced in {delay:.0f} s" if delay else "; replaced")
        log.warning(
            "kernel Pod %s %s; %s",
            slot.name,
            why,
            f"next one in {delay:.0f} s (failure {slot.failures} in a row)" if delay else "replacing it",
        )
        self._gone(slot, why)

    def _gone(self, slot: _Slot, why: str) -> None:
        if self.on_kernel_gone is not None:
            for kernel in self.config.kernel_names(slot.group, slot.name):  # each kernel of a multi-device Pod
                try:
                    self.on_kernel_gone(kernel, f"its Pod {why}", slot.ip)
                except Exception:  # the fleet's business; the launcher goes on
                    log.exception("on_kernel_gone failed for %s", kernel)

    def _hash(self, slot: _Slot) -> str:
        return self.manifests[slot.name]["metadata"]["annotations"][SPEC_ANNOTATION]

    def _create(self, slot: _Slot) -> None:
        from kubernetes.client.exceptions import ApiException

        if self._stop.is_set():  # stop() deletes what exists: make nothing after it started
            return
        try:
            pod = self.core.create_namespaced_pod(self.config.namespace, self.manifests[slot.name])
        except ApiException as e:
            if e.status == 409:  # the name is taken by a Pod our selector does not see
                self._name_taken(slot)
            else:
                self._api_failed(slot, f"cannot create kernel Pod {slot.name}", e)
            return
        except ValueError as e:  # the client's own model validation refused the manifest (a bug here)
            self._api_failed(slot, f"cannot create kernel Pod {slot.name}", e)
            return
        with self._lock:
            slot.uid, slot.going, slot.phase, slot.ip = _meta(pod).uid, False, "Pending", None
            slot.running_since = None
            slot.last = "Pod created"
        self.last_error = ""
        log.warning("kernel Pod %s created (group %s)", slot.name, slot.group.id)

    def _name_taken(self, slot: _Slot) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            pod = self.core.read_namespaced_pod(slot.name, self.config.namespace)
        except ApiException as e:
            if e.status != 404:  # 404: it went meanwhile; the next pass creates ours
                self._api_failed(slot, f"cannot read Pod {slot.name}", e)
            return
        if _meta(pod).deletion_timestamp:  # going: try again shortly (no failure, and no busy loop)
            with self._lock:
                slot.not_before = time.monotonic() + 1.0
        elif GROUP_LABEL in (_meta(pod).labels or {}):
            # A kernel Pod with other owner labels (an older podLabels): ours by its name and group label.
            self._delete(slot.name, "it carries other labels than this configuration's")
        else:
            self._api_failed(
                slot,
                f"a Pod named {slot.name} exists that is no kernel Pod of this control plane; "
                "delete it or set another namePrefix",
                None,
            )

    def _api_failed(self, slot: _Slot, what: str, e) -> None:
        message = f"{what}: {_api_message(e)}" if e is not None else what
        with self._lock:
            slot.failures += 1
            slot.not_before = time.monotonic() + min(self.backoff_max_s, self.backoff_base_s * 2 ** (slot.failures - 1))
            slot.last = slot.last_failure = message
        self.last_error = message
        log.error("kubernetes launcher: %s", message)

    def _delete(self, name: str, why: str, quiet: bool = False) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(name, self.config.namespace)
            if not quiet or name in self.slots:
                log.warning("kernel Pod %s deleted: %s", name, why)
        except ApiException as e:
            if e.status != 404:
                log.error("kubernetes launcher: cannot delete Pod %s: %s", name, _api_message(e))

    def _reconcile_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                waiting = [s.not_before for s in self.slots.values() if s.uid is None]
            now = time.monotonic()
            wait = min([self.resync_s] + [max(0.05, t - now) for t in waiting])
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.reconcile()
            except Exception as e:  # noqa: BLE001 - the API may be away for a while; try again
                self.last_error = _api_message(e)
                log.error("kubernetes launcher: %s", self.last_error)
                self._stop.wait(min(self.resync_s, 5.0))

    def _watch_loop(self) -> None:
        from kubernetes import watch

        pause = 1.0
        while not self._stop.is_set():
            self._watch = w = watch.Watch()
            try:
                for event in w.stream(
                    self.core.list_namespaced_pod,
                    self.config.namespace,
                    label_selector=self.config.selector(),
                    timeout_seconds=self.watch_s,
                    _request_timeout=(10, self.watch_s + 30),
                ):
                    if self._stop.is_set():
                        break
                    pod = event["object"]
                    if event["type"] == "ERROR" or not hasattr(pod, "metadata"):
                        break
                    if not self.config.is_ours(pod.metadata.name, pod.metadata.labels):
                        continue
                    self._observe(event["type"], pod)
                pause = 1.0
            except Exception as e:  # noqa: BLE001 - a dropped or refused watch: open it again
                if self._stop.is_set():
                    return
                log.info("kubernetes launcher: watch ended: %s", _api_message(e))
                self._stop.wait(pause)
                pause = min(30.0, pause * 2)
            self._wake.set()  # events may have been missed meanwhile: a full pass

    def _observe(self, kind: str, pod) -> None:
        slot = self.slots.get(pod.metadata.name)
        phase = pod.status.phase if pod.status else None
        if slot is None:
            self._wake.set()  # a Pod no slot wants
            return
        with self._lock:
            changed = kind == "DELETED" or phase != slot.phase or pod.metadata.uid != slot.uid
            if pod.metadata.uid == slot.uid:
                # A DELETED event carries the Pod's last state: its IP, should an earlier event have been missed.
                slot.ip = (pod.status.pod_ip if pod.status else None) or slot.ip
                if kind != "DELETED":
                    slot.phase = phase
                    if phase == "Running" and slot.running_since is None:
                        slot.running_since = time.monotonic()
        if changed:
            self._wake.set()


def _meta(pod: V1Pod) -> V1ObjectMeta:
    """A Pod's metadata: the API always sends it (the client's models type every field as maybe None)."""
    meta = pod.metadata
    assert meta is not None
    return meta


def _why(pod) -> str:
    """Why a Pod's kernel ended, from its status: "failed: OOMKilled (exit code 137)"."""
    status = pod.status
    verb = "failed" if status.phase == "Failed" else "exited"
    for cs in status.container_statuses or ():
        term = cs.state.terminated if cs.state else None
        if cs.name == CONTAINER and term is not None:
            detail = f"{term.reason or 'exited'} (exit code {term.exit_code})"
            return f"{verb}: {detail}" + (f": {term.message.strip()[:200]}" if term.message else "")
    said = ": ".join(x for x in (status.reason, (status.message or "")[:200]) if x)  # e.g. Evicted: the node was low...
    if said:
        return f"{verb}: {said}"
    return verb


def _api_message(e) -> str:
    """An ApiException's own message (the API server's Status.message), else the exception's text."""
    body = getattr(e, "body", None)
    if body:
        try:
            return json.loads(body).get("message") or str(body)[:500]
        except (ValueError, AttributeError):
            return str(body)[:500]
    return str(e)[:500] or type(e).__name__
