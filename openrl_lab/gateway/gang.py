"""Runs on several devices (gangs), as the gateway sees them (torch-free): how many devices a run asks for, which
kernels its ranks live on, and one operation sent to every rank.

A run created with `user_metadata={"openrl_devices": "N"}` (N >= 2) is a *gang*: the fleet places its N ranks on
N kernels of different groups (`Fleet.place_gang`), each kernel hosts one rank in a worker process of its own,
and the ranks form one torch.distributed world (FSDP2). Its row records rank 0's epoch in `epoch` (what every
single-device path reads: placement, metrics, exports) and every rank's epoch in `ranks`.

Every primitive of a gang goes to all N kernels at once with the same `gang_phase` key: each kernel acquires
its own group's slice tagged with it, and the orchestrator grants the N slices together or not at once (never
some of them), so two gangs and single-device jobs on the same groups cannot deadlock. Rank 0's answer is the
run's answer. A gang's calls are not pipelined: the next waits for every rank's answer to the previous.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

MAX_DEVICES = 64
DEVICES_KEY = "openrl_devices"


def devices_of(metadata: dict[str, Any] | None) -> int:
    """The number of devices a new run asks for (`openrl_devices`, default 1); ValueError naming a bad value."""
    value = (metadata or {}).get(DEVICES_KEY)
    if value is None:
        return 1
    text = str(value).strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_DEVICES:
        raise ValueError(
            f"user_metadata {DEVICES_KEY} {value!r} must be a whole number of devices from 1 to {MAX_DEVICES}"
        )
    return int(text)


def ranks_of(row: Any) -> list[str]:
    """The epochs of a run's ranks, rank 0 first: [its epoch] for a single-device run."""
    ranks = row["ranks"] if "ranks" in row.keys() else None  # noqa: SIM118 (sqlite3.Row has no `in`)
    return json.loads(ranks) if ranks else [row["epoch"]]


def is_gang(row: Any) -> bool:
    return len(ranks_of(row)) > 1


def phase_key(model_id: str) -> str:
    """A fresh key for one gang phase: what ties the N ranks' slice requests together in the orchestrator."""
    return f"{model_id}/{uuid.uuid4().hex[:12]}"


class GangApi:
    """One rank's kernel operations with the gang phase's key added to every call (`gang_phase=`), so that the
    route's `lambda k: k.optim_step(...)` runs unchanged on each rank."""

    def __init__(self, api: Any, key: str):
        self._api = api
        self._key = key

    def __getattr__(self, op: str):
        method = getattr(self._api, op)

        def call(**kwargs: Any) -> Any:
            return method(**kwargs, gang_phase=self._key)

        return call
