"""The kernel fleet: every kernel the control plane knows, where jobs go, and which kernels are alive (torch-free).

Kernels come from two places: child processes the control plane starts (`cluster/local.py`, one per group
of its own machine) and kernels that join from other hosts (`cluster/join.py`). Both are the same here: a
name, a group, an address and key for the kernel protocol, and an *incarnation* (fresh per process).

- **Epoch**: `<name>#<incarnation>` names one kernel process. A training run or sampler records the epoch
  of the kernel it was placed on: its calls go there, and only there, for its life. When that process is
  gone, the epoch is dead and the run answers with an error naming its last checkpoint.
- **Placement** (`place`): a new job goes to a kernel of the group its lease names (any group when it names
  none; samplers to the `sampler-group`), choosing, in order: the group with the fewest jobs (an idle
  accelerator beats a busy one: time-slicing costs every step, a base-model load costs once), then the kernel
  with the fewest jobs, one that already holds the base model, the most free device memory, the name.
- **Liveness**: the fleet asks every kernel for its metrics each second (answered at once, even while a
  primitive runs). A kernel that has not answered for $OPENRL_KERNEL_LOST_AFTER_S (default 5 s), a local kernel whose
  process exited, or a joined kernel whose join token was revoked is *lost*: its client is closed (calls
  in flight fail at once), `on_lost` callbacks drop its orchestrator residency and slices, and a local
  kernel is started again under a new incarnation. A joined kernel that comes back joins again.
"""

from __future__ import annotations

import collections
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openrl_lab.cluster.local import LocalKernel
from openrl_lab.kernel.api import KernelMetrics
from openrl_lab.kernel.client import KernelClient, KernelError, KernelLost, NoKernel
from openrl_lab.settings import settings

log = logging.getLogger("openrl_lab.fleet")

PING_EVERY_S = 1.0
PING_TIMEOUT_S = 2.0
START_TIMEOUT_S = 180.0
PENDING_PLACEMENT_S = 120.0  # a placement counts as a job on its kernel until the kernel reports it (or this long)
SAMPLER_GROUP = "sampler-group"
TRAINER_GROUP = "trainer-group"


@dataclass
class KernelRecord:
    name: str
    group: str
    device: str
    host: str
    address: tuple[str, int]
    incarnation: str
    client: KernelClient
    origin: str  # local | joined
    tls: bool = False
    token_hash: str | None = None  # the join token it joined with (joined kernels)
    local: LocalKernel | None = None
    state: str = "up"  # up | lost
    lost_why: str = ""
    joined_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    last_seen_at: float = field(default_factory=time.time)
    metrics: KernelMetrics | None = None  # its last answer to `metrics` (None until the first)
    pending: dict[str, float] = field(default_factory=dict)  # job id -> when placed, until metrics list it
    asks: int = 0  # metrics asks sent to this kernel so far
    metrics_ask: int = 0  # the ask `metrics` answered: an answer to an earlier ask is older, and dropped

    @property
    def epoch(self) -> str:
        return f"{self.name}#{self.incarnation}"

    def jobs(self) -> set[str]:
        return set(self.metrics.job_ids if self.metrics else ()) | set(self.pending)

    def view(self) -> dict[str, Any]:
        """What `openrl-lab kernel list` and /api/v1/lab/kernels show."""
        m = self.metrics
        return {
            "name": self.name,
            "group": self.group,
            "device": self.device,
            "host": self.host,
            "address": f"{self.address[0]}:{self.address[1]}",
            "origin": self.origin,
            "tls": self.tls,
            "state": self.state,
            "lost_why": self.lost_why or None,
            "incarnation": self.incarnation,
            "jobs": len(self.jobs()),
            "samplers": m.samplers if m else 0,
            "sampler": m.sampler if m else (self.local.sampler if self.local else None),
            "base_models": m.base_models if m else [],
            "device_bytes": m.device_bytes if m else None,
            "device_free_bytes": m.device_free_bytes if m else None,
            "device_budget_bytes": m.device_budget_bytes if m else None,
            "device_available_bytes": m.device_available_bytes if m else None,
            "rss_bytes": m.rss_bytes if m else None,
            "joined_at": self.joined_at,
            "last_heartbeat": self.last_seen_at,
        }


