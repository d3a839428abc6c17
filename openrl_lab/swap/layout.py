"""Where swapped bytes go: tensors grouped by storage, merged into copy runs, laid out in aligned buffers.

A *plan* takes the tensors to move, groups them by the storage they view, merges each storage's registered
byte ranges into runs (one copy each) and gives every run an aligned place inside its group's buffer: the
same offsets in the host arena and, when packed, in the device buffer made at restore. A *packed* buffer is
such a device buffer that a SwapSet made and keeps a view per tensor of: while nothing changes, evicting and
restoring it is one copy and one `.data` rebind per tensor, with no planning.

An evicted tensor is rebound to a *placeholder*: one element (NaN for floats) broadcast over its shape, on
its device, with its dtype. It holds no memory, reads as NaN and refuses in-place writes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

ALIGN = 256  # byte alignment of every tensor in a packed buffer and in the arena (CUDA, MKL and cuBLAS like it)
COALESCE_GAP = 4096  # registered ranges of one storage closer than this are copied as one range, gap included
STATE, GRADS = "state", "grads"  # gradients get their own buffer: they come and go with every step


class SwapStateError(RuntimeError):
    """A swap operation, or a use of swapped state, that does not fit the set's current state."""


def align(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


# ------------------------------------------------------------------------------------- placeholders

_SENTINELS: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> a 0-d tensor holding NaN (or a sentinel)
SENTINEL_PTRS: set[int] = set()
_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}  # (dtype, device, shape) -> the sentinel expanded to shape


