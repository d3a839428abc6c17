"""Placement of a full fine-tune (issue 18): among the kernels of its group, one that reported room for it comes
first, before the usual rule (fewest jobs, the base model already loaded, most free memory). The records are built
directly (no kernel processes): this is the fleet's choice alone; the refusal when no kernel has room is
tests/gateway/test_full_finetune.py's."""

from __future__ import annotations

from openrl_lab.cluster.fleet import Fleet, KernelRecord

MiB = 1 << 20


def record(name: str, available: int | None, jobs: tuple[str, ...] = ()) -> KernelRecord:
    return KernelRecord(
        name=name,
        group="g",
        device="cpu",
        host="h",
        address=("127.0.0.1", 1),
        incarnation="1",
        client=None,
        origin="joined",
        metrics={"device_available_bytes": available, "job_ids": list(jobs)},
    )


def test_a_full_finetune_goes_to_a_kernel_with_room_even_if_it_is_busier(tmp_path):
    fleet = Fleet(tmp_path)
    fleet._records = {
        r.name: r for r in (record("idle-but-full", 10 * MiB), record("busy-with-room", 100 * MiB, ("j1",)))
    }
    assert fleet.place("g", needs_bytes=50 * MiB, wait_s=0).name == "busy-with-room"
    assert fleet.place("g", wait_s=0).name == "idle-but-full"  # a LoRA job: the usual rule, fewest jobs first
    # a kernel that reports no figure is not ruled out (the kernel checks again when it makes the job)
    fleet._records["unknown"] = record("unknown", None)
    assert fleet.place("g", needs_bytes=50 * MiB, wait_s=0).name == "unknown"