@dataclass
class _LocalSpec:
    name: str
    group: str
    device: str
    cores: tuple[int, ...] | None
    sampler: str = "torch"
    sampler_fallback: bool = False
    python: str | None = None
    sampler_models: tuple[str, ...] = ()
    failures: int = 0


class Fleet:
    """`groups()`: the orchestrator's groups as {name or alias: group id} (None: phases run unarbitrated and a
    group is whatever kernels say). `token_valid(hash)`: whether a joined kernel's token still stands."""

    def __init__(
        self,
        home: Path,
        orchestrator: tuple[str, str] | None = None,
        groups: Callable[[], dict[str, str]] | None = None,
        token_valid: Callable[[str], bool] | None = None,
    ):
        self.home = home
        self.orchestrator = orchestrator  # (gRPC target, kernel API key) handed to local kernels
        self.group_source = groups
        self._token_valid = token_valid
        self._records: dict[str, KernelRecord] = {}  # by name: its current (or last) incarnation
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # dead epoch -> why
        self._local: dict[str, _LocalSpec] = {}
        self._starting: set[str] = set()
        self._cond = threading.Condition()
        self.on_lost: list[Callable[[KernelRecord], None]] = []
        self._stop = threading.Event()
        self.lost_after_s = settings().kernel_lost_after_s  # silent this long: lost
        self._watcher: threading.Thread | None = None
        self._pings = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="fleet-ping")

    # --- groups -----------------------------------------------------------------------------------
    def group_names(self) -> dict[str, str] | None:
        return self.group_source() if self.group_source else None

    def resolve(self, group: str) -> str:
        names = self.group_names()
        return names.get(group, group) if names else group

    def groups(self) -> list[str]:
        """The group ids that have a kernel that is up or starting."""
        with self._cond:
            return sorted(
                {r.group for r in self._records.values() if r.state == "up"}
                | {s.group for s in self._local.values() if s.name in self._starting}
            )

    # --- local kernels ----------------------------------------------------------------------------
    def add_local(
        self,
        group: str,
        device: str,
        cores: tuple[int, ...] | None = None,
        name: str | None = None,
        sampler: str = "torch",
        sampler_fallback: bool = False,
        python: str | None = None,
        sampler_models: tuple[str, ...] = (),
    ) -> KernelRecord:
        """Starts a child kernel (blocking until it answers) and keeps it running: restarted when it dies.
        `sampler`, `sampler_fallback`, `python`, `sampler_models`: see `LocalKernel`."""
        spec = _LocalSpec(
            name or f"kernel-{group}", group, device, cores, sampler, sampler_fallback, python, tuple(sampler_models)
        )
        with self._cond:
            self._local[spec.name] = spec
            self._starting.add(spec.name)
        return self._start_local(spec)

    def _start_local(self, spec: _LocalSpec) -> KernelRecord:
        kernel = LocalKernel(
            spec.group,
            self.home,
            spec.device,
            orchestrator=self.orchestrator,
            name=spec.name,
            cores=spec.cores,
            sampler=spec.sampler,
            sampler_fallback=spec.sampler_fallback,
            python=spec.python,
            sampler_models=spec.sampler_models,
        )
        try:
            client = kernel.start()
        except Exception:
            with self._cond:
                self._starting.discard(spec.name)
                self._cond.notify_all()
            raise
        rec = KernelRecord(
            spec.name,
            spec.group,
            spec.device,
            socket.gethostname(),
            ("127.0.0.1", kernel.port),
            kernel.incarnation,
            client,
            "local",
            local=kernel,
        )
        self._put(rec)
        return rec

    def _restart_later(self, spec: _LocalSpec) -> None:
        def run() -> None:
            # Back off when it keeps dying at start (a broken device, a bad install): at most every 60 s.
            self._stop.wait(min(60.0, 2.0**spec.failures - 1))
            if self._stop.is_set():
                return
            try:
                self._start_local(spec)
                spec.failures = 0
                log.warning("kernel %s restarted", spec.name)
            except Exception as e:  # noqa: BLE001 - try again later
                spec.failures += 1
                log.error("kernel %s did not restart: %s", spec.name, e)
                with self._cond:
                    self._starting.add(spec.name)
                self._restart_later(spec)

        with self._cond:
            self._starting.add(spec.name)
        threading.Thread(target=run, daemon=True, name=f"restart-{spec.name}").start()

    # --- joined kernels ---------------------------------------------------------------------------
    def join(
        self,
        name: str,
        group: str,
        device: str,
        host: str,
        address: tuple[str, int],
        key: str,
        incarnation: str,
        tls: bool,
        token_hash: str,
        root_certificates: bytes | None = None,
        tls_name: str | None = None,
    ) -> KernelRecord:
        """Registers a kernel that joined from elsewhere, after checking that it answers on `address`.
        ValueError (the message for the kernel) when the name is taken by a live kernel or it cannot be reached."""
        with self._cond:
            old = self._records.get(name)
            if name in self._local:
                raise ValueError(
                    f"kernel name {name!r} is one of the control plane's own kernels; choose another --name"
                )
        if old is not None and old.state == "up" and old.incarnation != incarnation:
            try:
                old.client.ping(timeout=PING_TIMEOUT_S)
                raise ValueError(
                    f"a kernel named {name!r} is live at {old.address[0]}:{old.address[1]}; choose "
                    "another --name (or stop that kernel first)"
                )
            except KernelError:
                self._mark_lost(old, "a new kernel process joined under its name")
        client = KernelClient(address, key, tls=tls, root_certificates=root_certificates, tls_name=tls_name)
        try:
            metrics = client.api(timeout=5.0).metrics()
        except KernelError as e:
            client.close()
            raise ValueError(
                f"the control plane cannot reach this kernel at {address[0]}:{address[1]}"
                f"{' over TLS' if tls else ''}: {e}"
            ) from None
        rec = KernelRecord(
            name,
            group,
            device,
            host,
            address,
            incarnation,
            client,
            "joined",
            tls=tls,
            token_hash=token_hash,
            metrics=metrics,
        )
        self._put(rec)
        log.warning("kernel %s joined from %s (%s, group %s)", name, host, device, group)
        return rec

    def _put(self, rec: KernelRecord) -> None:
        with self._cond:
            old = self._records.get(rec.name)
            if old is not None and old.incarnation != rec.incarnation and old.state == "up":
                self._retire(old, "replaced by a new kernel process of the same name")
            self._records[rec.name] = rec
            self._starting.discard(rec.name)
            self._cond.notify_all()

    # --- lookups ----------------------------------------------------------------------------------
    def records(self) -> list[KernelRecord]:
        with self._cond:
            return sorted(self._records.values(), key=lambda r: r.name)

    def running_by_name(self) -> dict[str, KernelClient]:
        """Every live kernel's client by name (for /metrics)."""
        return {r.name: r.client for r in self.records() if r.state == "up"}

    def where(self, epoch: str | None) -> dict[str, Any] | None:
        """Where a run or sampler lives (kernel, group, host, device), for get_info and the lab's status."""
        rec = self._records.get((epoch or "").partition("#")[0])
        if rec is None or rec.epoch != epoch:
            return None
        return {"kernel": rec.name, "group": rec.group, "host": rec.host, "device": rec.device, "state": rec.state}

    def is_live(self, epoch: str | None) -> bool:
        name = (epoch or "").partition("#")[0]
        rec = self._records.get(name)
        return rec is not None and rec.state == "up" and rec.epoch == epoch

    def dropped(self, epoch: str, job_id: str) -> None:
        """The job was dropped from its kernel: it no longer counts there, even if the kernel never reported it
        (made and dropped between two of its reports), and the memory it freed is available at once: the
        kernel is asked for its metrics now (blocking, up to PING_TIMEOUT_S), and an answer to an ask sent
        before the drop, still in flight, can no longer bring the job back."""
        with self._cond:
            rec = self._records.get(epoch.partition("#")[0])
            if rec is None or rec.epoch != epoch:
                return
            rec.pending.pop(job_id, None)
            ask, answer = self._ask(rec)
        try:
            self._heard(rec, ask, answer.result(PING_TIMEOUT_S + 1))
        except Exception as e:  # noqa: BLE001 - the next round of `check` asks again (and judges liveness)
            log.info("metrics of %s after dropping %s: %s", epoch, job_id, e)

    def get(self, epoch: str) -> KernelRecord:
        """The live kernel of this epoch; KernelLost naming why it is gone otherwise."""
        name = epoch.partition("#")[0]
        rec = self._records.get(name)
        if rec is not None and rec.state == "up" and rec.epoch == epoch:
            return rec
        raise KernelLost(f"its kernel {name!r} was lost: {self.why_gone(epoch)}")

    def settle(self, epoch: str, timeout: float | None = None) -> bool:
        """After a failed call: whether the kernel of this epoch is still there (it answers a ping) or gone
        (lost, or silent for `lost_after_s`: then it is marked lost now). Blocking; `timeout` defaults to a
        little over `lost_after_s`."""
        deadline = time.monotonic() + (self.lost_after_s + 2 if timeout is None else timeout)
        while time.monotonic() < deadline:
            rec = self._records.get(epoch.partition("#")[0])
            if rec is None or rec.epoch != epoch or rec.state != "up":
                return False
            if rec.local is not None and not rec.local.alive():
                self._mark_lost(rec, _exit_reason(rec.local.returncode))
                return False
            try:
                rec.client.ping(timeout=1.0)
                return True
            except KernelError:
                self._stop.wait(0.25)
        rec = self._records.get(epoch.partition("#")[0])
        if rec is not None and rec.epoch == epoch:
            self._mark_lost(rec, f"it stopped answering for {timeout:.0f} s")
        return False

    def why_gone(self, epoch: str) -> str:
        return self._gone.get(epoch, "it restarted or left the fleet since")

    def place(
        self,
        group: str | None = None,
        base_model: str | None = None,
        purpose: str = "train",
        job_id: str | None = None,
        wait_s: float = START_TIMEOUT_S,
        needs_bytes: int | None = None,
    ) -> KernelRecord:
        """The kernel a new job (or sampler) goes to; see the module's docstring for the rule (`needs_bytes`, a
        full fine-tune's device memory: first a kernel that reported that much available). Waits for a kernel of
        the group that is (re)starting; NoKernel when none serves it."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                rec = self._choose(group, base_model, purpose, needs_bytes)
                if rec is not None:
                    if job_id and purpose == "train":
                        rec.pending[job_id] = time.monotonic()
                    return rec
                wanted = self.resolve(group) if group else None
                coming = [
                    s
                    for s in self._local.values()
                    if s.name in self._starting and (wanted is None or s.group == wanted)
                ]
                left = deadline - time.monotonic()
                if not coming or left <= 0:
                    up = sorted({f"{r.group} ({r.name})" for r in self._records.values() if r.state == "up"})
                    raise NoKernel(
                        f"no kernel serves group {wanted!r}; kernels up: {', '.join(up) or 'none'}"
                        if wanted
                        else "no kernel is up (see `openrl-lab kernel list`)"
                    )
                self._cond.wait(min(left, 1.0))

    def place_gang(
        self,
        devices: int,
        group: str | None = None,
        base_model: str | None = None,
        job_id: str | None = None,
        wait_s: float = START_TIMEOUT_S,
        needs_bytes: int | None = None,
    ) -> list[KernelRecord]:
        """The `devices` kernels a gang job's ranks go to, rank 0 first: each in a group of its own (a group is
        time-sliced as one, so two ranks in one group could never run at once), all of one device kind (a
        process group is gloo or NCCL, not both). Rank 0 by `place`'s rule (on `group` when named); the others
        on the same host as rank 0 first (devices there share a fast link), then by the same rule. NoKernel
        naming what is up when there are not enough; waits for (re)starting local kernels like `place`."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                ranks = self._choose_gang(devices, group, base_model, needs_bytes)
                if ranks is not None:
                    if job_id:
                        for r in ranks:
                            r.pending[job_id] = time.monotonic()
                    return ranks
                coming = [s for s in self._local.values() if s.name in self._starting]
                left = deadline - time.monotonic()
                if not coming or left <= 0:
                    up = sorted(
                        {f"{r.group} ({r.name}, {r.device})" for r in self._records.values() if r.state == "up"}
                    )
                    raise NoKernel(
                        f"a run on {devices} devices needs {devices} kernels in different groups on one kind of "
                        f"device{f', the first in group {group!r}' if group else ''}; kernels up: "
                        f"{', '.join(up) or 'none'}"
                    )
                self._cond.wait(min(left, 1.0))

    def _choose_gang(
        self, devices: int, group: str | None, base_model: str | None, needs_bytes: int | None
    ) -> list[KernelRecord] | None:
        first = self._choose(group, base_model, "train", needs_bytes)
        if first is None:
            return None
        ranks = [first]
        kind = first.device.split(":")[0]
        while len(ranks) < devices:
            taken = {r.group for r in ranks}
            others = [
                r for r in self._candidates(None, "train") if r.group not in taken and r.device.split(":")[0] == kind
            ]
            if not others:
                return None
            load: dict[str, int] = collections.Counter()
            for r in others:
                load[r.group] += len(r.jobs())
            ranks.append(
                min(
                    others,
                    key=lambda r: (
                        r.host != first.host,
                        needs_bytes is not None and (_available(r) or needs_bytes) < needs_bytes,
                        load[r.group],
                        len(r.jobs()),
                        r.name,
                    ),
                )
            )
        return ranks

    def room(self, group: str | None) -> list[tuple[KernelRecord, int | None]]:
        """Each kernel a new training job of `group` may be placed on, with the device memory it last reported
        available (None: it reports none)."""
        with self._cond:
            return [(r, _available(r)) for r in self._candidates(group, "train")]

    def _candidates(self, group: str | None, purpose: str) -> list[KernelRecord]:
        up = [r for r in self._records.values() if r.state == "up"]
        if group:
            gid = self.resolve(group)
            up = [r for r in up if r.group == gid]
        elif purpose == "sample":
            gid = self.resolve(SAMPLER_GROUP)
            up = [r for r in up if r.group == gid] or up
        return up

    def _choose(
        self, group: str | None, base_model: str | None, purpose: str, needs_bytes: int | None = None
    ) -> KernelRecord | None:
        up = self._candidates(group, purpose)
        if not up:
            return None
        load: dict[str, int] = collections.Counter()
        for r in up:
            load[r.group] += len(r.jobs())

        def no_room(r: KernelRecord) -> bool:
            available = _available(r)
            return needs_bytes is not None and available is not None and available < needs_bytes

        def key(r: KernelRecord):
            m = r.metrics
            return (
                no_room(r),
                load[r.group],
                len(r.jobs()),
                base_model not in (m.base_models if m else ()),
                -((m.device_free_bytes if m else None) or 0),
                r.name,
            )

        return min(up, key=key)

    # --- liveness ---------------------------------------------------------------------------------
    def start(self) -> Fleet:
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="fleet-watch")
        self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(PING_EVERY_S):
            try:
                self.check()
            except Exception:  # the watcher must not die
                log.exception("fleet check failed")

    def check(self) -> None:
        """One round: ask every live kernel for its metrics; mark the silent, dead or revoked ones lost."""
        now = time.monotonic()
        recs = [r for r in self.records() if r.state == "up"]
        with self._cond:
            asks = {r.name: self._ask(r) for r in recs}
        for r in recs:
            if r.local is not None and not r.local.alive():
                self._mark_lost(r, _exit_reason(r.local.returncode))
                continue
            if r.token_hash and self._token_valid and not self._token_valid(r.token_hash):
                self._mark_lost(r, "its join token was revoked")
                continue
            ask, answer = asks[r.name]
            try:
                metrics = answer.result(PING_TIMEOUT_S + 1)
            except Exception as e:  # noqa: BLE001 - unreachable, timed out, or refused
                if now - r.last_seen > self.lost_after_s:
                    self._mark_lost(r, f"it stopped answering ({str(e)[:160]})")
                continue
            self._heard(r, ask, metrics)

    def _ask(self, rec: KernelRecord) -> tuple[int, futures.Future[KernelMetrics]]:
        """Sends the kernel a metrics ask, numbered (under `_cond`)."""
        rec.asks += 1
        return rec.asks, self._pings.submit(rec.client.api(timeout=PING_TIMEOUT_S).metrics)

    def _heard(self, rec: KernelRecord, ask: int, metrics: KernelMetrics) -> None:
        """The kernel answered ask number `ask`: it is alive, and its metrics are kept unless a later ask's
        answer is already (one sent after a drop knows the job is gone; one sent before may not)."""
        now = time.monotonic()
        with self._cond:
            rec.last_seen, rec.last_seen_at = now, time.time()
            if ask < rec.metrics_ask:
                return
            rec.metrics, rec.metrics_ask = metrics, ask
            listed = set(metrics.job_ids)
            rec.pending = {j: t for j, t in rec.pending.items() if j not in listed and now - t < PENDING_PLACEMENT_S}
            self._cond.notify_all()

    def _mark_lost(self, rec: KernelRecord, why: str) -> None:
        with self._cond:
            if rec.state != "up":
                return
            rec.state, rec.lost_why = "lost", why
            self._retire(rec, why)
            self._cond.notify_all()
        log.warning("kernel %s (%s) lost: %s", rec.name, rec.epoch, why)
        rec.client.close()  # calls in flight fail now, not at their deadline
        for callback in self.on_lost:
            try:
                callback(rec)
            except Exception:
                log.exception("on_lost callback failed for %s", rec.name)
        spec = self._local.get(rec.name)
        if spec is not None and not self._stop.is_set():
            if rec.local is not None:
                rec.local.stop()
            self._restart_later(spec)

    def lost_elsewhere(self, name: str, why: str, host: str | None) -> bool:
        """Something outside the fleet saw kernel `name` at `host` die (the Kubernetes launcher: its Pod failed):
        it is lost now rather than after `lost_after_s` of silence. Only a joined kernel still reached at that host
        (not a newer one that joined since under the same name). Whether it was marked lost."""
        rec = self._records.get(name)
        if rec is None or rec.state != "up" or rec.origin != "joined" or not host or rec.address[0] != host:
            return False
        self._mark_lost(rec, why)
        return True

    def _retire(self, rec: KernelRecord, why: str) -> None:
        self._gone[rec.epoch] = why
        while len(self._gone) > 10000:
            self._gone.popitem(last=False)

    def lost_incarnation(self) -> str:
        """An incarnation no kernel has: telling the orchestrator a kernel now runs as this drops what it left."""
        return f"lost-{uuid.uuid4().hex}"

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for rec in self.records():
            if rec.local is not None:
                rec.local.stop()
            else:
                rec.client.close()
        self._pings.shutdown(wait=False, cancel_futures=True)


def _exit_reason(returncode: int | None) -> str:
    if returncode is None:  # not alive() and no status: it never started
        return "its process never started"
    if returncode < 0:
        try:
            return f"its process was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            pass
    return f"its process exited with status {returncode}"


def _available(r: KernelRecord) -> int | None:
    """The device memory the kernel last reported available for new jobs (None: it has not reported yet)."""
    return r.metrics.device_available_bytes if r.metrics else None
