"""`OrchestratorGate`: the kernel's `PhaseGate` backed by the orchestrator (torch-free: callbacks are passed in).

    gate = OrchestratorGate(client, "trainer-group", on_evict=engine_swap.evict, on_restore=engine_swap.restore)
    engine = Engine(home, device, gate=gate)

Every `gate.phase(job_id, kind)` acquires a slice of the group for the job's lease, runs the phase and
releases the slice. Lazy yield: a job's state is evicted (`on_evict(job_id)`) only when another job
waits for the group, and restored (`on_restore(job_id)`) before that job's next phase.

Threading contract for the callbacks: `on_evict` may run on the client's event thread while another
job's phase of the same kernel waits in `acquire` (that phase waits *for* this eviction), so it must not
wait for a lock the waiting phase holds (such as the engine's primitive lock). The gate runs its
callbacks one at a time. `on_restore` must be a no-op for a job whose state is already on the device.

Leases: by default each job has its own lease, named after the job id (`lease_name=None`); a string
with `{job_id}` is a template; any other string makes all jobs of this gate share one lease (one share of
the group); a callable maps job ids to names.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from openrl_lab.orchestrator.client import TimeSliceOrchestratorClient
from openrl_lab.orchestrator.types import Slice


class OrchestratorGate:
    def __init__(self, client: TimeSliceOrchestratorClient, group_id: str,
                 lease_name: str | Callable[[str], str] | None = None,
                 on_evict: Callable[[str], object] | None = None, on_restore: Callable[[str], object] | None = None,
                 *, timeout: float | None = None):
        self.client = client
        self.group_id = group_id
        self.lease_name = lease_name
        self.on_evict = on_evict
        self.on_restore = on_restore
        self.timeout = timeout
        self._lock = threading.RLock()  # callbacks one at a time; guards the sets below
        self._registered: set[str] = set()
        self._resident: dict[str, set[str]] = {}  # lease name -> jobs whose state is on the device
        self._evicted: set[str] = set()  # jobs whose state the gate moved off
        self.evictions = 0
        self.restores = 0

    def lease_for(self, job_id: str) -> str:
        if callable(self.lease_name):
            return self.lease_name(job_id)
        if self.lease_name is None:
            return job_id
        return self.lease_name.format(job_id=job_id) if "{job_id}" in self.lease_name else self.lease_name

    def _register(self, name: str) -> None:
        if name in self._registered:
            return
        with self._lock:
            if name not in self._registered:
                self.client.register(self.group_id, lease=name, on_restore=None,
                                     on_evict=(lambda: self._evict_lease(name)) if self.on_evict else None)
                self._registered.add(name)

    def _evict_lease(self, name: str) -> None:
        with self._lock:
            for job in sorted(self._resident.pop(name, ())):
                self.on_evict(job)
                self._evicted.add(job)
                self.evictions += 1

    @contextlib.contextmanager
    def phase(self, job_id: str, kind: str) -> Iterator[Slice]:
        name = self.lease_for(job_id)
        self._register(name)
        with self.client.on_accelerators(self.group_id, kind=kind, lease=name, timeout=self.timeout) as s:
            if self.on_evict is not None:
                with self._lock:
                    if self.on_restore is not None and (job_id in self._evicted or s.must_restore):
                        t0 = time.perf_counter()
                        self.on_restore(job_id)
                        s.restored = True
                        s.restore_s += time.perf_counter() - t0
                        self.restores += 1
                    self._evicted.discard(job_id)
                    self._resident.setdefault(name, set()).add(job_id)
            yield s

    def forget(self, job_id: str) -> None:
        """The kernel dropped the job: forget its state (and close its own lease, if it had one)."""
        name = self.lease_for(job_id)
        with self._lock:
            self._evicted.discard(job_id)
            jobs = self._resident.get(name)
            if jobs is not None:
                jobs.discard(job_id)
        if name == job_id:
            with contextlib.suppress(Exception):
                self.client.close_lease(self.group_id, name)
            with self._lock:
                self._registered.discard(name)
                self._resident.pop(name, None)
