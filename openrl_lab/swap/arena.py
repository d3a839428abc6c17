"""The host side of a swap: one reusable byte buffer that evicted tensors are packed into."""

from __future__ import annotations

import torch

_GROW_QUANTUM = 2 << 20  # capacities are whole 2 MiB steps: a slightly bigger state reuses the buffer


class HostArena:
    """A preallocated host buffer (page-locked when it feeds a GPU) that grows when a bigger state arrives.

    Allocating pinned memory is slow (seconds for GBs) and the naive `tensor.cpu()` path lands in pageable
    memory at a fraction of the link rate, so a job's arena is made once and reused by every eviction.
    The arena only holds bytes; the `SwapSet` that owns it knows which tensor lives where.
    """

    def __init__(self, pin: bool = False, capacity: int = 0):
        self.pin = pin
        self.grows = 0  # how many times a (slow) allocation happened
        self._buf = torch.empty(0, dtype=torch.uint8)
        if capacity:
            self.reserve(capacity)

    @property
    def capacity(self) -> int:
        return self._buf.numel()

    @property
    def buffer(self) -> torch.Tensor:
        """The whole arena as a 1-D uint8 tensor on the host."""
        return self._buf

    def reserve(self, nbytes: int) -> bool:
        """Make room for nbytes; True if the buffer had to be (re)allocated. Existing contents are lost."""
        if nbytes <= self.capacity:
            return False
        size = max(nbytes, self.capacity + self.capacity // 2)  # grow by half at least: no realloc per MiB
        size = -(-size // _GROW_QUANTUM) * _GROW_QUANTUM
        self._buf = torch.empty(0, dtype=torch.uint8)  # drop the old one first: peak is the new size only
        self._buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        if not self.pin:
            self._buf.zero_()  # touch every page now, so the first eviction does not pay the page faults
        self.grows += 1
        return True

    def release(self) -> None:
        """Give the memory back (a later reserve allocates again)."""
        self._buf = torch.empty(0, dtype=torch.uint8)

    def __repr__(self) -> str:
        return f"HostArena(capacity={self.capacity}, pinned={self.pin})"
