"""Device state <-> pinned host arena: one job's swappable state (`SwapSet`), moved only when told.

    ss = SwapSet("job-a", "cuda")
    ss.add_module(peft_model, lambda name: ".lora_" in name and ".job_a." in name)  # only A's adapter
    ss.add_optimizer(optimizer_a)
    ss.evict()     # bytes to the arena, device memory freed; forward/step of A now raise SwapStateError
    ss.restore()   # same Parameter objects, bit-exact values

The orchestrator decides when (lazy yield: nothing moves when nobody waits); this package only moves bytes
and counts them (`SwapSet.counters`, `global_counters()`).
"""

from openrl_lab.swap.arena import HostArena
from openrl_lab.swap.swapset import (
    ALIGN,
    SwapCounters,
    SwapSet,
    SwapStateError,
    SwapStats,
    global_counters,
    switch,
)

__all__ = ["ALIGN", "HostArena", "SwapCounters", "SwapSet", "SwapStateError", "SwapStats", "global_counters", "switch"]
