"""One job's swappable device state, moved to a host arena and back when the orchestrator says so.

A `SwapSet` names what is a job's own: parameters and buffers of modules (all, or those whose name matches a
filter, so jobs that share a base model swap only their adapter), optimizers (their state is re-read at every
eviction: AdamW creates it lazily on the first step) and loose tensors (sampler snapshots...).

`evict()` copies the bytes of every registered tensor into the set's `HostArena` and rebinds each tensor
(`tensor.data = ...`) to a placeholder that holds no memory, so the device memory is freed.
`restore()` allocates device memory, copies the bytes back and rebinds the SAME tensor objects: optimizers
keep their references to the Parameters, and the values are bit for bit the same.

Packed (the default): restore puts the set's tensors into ONE device buffer (gradients, which come and go,
into a second), as views at 256-byte aligned offsets, and keeps those views. While nothing changes, the next
eviction is one copy of that buffer and the next restore one copy back, with one `.data` rebind per tensor
and no planning (the per-copy overhead costs ~30% with many small tensors on a GPU). `pack()` does the same
on a resident set without a round trip through the host. `packed=False` copies tensor by tensor.

While evicted, a tensor keeps its dtype, shape and device, but its data is one NaN (or sentinel) element
broadcast over its shape: the forward of a registered module and the step of a registered optimizer raise
`SwapStateError`; reading a loose tensor gives NaNs, writing to it raises. Gradients present at eviction are
swapped too (a slice can end between forward_backward and optim_step), so they need not be zeroed first.
Nothing registered may be changed while evicted.

Memory that something outside the set still refers to (an alias like `p.detach()` kept somewhere, the base
of a registered view) cannot be freed: `SwapStats.retained_bytes` says how much, with a RuntimeWarning.

Copies are issued first and waited for once, the bookkeeping runs meanwhile: on CUDA on a side stream per
direction (non_blocking, into pinned memory) with one synchronize per evict or restore, and `switch(a, b)`
runs A's eviction and B's restore at the same time on the two copy engines; on a CPU "device" in a worker
thread. Every moved byte is counted (`SwapSet.counters`, `global_counters()`), so tests can assert that
nothing moves when nobody waits.
"""

from __future__ import annotations

import ctypes
import gc
import operator
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from openrl_lab.swap.arena import HostArena
from openrl_lab.swap.layout import (
    ALIGN,
    STATE,
    Packed,
    Plan,
    SwapStateError,
    align,
    bytes_of,
    own,
    placeholder,
    plan,
)

CPU_THREAD_MIN_BYTES = 1 << 20  # on a CPU device, copies at least this big run in a worker thread


@dataclass(frozen=True)
class SwapStats:
    """What one evict, restore or pack did."""

    direction: str  # "evict" | "restore" | "pack"
    bytes_moved: int  # bytes of registered tensors copied (alignment padding not counted)
    tensors: int  # tensors moved (distinct tensor objects)
    copies: int  # copy calls issued: 1 per buffer when packed
    seconds: float  # wall time of the whole operation, bookkeeping included
    retained_bytes: int = 0  # evict: device bytes still held by references from outside the set

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass
class SwapCounters:
    """Totals over a set's life (or the process's, from `global_counters()`)."""

    evictions: int = 0
    restores: int = 0
    bytes_evicted: int = 0
    bytes_restored: int = 0
    bytes_retained: int = 0  # evicted, but still referenced from outside the set: they stayed on the device
    seconds: float = 0.0

    @property
    def bytes_moved(self) -> int:
        return self.bytes_evicted + self.bytes_restored

    def _add(self, stats: SwapStats) -> None:
        if stats.direction == "evict":
            self.evictions += 1
            self.bytes_evicted += stats.bytes_moved
            self.bytes_retained += stats.retained_bytes
        else:
            self.restores += 1
            self.bytes_restored += stats.bytes_moved
        self.seconds += stats.seconds


_GLOBAL = SwapCounters()
_GLOBAL_LOCK = threading.Lock()


def global_counters() -> SwapCounters:
    """A copy of the process-wide totals of every SwapSet."""
    with _GLOBAL_LOCK:
        return replace(_GLOBAL)


# ------------------------------------------------------------------------------------------- copies

_STREAMS: dict[tuple, object] = {}
_CPU_POOL: list[ThreadPoolExecutor] = []


