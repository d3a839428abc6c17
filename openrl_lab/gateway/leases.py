"""How a new training run is time-sliced, from the `openrl_*` keys of its `user_metadata` (torch-free).

    openrl_lease    the lease's name (default: the model id); runs of one user that name the same lease
                    share one share of the group
    openrl_group    the group (id or alias, e.g. `trainer-group`) the run's phases are sliced on; it must be
                    one this server's kernels run on
    openrl_weight   the lease's weight (fair share; default 1)
    openrl_quota_s  the accelerator-seconds the lease may use (default: unlimited)
    openrl_priority interactive | batch (default batch): an interactive lease's phases go before waiting
                    batch phases, within the group's interactive share (the notebook's `Lab.lease` asks for
                    interactive)

Bad values are refused when the run is created (a 400 naming the key), never as a failed future later.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from openrl_lab.orchestrator.config import NAME
from openrl_lab.orchestrator.types import PRIORITIES

KEYS = ("openrl_lease", "openrl_group", "openrl_weight", "openrl_quota_s", "openrl_priority")


def lease_options(
    metadata: dict[str, Any] | None, names: dict[str, str] | None, kernel_groups: Sequence[str]
) -> dict[str, Any]:
    """The fields of the job's `JobSlicing` (lease, group, weight, quota_s, priority) the metadata sets.
    `names`: the orchestrator's group names and aliases -> group ids, or None when the server runs without
    one (then nothing is sliced and the keys are only checked for form); `kernel_groups`: the groups that
    have a kernel. Raises ValueError with the message for the user."""
    md = metadata or {}
    out: dict[str, Any] = {}
    lease = md.get("openrl_lease")
    if lease is not None:
        if not isinstance(lease, str) or not NAME.fullmatch(lease):
            raise ValueError(
                f"user_metadata openrl_lease {lease!r} is not a lease name: 1-128 letters, digits and "
                "._:@/+- starting with a letter or digit"
            )
        out["lease"] = lease
    for key, arg, low_open in (("openrl_weight", "weight", True), ("openrl_quota_s", "quota_s", False)):
        value = md.get(key)
        if value is None:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number) or number < 0 or (low_open and number == 0):
            raise ValueError(f"user_metadata {key} {value!r} must be a finite number {'>' if low_open else '>='} 0")
        out[arg] = number
    priority = md.get("openrl_priority")
    if priority is not None:
        if priority not in PRIORITIES:
            raise ValueError(f"user_metadata openrl_priority {priority!r} must be one of {', '.join(PRIORITIES)}")
        out["priority"] = priority
    group = md.get("openrl_group")
    if group is not None:
        if not isinstance(group, str) or not group:
            raise ValueError(f"user_metadata openrl_group {group!r} is not a group name")
        if names is not None:
            aliases: dict[str, list[str]] = {}
            for n, gid in names.items():
                aliases.setdefault(gid, []).extend([n] if n != gid else [])
            known = "; ".join(g + (f" (aliases {', '.join(a)})" if a else "") for g, a in aliases.items())
            if group not in names:
                raise ValueError(f"user_metadata openrl_group {group!r} is not a group of this server; groups: {known}")
            if names[group] not in kernel_groups:
                raise ValueError(
                    f"user_metadata openrl_group {group!r} is group {names[group]!r}, which no kernel of "
                    f"this server runs on (its kernels run on {', '.join(kernel_groups) or 'no group'})"
                )
            out["group"] = group
    return out if names is not None else {}
