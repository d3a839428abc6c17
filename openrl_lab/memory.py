"""What a training job holds on its device, and the device memory a kernel admits jobs against (torch-free: the
kernel, the gateway and the lab client share these numbers and their wording).

A job trains in float32 (the kernel loads every model in float32) and keeps, per trainable parameter: its
weight, its gradient and AdamW's two moments (exp_avg, exp_avg_sq), 4 copies of 4 bytes. A LoRA job holds that
for its adapter only; a full fine-tuning job for every weight of its own copy of the model. Activations come on
top, for the length of a phase only.
"""

from __future__ import annotations

from openrl_lab.settings import settings

# Which job a LoRA rank asks for: 1..MAX_LORA_RANK an adapter, FULL_FINETUNE_RANK every weight (the SDK's
# create_lora_training_client always sends a rank; the gateway and the lab client read it by this rule).
FULL_FINETUNE_RANK = 0
MAX_LORA_RANK = 1024
TRAIN_DTYPE_BYTES = 4  # float32
STATE_COPIES = 4  # weight, gradient, AdamW exp_avg, AdamW exp_avg_sq
# The device memory a kernel admits jobs against (bytes, or with a unit: "512MiB", "40GiB"). Default: the whole
# CUDA device; on a CPU kernel, the machine's physical memory.
BUDGET_ENV = "OPENRL_KERNEL_MEMORY_BYTES"


def full_finetune_bytes(num_parameters: int) -> int:
    """The device state of a full fine-tuning job on a model of `num_parameters` weights."""
    return int(num_parameters) * TRAIN_DTYPE_BYTES * STATE_COPIES


def fmt_bytes(n: int | float) -> str:
    """1.5 GiB, 17.0 MiB, 12 KiB: what the lease line, status and refusals print."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def budget_from_env() -> int | None:
    """$OPENRL_KERNEL_MEMORY_BYTES, if set (a SettingsError, a ValueError, naming it when it is not a size)."""
    return settings().kernel_memory_bytes


def no_room(what: str, needed: int, available: int, where: str) -> str:
    """The refusal of a job that does not fit, naming both sizes and what to do."""
    return (
        f"{what} needs {fmt_bytes(needed)} of device memory (weights, gradients and AdamW moments in float32) "
        f"but {where} has {fmt_bytes(max(available, 0))} available next to its resident jobs: release a run "
        f"(%openrl release / Lab.release) or use LoRA (a rank >= 1), which trains only a small adapter"
    )