def _run(jobs: list) -> None:
    for dst, src in jobs:
        _cpu_copy(dst, src)
    jobs.clear()  # before the future resolves: the worker's work item must not keep the memory alive


def _cpu_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A CPU copy as one memmove (ctypes releases the GIL; numpy's view would pin the storage's size). Not
    `copy_`: a big copy_ starts an OpenMP team for the calling thread, and a worker or event thread with its
    own team next to the compute thread's oversubscribes the cores for good (measured: every later training
    step 2.5x slower on 2 cores)."""
    if dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
    else:
        dst.copy_(src)


class _Copier:
    """Copies collected, then issued at once without waiting, then waited for once: a side stream per
    direction on CUDA (so an eviction and a restore can overlap), a worker thread on a CPU device."""

    def __init__(self, device: torch.device, direction: str):
        self.device, self.direction = device, direction
        self.jobs: list = []
        self.count = 0
        self.stream = None
        self.futures: list = []

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.jobs.append((dst, src))
        self.count += 1

    def launch(self) -> None:
        jobs, self.jobs = self.jobs, []
        if not jobs:
            return
        if self.device.type == "cuda":
            key = (self.device, self.direction)
            if key not in _STREAMS:
                _STREAMS[key] = torch.cuda.Stream(device=self.device)
            self.stream = _STREAMS[key]
            # Wait for what the compute stream did to these bytes (last writes, or earlier use of new memory).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for dst, src in jobs:
                    dst.copy_(src, non_blocking=True)
        elif sum(d.nbytes for d, _ in jobs) >= CPU_THREAD_MIN_BYTES:
            if not _CPU_POOL:
                _CPU_POOL.append(ThreadPoolExecutor(1, thread_name_prefix="openrl-swap-copy"))
            self.futures.append(_CPU_POOL[0].submit(_run, jobs))
        else:
            _run(jobs)

    def wait(self) -> None:
        self.launch()
        if self.stream is not None:
            self.stream.synchronize()
        for f in self.futures:
            f.result()
        self.futures.clear()


@dataclass
class _Evicted:
    """A set's state while evicted: a packed state buffer (arena offset 0) and/or planned groups after it."""

    packed: Packed | None
    plan: Plan
    payload: int
    tensors: int


@dataclass
class _Op:
    """An evict or restore whose copies are issued and not yet waited for."""

    direction: str
    t0: float
    copier: _Copier
    evicted: _Evicted
    keep: list = field(default_factory=list)  # device memory that must live until the copies are done
    cache: Packed | None = None  # restore: the packed state buffer afterwards


