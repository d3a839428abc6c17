"""Placement of a full fine-tune (issue 18): among the kernels of its group, one that reported room for it comes
first, before the usual rule (fewest jobs, the base model already loaded, most free memory). The records are built
directly (no kernel processes): this is the fleet's choice alone; the refusal when no kernel has room is
tests/gateway/test_full_finetune.py's."""

from __future__ import annotations

from openrl_lab.cluster.fleet import Fleet, KernelRecord
from openrl_lab.kernel.api import KernelMetrics, SwapTotals

MiB = 1 << 20


def record(name: str, available: int | None, jobs: tuple[str, ...] = ()) -> KernelRecord:
    """A kernel that reported `available` bytes free for jobs (None: it has not reported yet)."""
    metrics = KernelMetrics(
        jobs=len(jobs),
        job_ids=list(jobs),
        samplers=0,
        sampler="torch",
        rss_bytes=0,
        base_models=[],
        device_bytes=0,
        device_free_bytes=None,
        device_budget_bytes=1 << 40,
        device_available_bytes=available or 0,
        job_bytes={},
        swap=SwapTotals(0, 0, 0, 0, 0, 0.0),
    )
    return KernelRecord(
        name=name,
        group="g",
        device="cpu",
        host="h",
        address=("127.0.0.1", 1),
        incarnation="1",
        client=None,
        origin="joined",
        metrics=metrics if available is not None else None,
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


def test_a_report_asked_for_before_a_drop_cannot_bring_the_dropped_job_back(tmp_path):
    """The fleet asks each kernel for its metrics every second, and again right after it drops a job there. An
    answer to the earlier ask may arrive last and still list the job with its memory: it is older, so it is
    not kept (else the job counts, and its memory refuses a full fine-tune, until the next round)."""
    fleet = Fleet(tmp_path)
    rec = record("k", 10 * MiB, ("j1",))
    fleet._records = {"k": rec}
    before_drop, after_drop = record("k", 10 * MiB, ("j1",)).metrics, record("k", 60 * MiB).metrics
    rec.asks = 2  # ask 1: the round in flight when j1 was dropped; ask 2: the one the drop sent
    fleet._heard(rec, 2, after_drop)
    fleet._heard(rec, 1, before_drop)
    assert rec.metrics is after_drop and rec.jobs() == set()
    assert fleet.place("g", needs_bytes=50 * MiB, wait_s=0) is rec and fleet.room("g") == [(rec, 60 * MiB)]
    # in the order they were asked, the later answer is kept too
    fleet._heard(rec, 3, before_drop)
    fleet._heard(rec, 4, after_drop)
    assert rec.metrics is after_drop
