"""Where a control plane's own kernels come from (`serve --kernel-launcher`): one `Launcher`, so that `serve`
(server.py) never branches on which.

- `LocalLauncher` (local, the default): child processes on this machine (cluster/local.py), one per group of the
  orchestrator's config, each restarted by the fleet when it dies.
- `PodLauncher` (kubernetes): kernel Pods (cluster/kubernetes.py) that join the fleet over the gRPC port; the
  groups are those of its launcher.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from openrl_lab.cluster.fleet import Fleet
    from openrl_lab.cluster.kubernetes import KubernetesLauncher, LauncherConfig
    from openrl_lab.orchestrator.config import GroupSpec


class LaunchError(Exception):
    """The launcher cannot start its kernels; the message is one line, for `openrl-lab serve: ...`."""


class Launcher(Protocol):
    def groups(self) -> dict | None:
        """The orchestrator's groups as a config ({"groups": [...]}), or None: the config file or those found."""
        ...

    def start(self, fleet: Fleet, groups: Sequence[GroupSpec] | None) -> str:
        """Starts the kernels (`groups`: the orchestrator's, None without one); what the start line says of them."""
        ...

    def stop(self) -> None: ...


class LocalLauncher:
    """`cpu_kernels`: that many CPU kernels, each its own group pinned to its own cores (0: none, only kernels that
    join); else one kernel per device (`device`: auto, cpu, cuda:N). `sampler`, `sampler_fallback`: the sampler of
    the group samplers go to (`sampler-group`), overriding the config file's. `tls`: the gRPC port serves TLS,
    which local kernels (plaintext on loopback) cannot use yet."""

    def __init__(
        self,
        device: str = "auto",
        cpu_kernels: int | None = None,
        sampler: str | None = None,
        sampler_fallback: bool = False,
        tls: bool = False,
    ):
        self.device, self.cpu_kernels = device, cpu_kernels
        self.sampler, self.sampler_fallback, self.tls = sampler, sampler_fallback, tls

    def groups(self) -> dict | None:
        from openrl_lab.orchestrator.config import fleet_groups

        return None if self.cpu_kernels is None else {"groups": fleet_groups(devices(self.device, self.cpu_kernels))}

    def start(self, fleet: Fleet, groups: Sequence[GroupSpec] | None) -> str:
        from openrl_lab.kernel.client import KernelError
        from openrl_lab.orchestrator.errors import InvalidArgument

        try:
            planned = local_kernels(
                self.device,
                self.cpu_kernels,
                () if self.cpu_kernels == 0 else groups,
                self.sampler,
                self.sampler_fallback,
            )
        except InvalidArgument as e:  # a --sampler that no group takes
            raise LaunchError(f"--sampler {self.sampler}: {e}") from None
        if self.tls and planned:
            raise LaunchError(
                "with --tls-cert the control plane runs no kernels of its own yet (local kernels reach the "
                "orchestrator in plaintext on loopback): add --cpu-kernels 0 and let kernels join"
            )
        for kernel in planned:  # started now so the first request does not wait for them
            try:
                fleet.add_local(**kernel)
            except KernelError as e:  # it exited at start (a bad device, vLLM not installed...): its reason
                raise LaunchError(str(e)) from None
        return ", ".join(f"{r.name} ({r.device}, group {r.group})" for r in fleet.records()) or "none yet"

    def stop(self) -> None:
        """Nothing of its own: the fleet stops the kernels it started."""


class PodLauncher:
    """Kernel Pods per launcher.json (`cluster/kubernetes.py`); they join over the gRPC port."""

    def __init__(self, config: Path | LauncherConfig):
        from openrl_lab.cluster.kubernetes import LauncherConfigError, load_launcher_config

        try:
            self.config = load_launcher_config(config) if isinstance(config, Path) else config
        except LauncherConfigError as e:
            raise LaunchError(str(e)) from None
        self._pods: KubernetesLauncher | None = None

    def groups(self) -> dict | None:
        return {"groups": self.config.group_specs()}

    def start(self, fleet: Fleet, groups: Sequence[GroupSpec] | None) -> str:
        from openrl_lab.cluster.kubernetes import KubernetesLauncher

        try:
            self._pods = KubernetesLauncher(self.config, on_kernel_gone=fleet.lost_elsewhere).start()
        except Exception as e:  # noqa: BLE001 - no kubeconfig, the API refused us...: one line
            raise LaunchError(f"the Kubernetes launcher cannot start: {e}") from None
        return f"{len(self._pods.slots)} kernel Pods in namespace {self.config.namespace}, joining"

    def stop(self) -> None:
        """The Pods go first: their kernels must not outlive the control plane that made them."""
        if self._pods is not None:
            self._pods.stop()


def local_kernels(
    device: str, cpu_kernels: int | None, configured, sampler: str | None = None, sampler_fallback: bool = False
) -> list[dict]:
    """`Fleet.add_local`'s arguments for each kernel this machine runs: one per group of the orchestrator's config
    (`configured`: its GroupSpecs, None without an orchestrator), with the group's sampler settings. `sampler`
    (`serve --sampler`): the sampler of the group that serves samples (`sampler-group`), whatever the config says;
    InvalidArgument when no group is named so."""
    from openrl_lab.cluster.local import core_sets
    from openrl_lab.orchestrator.config import fleet_groups, with_sampler

    groups = configured if configured is not None else fleet_groups(devices(device, cpu_kernels))
    if sampler is not None and groups:
        groups = with_sampler(tuple(groups), sampler, sampler_fallback)
    cpu_groups = [g for g in groups if g.devices[0].startswith("cpu")]
    cores = iter(core_sets(len(cpu_groups)) if len(cpu_groups) > 1 else [None] * len(cpu_groups))
    out = []
    for g in groups:
        dev = g.devices[0]
        cpu = dev.startswith("cpu")
        out.append(
            {
                "group": g.id,
                "device": "cpu" if cpu else dev,
                "cores": next(cores) if cpu else None,
                "sampler": g.sampler,
                "sampler_fallback": g.sampler_fallback,
                "python": g.kernel_python,
                "sampler_models": g.sampler_models,
            }
        )
    return out


def devices(device: str, cpu_kernels: int | None) -> list[str]:
    """The devices of the local kernels: N CPU kernels, the devices found (`auto`), or the one named."""
    from openrl_lab.orchestrator.config import discover_devices

    if cpu_kernels is not None:
        return [f"cpu:{i}" for i in range(cpu_kernels)] if cpu_kernels > 1 else ["cpu"]
    if device == "auto":
        return discover_devices()
    return [device]