def _normalize(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _on_device(device: torch.device) -> Callable[[torch.Tensor], bool]:
    """A fast test for 'a non-empty tensor on this device' (tensors elsewhere are not device memory)."""
    if device.type == "cpu":
        return lambda t: t.is_cpu and t.numel() > 0
    if device.type == "cuda":
        index = device.index
        return lambda t: t.is_cuda and t.get_device() == index and t.numel() > 0
    return lambda t: t.device == device and t.numel() > 0


# ------------------------------------------------------------------------------------------ SwapSet

Filter = Callable[[str], bool]


class SwapSet:
    """One job's swappable device state: register it, then evict() and restore() it when told."""

    def __init__(self, name: str, device: torch.device | str, *, packed: bool = True, arena: HostArena | None = None):
        self.name = name
        self.device = _normalize(device)
        self.packed = packed
        self.arena = arena if arena is not None else HostArena(pin=self.device.type == "cuda")
        self.counters = SwapCounters()
        self._lock = threading.RLock()
        self._on = _on_device(self.device)
        self._params: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (name, parameter or buffer)
        self._optimizers: list[Callable[[], torch.optim.Optimizer]] = []
        self._tensor_dicts: list[tuple[str, dict]] = []
        self._evicted: _Evicted | None = None
        self._cache: Packed | None = None  # the packed state buffer while resident
        self._last: tuple[list, list] | None = None  # (state objects, state entries) of the last collect
        self._guarded: weakref.WeakSet = weakref.WeakSet()
        self._handles: list = []

    # ---- registration

    def add_module(self, module: nn.Module, params_only_matching: Filter | None = None, *, prefix: str = "") -> int:
        """Register a module's parameters and buffers (named as in `named_parameters()`, after `prefix`),
        only those whose name passes the filter if one is given. Returns how many were registered.

        The names are resolved now: register again after adding parameters to the module. Each
        submodule that directly owns a registered tensor refuses to run its forward while evicted."""
        with self._lock:
            self._check_resident("register a module")
            count = on_device = 0
            for mod_name, mod in module.named_modules(prefix=prefix.rstrip(".")):
                owned = False
                for tensors in (mod._parameters, mod._buffers):
                    for key, t in tensors.items():
                        if t is None:
                            continue
                        full = f"{mod_name}.{key}" if mod_name else key
                        if params_only_matching is not None and not params_only_matching(full):
                            continue
                        owned = True
                        if id(t) not in self._params:
                            self._params[id(t)] = (full, t)
                            count += 1
                            on_device += t.device == self.device
                if owned:
                    self._guard_module(mod)
            if count == 0 and params_only_matching is not None:
                raise ValueError(
                    f"SwapSet {self.name!r}: no parameter or buffer of {type(module).__name__} matches the filter"
                )
            if count and not on_device:
                raise ValueError(
                    f"SwapSet {self.name!r}: none of the {count} tensors of {type(module).__name__} is on {self.device}"
                )
            return count

    def add_optimizer(self, optimizer: torch.optim.Optimizer | Callable[[], torch.optim.Optimizer]) -> None:
        """Register an optimizer's state tensors (re-read at every eviction). Pass a zero-argument callable
        instead if the job may replace its optimizer object (e.g. on load)."""
        with self._lock:
            self._check_resident("register an optimizer")
            if isinstance(optimizer, torch.optim.Optimizer):
                self._optimizers.append(lambda opt=optimizer: opt)
                self._guard_optimizer(optimizer)
            elif callable(optimizer):
                self._optimizers.append(optimizer)
            else:
                raise TypeError(
                    f"add_optimizer takes a torch.optim.Optimizer or a callable returning one, "
                    f"got {type(optimizer).__name__}"
                )

    def add_tensors(self, named: dict[str, torch.Tensor], *, prefix: str = "tensors") -> None:
        """Register loose tensors. The dict is kept and re-read at every eviction; its tensors are
        rebound in place, so whoever holds them sees the restored values."""
        with self._lock:
            self._check_resident("register tensors")
            if not isinstance(named, dict):
                raise TypeError(f"add_tensors takes a dict of name -> tensor, got {type(named).__name__}")
            self._tensor_dicts.append((prefix, named))

    # ---- state

    @property
    def resident(self) -> bool:
        return self._evicted is None

    @property
    def nbytes(self) -> int:
        """Bytes an eviction moves now (resident) or a restore will move (evicted)."""
        with self._lock:
            if self._evicted is not None:
                return self._evicted.payload
            return self._plan(*self._collect()).payload

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every registered non-empty tensor on the set's device now (grads and optimizer state included)."""
        with self._lock:
            state, grads = self._collect()
            return {self._name_of(label): t for t, label in state + grads}

    def reserve(self, nbytes: int | None = None) -> int:
        """Allocate the host arena ahead of the first eviction (default: the state now, plus the gradients
        its trainable parameters may have then). Returns the arena's capacity."""
        with self._lock:
            if nbytes is None:
                nbytes = self._evicted.plan.end if self._evicted is not None else self._plan(*self._collect()).end
                nbytes += (
                    sum(
                        align(p.nbytes)
                        for _, p in self._params.values()
                        if p.requires_grad and p.grad is None and self._on(p)
                    )
                    + ALIGN
                )
            self.arena.reserve(nbytes)
            return self.arena.capacity

    # ---- the operations

    def evict(self) -> SwapStats:
        """Copy every registered tensor to the host arena and free its device memory."""
        with self._lock:
            return self._finish(self._begin_evict())

    def restore(self) -> SwapStats:
        """Allocate device memory, copy the bytes back, rebind the same tensor objects."""
        with self._lock:
            return self._finish(self._begin_restore())

    def pack(self) -> SwapStats:
        """On a resident set: move every registered tensor into one device buffer (gradients into a second),
        so that the next eviction is a single copy. No bytes cross to the host."""
        with self._lock:
            self._check_resident("pack it")
            t0 = time.perf_counter()
            self._cache = None
            p = self._plan(*self._collect())
            buffers, copies = [], 0
            for g in p.groups:
                buf = torch.empty(g.nbytes, dtype=torch.uint8, device=self.device)
                for r in g.runs:  # device to device, in stream order: nothing to wait for
                    dst, src = buf[r.dst : r.dst + r.nbytes], bytes_of(r.storage, r.src, r.nbytes, self.device)
                    _cpu_copy(dst, src) if self.device.type == "cpu" else dst.copy_(src)
                    copies += 1
                buffers.append(buf)
            own(buffers)
            for g, buf in zip(p.groups, buffers):
                packed = Packed.make(g, buf)
                packed.rebind()
                if g.name == STATE:
                    packed.settle()
                    self._cache = packed
            return SwapStats("pack", p.payload, p.tensors, copies, time.perf_counter() - t0)

    def close(self) -> None:
        """Forget every registration, remove the guards, free the arena. Evicted state is dropped."""
        with self._lock:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._params.clear()
            self._optimizers.clear()
            self._tensor_dicts.clear()
            self._evicted = self._cache = self._last = None
            self.arena.release()

    def __repr__(self) -> str:
        state = "resident" if self._evicted is None else f"evicted, {self._evicted.payload} bytes in the arena"
        return f"SwapSet({self.name!r}, {self.device}, {state}, packed={self.packed})"

    # ---- internals: what is registered

    def _check_resident(self, what: str) -> None:
        if self._evicted is not None:
            raise SwapStateError(f"SwapSet {self.name!r} is evicted: restore() it before you {what}")

    def _guard_module(self, module: nn.Module) -> None:
        self._guard(module, module.register_forward_pre_hook, "run")

    def _guard_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self._guard(opt, opt.register_step_pre_hook, "step")

    def _guard(self, obj, register_pre_hook: Callable, verb: str) -> None:
        """A pre-hook on `obj` (a module's forward, an optimizer's step) that refuses while the set is evicted."""
        if obj in self._guarded:
            return
        ref = weakref.ref(self)  # the hook must not keep the set alive

        def refuse_while_evicted(target, *args):
            s = ref()
            if s is not None and s._evicted is not None:
                raise SwapStateError(
                    f"SwapSet {s.name!r} is evicted: its {type(target).__name__} cannot {verb} until restore()"
                )

        self._handles.append(register_pre_hook(refuse_while_evicted))
        self._guarded.add(obj)

    def _collect(self) -> tuple[list, list]:
        """(state, grads): (tensor, label) of every registered non-empty tensor on the device, each once.

        The state part is reused when the registered objects are the very same as last time (one identity
        test per object); gradients are looked up every time."""
        vals = self._state_objects()
        last = self._last
        if last is not None and len(last[0]) == len(vals) and all(map(operator.is_, vals, last[0])):
            state = last[1]
        else:
            state = self._collect_state()
            self._last = (vals, state)
        on = self._on
        grads = [(g, (1, name)) for name, p in self._params.values() if (g := p.grad) is not None and on(g)]
        return state, grads

    def _state_objects(self) -> list:
        """Everything the state part is made of, in order: registered tensors, optimizers and their state
        values, tensor dicts and their values."""
        vals = [t for _, t in self._params.values()]
        for i, get in enumerate(self._optimizers):
            opt = get()
            if opt not in self._guarded:
                if not isinstance(opt, torch.optim.Optimizer):
                    raise TypeError(f"SwapSet {self.name!r}: optimizer getter {i} returned {type(opt).__name__}")
                self._guard_optimizer(opt)
            vals.append(opt)
            for st in opt.state.values():
                vals.extend(st.values())
        for _, named in self._tensor_dicts:
            vals.append(named)
            vals.extend(named.values())
        return vals

    def _collect_state(self) -> list:
        on, seen, state = self._on, set(), []
        for name, p in self._params.values():
            if on(p) and id(p) not in seen:
                seen.add(id(p))
                state.append((p, (0, name)))
        for i, get in enumerate(self._optimizers):
            opt = get()
            for p, st in opt.state.items():
                for key, v in st.items():
                    if isinstance(v, torch.Tensor) and on(v) and id(v) not in seen:
                        seen.add(id(v))
                        state.append((v, (2, i, opt, p, key)))
        for prefix, named in self._tensor_dicts:
            for key, v in named.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"SwapSet {self.name!r}: {prefix}[{key!r}] is {type(v).__name__}, not a tensor")
                if on(v) and id(v) not in seen:
                    seen.add(id(v))
                    state.append((v, (3, prefix, key)))
        return state

    def _name_of(self, label: tuple) -> str:
        kind = label[0]
        if kind == 0:
            return label[1]
        if kind == 1:
            return label[1] + ".grad"
        if kind == 2:
            _, i, opt, p, key = label
            pname = self._params.get(id(p), (None,))[0]
            if pname is None:
                order = [id(q) for grp in opt.param_groups for q in grp["params"]]
                pname = f"param{order.index(id(p))}" if id(p) in order else "param?"
            return f"optimizer{i}.{pname}.{key}"
        return f"{label[1]}.{label[2]}"

    def _plan(self, state: list, grads: list, start: int = 0) -> Plan:
        return plan(state, grads, start, self._name_of, self.name, coalesce=self.packed)

    # ---- internals: copies

    def _begin_evict(self) -> _Op:
        if self._evicted is not None:
            raise SwapStateError(f"SwapSet {self.name!r} is already evicted")
        t0 = time.perf_counter()
        copier = _Copier(self.device, "d2h")
        cache = self._cache if self.packed else None
        if cache is not None:  # optimistic: the packed buffer starts moving before anything is checked
            self.arena.reserve(cache.nbytes)
            copier.add(self.arena.buffer[: cache.nbytes], cache.flat)
            copier.launch()
        state, grads = self._collect()
        if cache is not None and not (
            len(state) == len(cache.tensors) and {id(t) for t, _ in state} == cache.ids and cache.unchanged()
        ):
            copier.wait()  # something was added, removed or rebound: plan from scratch
            copier = _Copier(self.device, "d2h")
            self._cache = cache = None
        # With the packed state buffer at the start of the arena, only the gradients need a plan.
        rest = self._plan([], grads, cache.nbytes) if cache is not None else self._plan(state, grads)
        if self.arena.reserve(rest.end) and cache is not None:  # the arena grew: its old copy is gone
            copier.wait()
            copier = _Copier(self.device, "d2h")
            copier.add(self.arena.buffer[: cache.nbytes], cache.flat)
        host = self.arena.buffer
        op = _Op(
            "evict",
            t0,
            copier,
            _Evicted(
                cache,
                rest,
                rest.payload + (cache.payload if cache else 0),
                rest.tensors + (len(cache.tensors) if cache else 0),
            ),
        )
        for g in rest.groups:
            for r in g.runs:
                src = bytes_of(r.storage, r.src, r.nbytes, self.device)
                copier.add(host[g.base + r.dst : g.base + r.dst + r.nbytes], src)
                op.keep.append(src)  # the memory must outlive the copy: dropped after the wait
        copier.launch()
        # Rebinding runs while the bytes move; the memory stays alive until the wait (op.keep, cache.flat).
        if cache is not None:
            cache.evict_tensors()
        for g in rest.groups:
            for s in g.slots:
                s.tensor.data = placeholder(s.dtype, s.shape, self.device)
        return op

    def _begin_restore(self) -> _Op:
        if self._evicted is None:
            raise SwapStateError(f"SwapSet {self.name!r} is resident: there is nothing to restore")
        t0 = time.perf_counter()
        ev = self._evicted
        host = self.arena.buffer
        op = _Op("restore", t0, _Copier(self.device, "h2d"), ev)
        if ev.packed is not None:  # allocate on the compute stream: the memory belongs to it afterwards
            ev.packed.realloc()
            op.copier.add(ev.packed.flat, host[: ev.packed.nbytes])
        made = []  # (group, run index or None, device buffer)
        for g in ev.plan.groups:
            if self.packed:
                buf = torch.empty(g.nbytes, dtype=torch.uint8, device=self.device)
                op.copier.add(buf, host[g.base : g.base + g.nbytes])
                made.append((g, None, buf))
            else:
                for i, r in enumerate(g.runs):
                    buf = torch.empty(align(r.nbytes, 16), dtype=torch.uint8, device=self.device)
                    op.copier.add(buf[: r.nbytes], host[g.base + r.dst : g.base + r.dst + r.nbytes])
                    made.append((g, i, buf))
        own(buf for _, _, buf in made)
        op.copier.launch()
        # Rebind while the bytes move: nothing computes on these tensors before the wait.
        op.cache = ev.packed
        if ev.packed is not None:
            ev.packed.rebind()
        if self.packed:
            for g, _, buf in made:
                packed = Packed.make(g, buf)
                packed.rebind()
                if g.name == STATE:
                    op.cache = packed
        else:
            bufs = {(id(g), i): buf for g, i, buf in made}
            for g in ev.plan.groups:
                for s in g.slots:
                    r = g.runs[s.run]
                    storage = bufs[(id(g), s.run)].untyped_storage()
                    s.tensor.data = torch.empty(0, dtype=s.dtype, device=self.device).set_(
                        storage, (s.offset - r.dst) // s.dtype.itemsize, s.shape, s.stride
                    )
        op.keep = [buf for _, _, buf in made]
        return op

    def _finish(self, op: _Op) -> SwapStats:
        op.copier.wait()
        ev = op.evicted
        retained = 0
        if op.direction == "evict":
            self._cache = None
            alive = self._release(ev.plan, op)
            # (not freed: there is a packed buffer; no local names it, that would hold it)
            freed = ev.packed is None or ev.packed.free()
            if alive or not (freed or (ev.packed is not None and ev.packed.base_refs is None)):  # maybe garbage
                gc.collect()  # in a reference cycle: collect it and look again
                alive = [ref for ref in alive if ref() is not None]
                freed = freed or (ev.packed is not None and ev.packed.free())
            if not freed:  # someone outside the set holds the packed buffer: the restore builds a new one
                packed, ev.packed = ev.packed, None
                assert packed is not None
                alive.append(weakref.ref(packed.flat.untyped_storage()))
                packed.group.base = 0
                ev.plan.groups.insert(0, packed.group)
                del packed
            retained = sum(st.nbytes() for st in (ref() for ref in alive) if st is not None)
            self._evicted = ev
        else:
            self._evicted, self._cache = None, op.cache if self.packed else None
            op.keep.clear()
            if self._cache is not None:
                self._cache.settle()
        stats = SwapStats(op.direction, ev.payload, ev.tensors, op.copier.count, time.perf_counter() - op.t0, retained)
        self.counters._add(stats)
        with _GLOBAL_LOCK:
            _GLOBAL._add(stats)
        if retained:
            warnings.warn(
                f"SwapSet {self.name!r}: {retained} bytes of evicted state are still referenced from "
                f"outside the set and stay allocated on {self.device}",
                RuntimeWarning,
                stacklevel=3,
            )
        return stats

    @staticmethod
    def _release(p: Plan, op: _Op) -> list:
        """Drop the set's last references to evicted memory; weak references to what is still alive."""
        refs = {}
        for g in p.groups:
            for r in g.runs:
                if r.storage is not None:
                    refs[id(r.storage)] = weakref.ref(r.storage)
                    r.storage = None
        op.keep.clear()
        return [ref for ref in refs.values() if ref() is not None]


def switch(out: SwapSet, into: SwapSet) -> tuple[SwapStats, SwapStats]:
    """Evict `out` and restore `into` (a tenant switch). On CUDA both copies run at once on separate copy
    engines, so the device briefly holds both states; on a CPU device they run one after the other."""
    if out is into:
        raise ValueError("switch needs two different SwapSets")
    first, second = sorted((out, into), key=id)  # one lock order for every pair
    with first._lock, second._lock:
        if into._evicted is None:
            raise SwapStateError(f"SwapSet {into.name!r} is resident: there is nothing to restore")
        if out._evicted is not None:
            raise SwapStateError(f"SwapSet {out.name!r} is already evicted")
        if out.device.type == "cuda" or into.device.type == "cuda":
            r = into._begin_restore()
            try:
                e = out._begin_evict()
            except BaseException:
                into._finish(r)
                raise
            return out._finish(e), into._finish(r)
        e = out._finish(out._begin_evict())  # CPU: free first, so that the restore can reuse the memory
        return e, into._finish(into._begin_restore())


__all__ = ["ALIGN", "SwapCounters", "SwapSet", "SwapStateError", "SwapStats", "global_counters", "switch"]