def _sentinel(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (dtype, device)
    s = _SENTINELS.get(key)
    if s is None:
        if dtype.is_floating_point or dtype.is_complex:
            try:
                s = torch.full((), float("nan"), dtype=dtype, device=device)
            except (RuntimeError, TypeError):  # a dtype without NaN
                s = torch.zeros((), dtype=dtype, device=device)
        elif dtype == torch.bool:
            s = torch.zeros((), dtype=dtype, device=device)
        else:
            s = torch.full((), torch.iinfo(dtype).max, dtype=dtype, device=device)
        _SENTINELS[key] = s
        SENTINEL_PTRS.add(s.untyped_storage().data_ptr())
    return s


def placeholder(dtype: torch.dtype, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """A tensor of this dtype, shape and device with one element of memory: what an evicted tensor holds."""
    key = (dtype, device, shape)
    ph = _PLACEHOLDERS.get(key)
    if ph is None:
        ph = _PLACEHOLDERS[key] = _sentinel(dtype, device).expand(shape)
    return ph


# ---------------------------------------------------------------------------------- owned buffers

_OWNED: dict[int, weakref.ref] = {}  # data_ptr -> storage of a buffer some SwapSet allocated


def own(buffers) -> None:
    """Remember buffers allocated here: they may be swapped although not all their bytes belong to registered
    tensors (alignment padding, slots of tensors dropped since, a set closed while packed)."""
    for b in buffers:
        ptr = b.data_ptr()

        def forget(ref, ptr=ptr):
            if _OWNED.get(ptr) is ref:
                del _OWNED[ptr]

        _OWNED[ptr] = weakref.ref(b.untyped_storage(), forget)


def is_owned(storage) -> bool:
    ref = _OWNED.get(storage.data_ptr())
    return ref is not None and ref() is storage


def bytes_of(storage, start: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 view of [start, start+nbytes) of an untyped storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (nbytes,), (1,))


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def use_count(storage) -> int | None:
    """How many tensors and handles share this storage (None where torch does not say)."""
    return _storage_use_count(storage._cdata) if _storage_use_count is not None else None


# ------------------------------------------------------------------------------------------- plans


@dataclass
class Run:
    """One contiguous byte range copied in one call: [src, src+nbytes) of a storage -> [dst, ...) of its group."""

    storage: object  # torch.UntypedStorage until the copy is done; None afterwards
    src: int
    nbytes: int
    dst: int
    payload: int  # registered bytes inside the range (coalesced gaps excluded)


@dataclass
class Slot:
    """Where one tensor lives inside its group."""

    tensor: torch.Tensor
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple
    offset: int  # byte offset of the tensor's storage_offset element inside the group (or its run's buffer)
    run: int  # index of its run in the group


@dataclass
class Group:
    name: str  # STATE | GRADS
    runs: list[Run] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    nbytes: int = 0  # aligned size of the group's buffer
    base: int = 0  # where the group starts in the arena

    @property
    def payload(self) -> int:
        return sum(r.payload for r in self.runs)


@dataclass
class Plan:
    groups: list[Group]
    end: int  # arena bytes needed, up to the end of the last group
    payload: int
    tensors: int


Entry = tuple  # (tensor, label): the label is only formatted into a name when an error needs one


def plan(state: list[Entry], grads: list[Entry], start: int, name_of, set_name: str, coalesce: bool = True) -> Plan:
    """Lay out tensors (all on the set's device, non-empty) in the arena from byte `start` on. Without
    `coalesce`, only tensors that overlap or touch share a run (per-tensor mode: one buffer each)."""
    gap = COALESCE_GAP if coalesce else 0
    storages: dict[int, list] = {}  # data_ptr -> [storage, group, [(start, end, tensor, label)]]
    for group, entries in ((STATE, state), (GRADS, grads)):
        for t, label in entries:
            if t.layout is not torch.strided:
                raise SwapStateError(
                    f"SwapSet {set_name!r}: {name_of(label)} has layout {t.layout}; only strided tensors can be swapped"
                )
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr in SENTINEL_PTRS:
                raise SwapStateError(
                    f"SwapSet {set_name!r}: {name_of(label)} is evicted by another SwapSet (is it "
                    f"registered in two sets?)"
                )
            isz = t.element_size()
            lo = t.storage_offset() * isz
            hi = lo + isz * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
            if hi > st.nbytes():
                raise SwapStateError(
                    f"SwapSet {set_name!r}: {name_of(label)} has no memory behind it "
                    f"(storage {st.nbytes()} bytes, needs {hi})"
                )
            rec = storages.get(ptr)
            if rec is None:
                storages[ptr] = [st, group, [(lo, hi, t, label)]]
            else:
                if group == STATE:
                    rec[1] = STATE
                rec[2].append((lo, hi, t, label))

    groups = {STATE: Group(STATE), GRADS: Group(GRADS)}
    cursor = {STATE: 0, GRADS: 0}
    payload = tensors = 0
    for st, gname, spans in storages.values():
        spans.sort(key=lambda s: s[0])
        owned = is_owned(st)
        # Merged [lo, hi) ranges. Tensors that merely touch stay apart only in a buffer made here, per tensor.
        touch = 0 if coalesce or not owned else 1
        union = []
        for lo, hi, _, _ in spans:
            if union and lo <= union[-1][1] - touch:
                union[-1][1] = max(union[-1][1], hi)
            else:
                union.append([lo, hi])
        if (len(union) != 1 or union[0] != [0, st.nbytes()]) and not owned:
            raise SwapStateError(
                f"SwapSet {set_name!r}: {name_of(spans[0][3])} shares its memory with tensors outside the set "
                f"(a view of a larger tensor?); register the whole tensor, or a clone of it"
            )
        g = groups[gname]
        first = len(g.runs)
        for lo, hi in union:
            payload += hi - lo
            last = g.runs[-1] if len(g.runs) > first else None
            if last is not None and lo - (last.src + last.nbytes) < gap:
                last.nbytes = hi - last.src
                last.payload += hi - lo
            else:
                g.runs.append(Run(st, lo, hi - lo, align(cursor[gname]), hi - lo))
            cursor[gname] = g.runs[-1].dst + g.runs[-1].nbytes
        ri = first
        for lo, _, t, label in spans:
            while lo >= g.runs[ri].src + g.runs[ri].nbytes:
                ri += 1
            r = g.runs[ri]
            offset = r.dst + lo - r.src
            if offset % t.element_size():
                raise SwapStateError(
                    f"SwapSet {set_name!r}: {name_of(label)} sits at a byte offset that is not a "
                    f"multiple of its element size among the tensors sharing its memory"
                )
            g.slots.append(Slot(t, t.dtype, t.shape, t.stride(), offset, ri))
            tensors += 1
    end, out = align(start), []
    for gname in (STATE, GRADS):
        g = groups[gname]
        if g.runs:
            g.nbytes = align(cursor[gname])
            g.base = end
            end += g.nbytes
            out.append(g)
    return Plan(out, end, payload, tensors)


# ---------------------------------------------------------------------------------- packed buffers


@dataclass
class Packed:
    """A device buffer this set made, holding a group's tensors as views; the views are kept for reuse."""

    flat: torch.Tensor  # uint8 over the whole buffer: it holds the storage
    group: Group  # the layout (slots with offsets), for when the buffer must be rebuilt elsewhere
    tensors: list[torch.Tensor]
    views: list[torch.Tensor]
    placeholders: list[torch.Tensor]
    ids: frozenset
    payload: int
    base_refs: int | None  # the storage's use count when only `flat` and `views` hold it (see settle)

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    @classmethod
    def make(cls, group: Group, buf: torch.Tensor) -> Packed:
        storage = buf.untyped_storage()
        device = buf.device
        empty = {}
        views = []
        for s in group.slots:
            e = empty.get(s.dtype)
            if e is None:
                e = empty[s.dtype] = torch.empty(0, dtype=s.dtype, device=device)
            views.append(torch.empty_like(e).set_(storage, s.offset // s.dtype.itemsize, s.shape, s.stride))
        tensors = [s.tensor for s in group.slots]
        for r in group.runs:
            r.storage = None  # the source memory is not needed any more (copies are issued in stream order)
        return cls(
            buf,
            group,
            tensors,
            views,
            [placeholder(s.dtype, s.shape, device) for s in group.slots],
            frozenset(map(id, tensors)),
            group.payload,
            None,
        )

    def settle(self) -> None:
        """Note how many references the buffer has besides its tensors: call once they are bound to it and no
        copy is in flight (a copy in a worker thread holds references of its own for a moment)."""
        n = use_count(self.flat.untyped_storage())
        self.base_refs = None if n is None else n - len(self.tensors)

    def rebind(self) -> None:
        for t, v in zip(self.tensors, self.views):
            t.data = v

    def evict_tensors(self) -> None:
        for t, ph in zip(self.tensors, self.placeholders):
            t.data = ph

    def unchanged(self) -> bool:
        """Every tensor is still exactly its view (nobody rebound, resized or restrided one)."""
        return all(map(torch.Tensor.is_set_to, self.tensors, self.views))

    def free(self) -> bool:
        """Release the device memory, keeping the views for the restore; False if others still hold it."""
        storage = self.flat.untyped_storage()
        if self.base_refs is None or use_count(storage) != self.base_refs:
            return False
        storage.resize_(0)
        return True

    def realloc(self) -> None:
        """Give the buffer memory again (on CUDA: on the current stream); the views see it at once."""
        self.flat.untyped_storage().resize_(self.nbytes)
        own([self.flat])
