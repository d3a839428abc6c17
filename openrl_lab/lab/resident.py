"""Your own model code, time-sliced: a process's modules, optimizers and tensors as one job of the orchestrator.

    from openrl_lab.lab.resident import ResidentState
    state = ResidentState(lab.orchestrator, group="trainer-group", name="notebook:my-run")
    state.register(model, optimizer, name="model")       # modules, optimizers, tensors, dicts of tensors
    with state.phase():                                    # one phase: holds the group, state on the device
        loss = model(batch).loss; loss.backward(); optimizer.step()

The state is a job of its own: an orchestrator lease named `notebook:<name>` (owned by the API key's user,
with a weight and a quota), so `%openrl status`, `top`, the timeline and the sidebar show it like any other.

Lazy yield, as everywhere in the lab (`orchestrator/client.py`): between phases nothing moves unless another
job waits for the group. Then the registered state is evicted into the `SwapSet`'s host arena
(`openrl_lab.swap`: pinned on CUDA; on a CPU "device" the same copy into a host buffer, the originals freed)
after the current phase, or, if the other job arrives between phases, on the client's event thread once no
cell uses the state (`cell()`; the IPython layer marks each cell). The next `phase()` restores it before its
body runs: the same Python objects (`model`, `optimizer`, the tensors) with bit-identical values.

A phase that raises still ends (its slice is released). A phase that runs past the group's `max_phase_s`
while another job waits is revoked by the orchestrator (the waiter is told why in its queue reason); the
phase's report says so, and the state is then moved off the device at once, since nobody asks for it later.

This module imports torch (it moves tensors); the orchestrator client it drives does not.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from openrl_lab.lab.connection import LabError
from openrl_lab.memory import fmt_bytes
from openrl_lab.swap import SwapSet, SwapStats

if TYPE_CHECKING:
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient
    from openrl_lab.orchestrator.types import Slice

PREFIX = "notebook:"
WAIT_NOTE_S = 0.01  # a phase that waited at least this long says so (a free group grants in well under 1 ms)


def default_name() -> str:
    """`notebook:<the notebook's file name>` when Jupyter says which notebook runs this kernel
    ($JPY_SESSION_NAME), else `notebook:<host>-<pid>`."""
    session = os.environ.get("JPY_SESSION_NAME")
    stem = Path(session).stem if session else f"{os.uname().nodename}-{os.getpid()}"
    return job_name(stem)


def job_name(name: str) -> str:
    """The orchestrator lease name for `name`: prefixed with `notebook:`, characters a lease name cannot
    carry replaced (the orchestrator's NAME rule: letters, digits and ._:@/+-, at most 128)."""
    if not name.startswith(PREFIX):
        name = PREFIX + name
    return re.sub(r"[^A-Za-z0-9._:@/+-]", "-", name)[:128]


@dataclass
class PhaseReport:
    """What one phase did, beyond running its body."""

    group: str
    kind: str
    waited_s: float = 0.0
    waited_for: tuple[str, ...] = ()  # the jobs that held the group meanwhile ("another user's job" if not yours)
    restored: SwapStats | None = None  # the restore this phase started with, if its state had been evicted
    evicted_for_s: float | None = None  # how long the state had been off the device
    ran_s: float = 0.0
    evicted: SwapStats | None = None  # an eviction right after the phase (someone waited)
    max_phase_s: float = 0.0
    revoked: bool = False  # the orchestrator took the group back while the phase ran (it ran past max_phase_s)
    error: str | None = None

    def wait_line(self) -> str | None:
        """One line when the phase waited for the group or had to restore its state; None otherwise."""
        if self.waited_s < WAIT_NOTE_S and self.restored is None:
            return None
        who = ", ".join(self.waited_for) if self.waited_for else "another job"
        line = f"phase on {self.group}: waited {self.waited_s:.2f} s"
        line += f" while {who} held the group" if self.waited_s >= WAIT_NOTE_S else ""
        if self.restored is not None:
            away = (
                f" (evicted {self.evicted_for_s:.1f} s before, when another job needed the group)"
                if self.evicted_for_s is not None
                else ""
            )
            line += f"; restored {fmt_bytes(self.restored.bytes_moved)} in {self.restored.seconds * 1000:.1f} ms{away}"
        return line

    def overrun_line(self) -> str | None:
        """One warning line when the phase ran past the group's max_phase_s; None otherwise."""
        if not (self.max_phase_s and self.ran_s > self.max_phase_s) and not self.revoked:
            return None
        line = f"warning: this phase ran {self.ran_s:.1f} s"
        if self.max_phase_s:
            line += f", past group {self.group}'s max_phase_s ({self.max_phase_s:g} s)"
        if self.revoked:
            line += (
                "; another job was waiting, so the orchestrator revoked the slice and gave it the group: "
                "split this cell into shorter phases"
            )
        else:
            line += "; nobody waited this time, but a waiting job would have been given the group"
        return line


class ResidentState:
    """One process's registered device state as one orchestrator job; see the module docstring."""

    def __init__(
        self,
        orchestrator: TimeSliceOrchestratorClient,
        group: str = "trainer-group",
        name: str | None = None,
        *,
        weight: float | None = None,
        quota_s: float | None = None,
        priority: str = "interactive",
        announce=print,
    ):
        """`announce`: where a phase's one-line notes go (its wait, an overrun); None: nowhere. `priority`:
        interactive (the default: a notebook's state is someone waiting on a cell) or batch."""
        self.orchestrator = orchestrator
        self.group = group
        self.name = job_name(name) if name else default_name()
        self.announce = announce
        self.swap: SwapSet | None = None  # made at the first register, on the first tensor's device
        self.objects: dict[str, Any] = {}  # registered name -> object
        self._tensors: dict[str, torch.Tensor] = {}  # registered loose tensors (re-read by the SwapSet)
        self.evictions: list[SwapStats] = []
        self.restores: list[SwapStats] = []
        self.last: PhaseReport | None = None
        self._cond = threading.Condition(threading.RLock())
        self._cells = 0  # cells now running that may use the state: a background eviction waits for them
        self._in_phase = 0  # nesting depth of phase() in the thread running phases
        self._evicted_at: float | None = None
        self._closed = False
        try:
            self.lease = orchestrator.lease(group, self.name, weight=weight, quota_s=quota_s, priority=priority)
        except Exception as e:  # noqa: BLE001 - the orchestrator's refusals (unknown group, quota) as one line
            raise LabError(f"cannot make job {self.name!r} on group {group!r}: {e}") from None
        self.group_id = self.lease.group_id  # the canonical id (group may be an alias)
        self.max_phase_s = next((g.max_phase_s for g in orchestrator.list_groups() if g.group_id == self.group_id), 0.0)
        orchestrator.register(group, on_evict=self._on_evict, on_restore=self._on_restore, lease=self.name)

    # --- what is registered ---------------------------------------------------------------------------
    def register(self, *objects: Any, name: str | None = None, names: list[str] | None = None) -> ResidentState:
        """Registers modules (parameters and buffers), optimizers (their state, re-read at every eviction: AdamW
        makes it at the first step), tensors and dicts of tensors. `names` (or one `name`) label them in views
        and let autophase find the cells that use them; the objects keep their identity."""
        labels = names if names is not None else [name] * len(objects) if name else [None] * len(objects)
        if len(labels) != len(objects):
            raise LabError(f"register: {len(objects)} objects but {len(labels)} names")
        if self._closed:
            raise LabError(f"job {self.name!r} is closed")
        with self._cond:
            if self.swap is not None and not self.swap.resident:
                raise LabError(
                    f"job {self.name!r} is evicted (another job has group {self.group!r}): register "
                    "inside a phase (%%openrl phase), where its state is on the device"
                )
            for obj, given in zip(objects, labels):
                label = given or f"{type(obj).__name__.lower()}{len(self.objects)}"
                if label in self.objects and self.objects[label] is obj:
                    continue  # registering the same object again is harmless
                if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)) and not (
                    isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())
                ):
                    raise LabError(
                        f"cannot register {label!r}: a {type(obj).__name__} (register torch modules, "
                        "optimizers, tensors or dicts of tensors)"
                    )
                swap = self._swap_for(obj, label)
                if isinstance(obj, torch.nn.Module):
                    swap.add_module(obj, prefix=label)
                elif isinstance(obj, torch.optim.Optimizer):
                    swap.add_optimizer(obj)
                elif isinstance(obj, torch.Tensor):
                    self._tensors[label] = obj
                else:
                    swap.add_tensors(obj, prefix=label)
                self.objects[label] = obj
        return self

    def _swap_for(self, obj: Any, label: str) -> SwapSet:
        if self.swap is None:
            device = _device_of(obj)
            if device is None:
                raise LabError(f"cannot register {label!r}: it holds no tensor yet (register its module first)")
            self.swap = SwapSet(self.name, device)
            self.swap.add_tensors(self._tensors, prefix="tensors")  # the dict is re-read at every eviction
        return self.swap

    @property
    def resident(self) -> bool:
        """Whether the state is on the device now."""
        return self.swap is None or self.swap.resident

    @property
    def nbytes(self) -> int:
        return 0 if self.swap is None else self.swap.nbytes

    # --- phases ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, kind: str = "cell") -> Iterator[PhaseReport]:
        """One phase on the group: waits for a slice, restores the state if it was evicted, runs the body,
        releases (also when the body raises); evicts after it if another job waits. Nested phases run in
        the outer one's slice. Yields the phase's `PhaseReport` (complete once the phase ended)."""
        if self._closed:
            raise LabError(f"job {self.name!r} is closed")
        if self._in_phase:
            self._in_phase += 1
            try:
                assert self.last is not None  # the outer phase set it before it began
                yield self.last
            finally:
                self._in_phase -= 1
            return
        with self._cond:  # the cell works in phases: between them, a waiting job may have the state moved
            self._cells = 0
            self._cond.notify_all()
        report = PhaseReport(self.group, kind, max_phase_s=self.max_phase_s)
        self.last = report
        asked = time.time()
        n = len(self.evictions)
        s = None
        try:
            with self.orchestrator.on_accelerators(self.group, kind=kind, lease=self.name) as s:
                t0 = time.perf_counter()
                report.waited_s = s.waited_s
                if s.restored and self.restores:  # the client ran our on_restore in its acquire
                    report.restored = self.restores[-1]
                report.restored = self._on_restore() or report.restored  # also when the orchestrator did not
                if report.restored is not None and self._evicted_at is not None:  # know (a revoked phase)
                    report.evicted_for_s = asked - self._evicted_at
                if report.waited_s >= WAIT_NOTE_S:
                    report.waited_for = self._holders(asked, s)
                self._note(report.wait_line())
                self._in_phase = 1
                try:
                    yield report
                except BaseException as e:
                    report.error = f"{type(e).__name__}: {e}"
                    raise
                finally:
                    with self._cond:
                        self._in_phase = 0
                        self._cond.notify_all()
                    report.ran_s = time.perf_counter() - t0
        finally:  # released now; the eviction, if another job waited, ran in the release
            if s is not None:
                report.revoked = s.release is None  # the release was refused: the slice had been revoked
                if len(self.evictions) > n:
                    report.evicted = self.evictions[-1]
                if report.revoked:
                    self._on_evict()  # nobody will ask for it: free the device for the job that has the group
                self._note(report.overrun_line())

    @contextlib.contextmanager
    def cell(self) -> Iterator[None]:
        """Marks code that uses the state outside a phase (a notebook cell): a waiting job's eviction happens
        after it, not in its middle. Entering a phase ends the mark (the code then works in phases)."""
        self.begin_cell()
        try:
            yield
        finally:
            self.end_cell()

    def begin_cell(self) -> None:
        with self._cond:
            self._cells += 1

    def end_cell(self) -> None:
        with self._cond:
            self._cells = max(0, self._cells - 1)
            self._cond.notify_all()

    # --- the orchestrator's hooks ---------------------------------------------------------------------
    def _on_evict(self) -> None:
        """Called by the orchestrator client when another job waits: after a phase (in its thread) or between
        phases (on the event thread: waits for the running cell to end)."""
        with self._cond:
            while (self._cells or self._in_phase) and not self._closed:
                self._cond.wait()
            if self.swap is None or not self.swap.resident or self._closed:
                return
            self.evictions.append(self.swap.evict())
            self._evicted_at = time.time()

    def _on_restore(self) -> SwapStats | None:
        with self._cond:
            if self.swap is None or self.swap.resident or self._closed:
                return None
            stats = self.swap.restore()
            self.restores.append(stats)
            return stats

    def _holders(self, asked: float, s: Slice) -> tuple[str, ...]:
        """Who held the group while this phase waited (from the timeline; only asked when it waited)."""
        try:
            records = self.orchestrator.timeline(self.group_id, since=asked - 1.0, limit=200).records
        except Exception:  # noqa: BLE001 - the note is a courtesy: never fail a phase over it
            return ()
        names = []
        for r in records:
            if r.slice_id == s.slice_id or (r.mine and r.job == self.name) or r.granted_at > s.grant.granted_at:
                continue
            if r.released_at and r.released_at < asked:
                continue
            who = f"{r.job} ({r.kind})" if r.job else "another user's job"
            if who not in names:
                names.append(who)
        return tuple(names)

    def _note(self, line: str | None) -> None:
        if line and self.announce is not None:
            self.announce(line)

    # --- lifetime -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Ends the job: its lease is closed (nothing is evicted: the objects stay as they are, on the device
        if they were resident, unusable if they were evicted - restore first if you want to keep them)."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self.orchestrator.drop_residency(self.group, self.name)
            self.orchestrator.close_lease(self.group, self.name)
        except Exception:  # noqa: BLE001 - the orchestrator forgets it within its TTL anyway
            pass

    def describe(self) -> str:
        where = "on the device" if self.resident else "evicted to the host arena"
        names = ", ".join(self.objects) or "(nothing yet)"
        return (
            f"{self.name} on {self.group_id}: {names}; {fmt_bytes(self.nbytes)} {where}; "
            f"{len(self.evictions)} evictions, {len(self.restores)} restores"
        )

    def __repr__(self) -> str:
        return f"ResidentState({self.describe()})"


def _device_of(obj: Any) -> torch.device | None:
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, torch.nn.Module):
        for t in (*obj.parameters(), *obj.buffers()):
            return t.device
    if isinstance(obj, torch.optim.Optimizer):
        for g in obj.param_groups:
            for p in g["params"]:
                return p.device
    if isinstance(obj, dict):
        for v in obj.values():
            if isinstance(v, torch.Tensor):
                return v.device
    return None
