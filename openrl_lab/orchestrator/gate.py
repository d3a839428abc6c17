"""`OrchestratorGate`: the kernel's `PhaseGate` backed by the orchestrator (torch-free: callbacks are passed in).

    gate = OrchestratorGate(client, "trainer-group", on_evict=engine_swap.evict, on_restore=engine_swap.restore)
    engine = Engine(home, device, gate=gate)

Every `gate.phase(job_id, kind)` (or `gate.phase(job_id, kind, gang=(key, n))` for one rank of a gang job)
acquires a slice of the group for the job's lease, runs the phase and
releases the slice. Lazy yield: a job's state is evicted (`on_evict(job_id)`) only when another job
waits for the group, and restored (`on_restore(job_id)`) before that job's next phase. When the waiting
job runs in another process (another kernel, a user's script), `on_evict_shared()` also runs: the state
this process's jobs share (base models) goes too; a switch between two jobs of this process keeps it.

Threading contract for the callbacks: `on_evict` may run on the client's event thread while another
job's phase of the same kernel waits in `acquire` (that phase waits *for* this eviction), so it must not
wait for a lock the waiting phase holds (such as the engine's primitive lock). The gate runs its
callbacks one at a time. `on_restore` must be a no-op for a job whose state is already on the device.

Leases: by default each job has its own lease, named after the job id (`lease_name=None`); a string
with `{job_id}` is a template; any other string makes all jobs of this gate share one lease (one share of
the group); a callable maps job ids to names. `bind(job_id, owner=..., lease=..., group=...)` overrides
that for one job: its lease is owned by `owner` (created through `client_for(owner)`, a client acting on
the owner's behalf), named `lease` (default: the job id) on `group` (default: the gate's group).

A dropped job's own lease is closed (`forget`), except while the orchestrator sees it as the group's
resident lease: the process may still keep shared state (a base model) on the device under it, so it
stays open until it is asked to evict (that is how another process's waiting job gets the device
back), and is closed at the gate's next phase or forget after that.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from openrl_lab.orchestrator.client import TimeSliceOrchestratorClient
from openrl_lab.orchestrator.types import LeaseEvent, Slice


@dataclass(frozen=True)
class _Binding:
    owner: str  # "" = the gate's own identity
    group: str
    lease: str
    weight: float | None = None
    quota_s: float | None = None
    priority: str | None = None
    bound: bool = False  # set by bind() (else derived from the gate's lease_name)


class OrchestratorGate:
    def __init__(
        self,
        client: TimeSliceOrchestratorClient,
        group_id: str,
        lease_name: str | Callable[[str], str] | None = None,
        on_evict: Callable[[str], object] | None = None,
        on_restore: Callable[[str], object] | None = None,
        *,
        timeout: float | None = None,
        on_evict_shared: Callable[[], object] | None = None,
        client_for: Callable[[str], TimeSliceOrchestratorClient] | None = None,
    ):
        self.client = client
        self.group_id = group_id
        self.lease_name = lease_name
        self.on_evict = on_evict
        self.on_restore = on_restore
        self.on_evict_shared = on_evict_shared
        self.client_for = client_for
        self.timeout = timeout
        self._lock = threading.RLock()  # callbacks one at a time; guards the state below
        self._clients: dict[str, TimeSliceOrchestratorClient] = {"": client}
        self._bindings: dict[str, _Binding] = {}
        self._registered: dict[tuple, tuple] = {}  # (owner, group as asked, lease) -> key (owner, group id, lease)
        self._resident: dict[tuple, set[str]] = {}  # lease key -> jobs whose state is on the device
        self._evicted: set[str] = set()  # jobs whose state the gate moved off
        self._retired: dict[tuple, _Binding] = {}  # lease key -> leases of dropped jobs kept while resident
        self._to_close: dict[tuple, _Binding] = {}  # retired leases evicted since: closed at the next chance
        self.evictions = 0
        self.restores = 0
        self.shared_evictions = 0

    def lease_for(self, job_id: str) -> str:
        return self._binding(job_id).lease

    def bind(
        self,
        job_id: str,
        *,
        owner: str | None = None,
        lease: str | None = None,
        group: str | None = None,
        weight: float | None = None,
        quota_s: float | None = None,
        priority: str | None = None,
    ) -> None:
        """Job `job_id`'s phases run under a lease owned by `owner` (default: the gate's own identity), named
        `lease` (default: the job id), on `group` (default: the gate's group), with `weight`, `quota_s` and
        `priority` (interactive | batch) where given."""
        if owner and self.client_for is None:
            raise ValueError(f"this gate cannot act on behalf of {owner!r}: make it with client_for=...")
        with self._lock:
            self._bindings[job_id] = _Binding(
                owner or "", group or self.group_id, lease or job_id, weight, quota_s, priority, True
            )

    def _binding(self, job_id: str) -> _Binding:
        b = self._bindings.get(job_id)
        if b is not None:
            return b
        if callable(self.lease_name):
            name = self.lease_name(job_id)
        elif self.lease_name is None:
            name = job_id
        else:
            name = self.lease_name.format(job_id=job_id) if "{job_id}" in self.lease_name else self.lease_name
        return _Binding("", self.group_id, name)

    def lease_of(self, job_id: str) -> tuple[str, str, str]:
        """The lease a job's phases run under: (owner, group, name)."""
        b = self._binding(job_id)
        return (b.owner, b.group, b.lease)

    def _client(self, owner: str) -> TimeSliceOrchestratorClient:
        with self._lock:
            c = self._clients.get(owner)
            if c is None:
                assert self.client_for is not None  # bind() refuses an owner without it; "" is self.client
                c = self._clients[owner] = self.client_for(owner)
            return c

    def _register(self, b: _Binding) -> tuple:
        """The lease's key (owner, group id, name), creating the lease and its evict hook the first time."""
        asked = (b.owner, b.group, b.lease)
        key = self._registered.get(asked)
        if key is not None and key not in self._retired and key not in self._to_close:
            return key
        with self._lock:
            if key is not None:  # a dropped job's lease, in use again
                self._retired.pop(key, None)
                self._to_close.pop(key, None)
                return key
            if asked not in self._registered:
                client = self._client(b.owner)
                if b.weight is not None or b.quota_s is not None or b.priority is not None:
                    client.lease(b.group, b.lease, weight=b.weight, quota_s=b.quota_s, priority=b.priority)
                box: list[tuple] = []
                info = client.register(
                    b.group,
                    lease=b.lease,
                    on_restore=None,
                    on_evict=(lambda ev: self._evict_lease(box[0], ev)) if self.on_evict else None,
                )
                box.append((b.owner, info.group_id, b.lease))
                self._registered[asked] = box[0]
            return self._registered[asked]

    def _evict_lease(self, key: tuple, ev: LeaseEvent) -> None:
        with self._lock:
            for job in sorted(self._resident.pop(key, ())):
                assert self.on_evict is not None  # jobs are resident here only with an on_evict (see phase)
                self.on_evict(job)
                self._evicted.add(job)
                self.evictions += 1
            if key in self._retired:
                self._to_close[key] = self._retired.pop(key)
            if self.on_evict_shared is not None and not ev.waiter_same_process:
                self.on_evict_shared()  # the waiter is another process: what this one's jobs share goes too
                self.shared_evictions += 1

    @contextlib.contextmanager
    def phase(self, job_id: str, kind: str, gang: tuple[str, int] | None = None) -> Iterator[Slice]:
        """Runs one phase of the job in a slice of its group. `gang` (key, number of ranks): the job is one rank
        of a gang job and this is that rank's slice of the gang phase `key`, granted together with the other
        ranks' slices on their groups (each rank's gate names the same key); a gang phase that cannot be
        granted raises FailedPrecondition naming the gang."""
        if self._to_close:
            self._close_retired()
        b = self._binding(job_id)
        key = self._register(b)
        client = self._client(b.owner)
        gang_key, gang_size = gang if gang is not None else ("", 0)
        with client.on_accelerators(
            b.group, kind=kind, lease=b.lease, timeout=self.timeout, gang=gang_key, gang_size=gang_size
        ) as s:
            if self.on_evict is not None:
                with self._lock:
                    if self.on_restore is not None and (job_id in self._evicted or s.must_restore):
                        t0 = time.perf_counter()
                        self.on_restore(job_id)
                        s.restored = True
                        s.restore_s += time.perf_counter() - t0
                        self.restores += 1
                    self._evicted.discard(job_id)
                    self._resident.setdefault(key, set()).add(job_id)
            yield s

    def adopt(self, job_id: str, within: str) -> None:
        """`job_id`'s state came onto the device in a phase of job `within` (a fork's copy, made while `within`
        runs): its own lease exists from now on (listed, with its class, before its first phase), and until that
        phase its state leaves the device with `within`'s lease, since it takes device memory that the group's
        next job may need (its first phase then restores it)."""
        self._register(self._binding(job_id))
        if self.on_evict is None:
            return
        b = self._binding(within)
        with self._lock:
            key = self._registered.get((b.owner, b.group, b.lease))
            if key is not None:
                self._resident.setdefault(key, set()).add(job_id)

    def forget(self, job_id: str) -> None:
        """The kernel dropped the job: forget its state and binding, and close its lease if no other job of
        this gate uses it (a lease of the gate's own shared name stays)."""
        with self._lock:
            b = self._bindings.pop(job_id, None) or self._binding(job_id)
            key = self._registered.get((b.owner, b.group, b.lease))
            self._evicted.discard(job_id)
            if key is not None and (jobs := self._resident.get(key)) is not None:
                jobs.discard(job_id)
            own = (
                b.lease == job_id
                if not b.bound
                else not any(
                    (o.owner, o.group, o.lease) == (b.owner, b.group, b.lease) for o in self._bindings.values()
                )
            )
            if own and key is not None and key in self._resident:
                self._retired[key] = b  # the group's resident lease: closed once it was asked to evict
                own = False
        if self._to_close:
            self._close_retired()
        if own:
            self._close(b, key)

    def _close(self, b: _Binding, key: tuple | None) -> None:
        with contextlib.suppress(Exception):
            self._client(b.owner).close_lease(b.group, b.lease)
        with self._lock:
            self._registered.pop((b.owner, b.group, b.lease), None)
            if key is not None:
                self._resident.pop(key, None)

    def _close_retired(self) -> None:
        with self._lock:
            done, self._to_close = self._to_close, {}
        for key, b in done.items():
            self._close(b, key)

    def close(self) -> None:
        """Closes the clients this gate made on users' behalf (not the one it was given)."""
        with self._lock:
            clients = [c for owner, c in self._clients.items() if owner]
            self._clients = {"": self.client}
        for c in clients:
            c.close()
