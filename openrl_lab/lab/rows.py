"""One row per lease: the joined view that `%openrl status`, the `LeasePanel`, `Lab.status()`, the server
extension's `GET openrl/api/leases` (`rows`) and the JupyterLab sidebar all show (issue 12's contract).

`lease_rows` joins the user's lab leases (the control plane's `/api/v1/lab/leases`: name, group as asked,
model, placement, last step, metrics, checkpoint) with the user's orchestrator leases (state, resident,
weight, queue position and the orchestrator's sentence saying why it waits, `expected_wait_s`) on (canonical
group id, name). Plain dicts in, plain dicts out: no pandas, no torch, no I/O (the server extension uses it
as is).

    {"name", "group", "state", "resident", "share", "weight", "priority", "used_s", "slices", "queue_position",
     "reason", "expected_wait_s", "kernel", "host", "model_id", "base_model", "state_bytes", "last_step",
     "last_metrics", "last_reward", "collapse_since", "last_checkpoint", "checkpoint_time", "variant", "devices",
     "ranks"}

`state`: running (holding its group) | waiting | idle | evicted (its state was moved off the device) | lost
(its kernel was lost: the run is gone until restored from its last checkpoint) | released (only views that
remember a lease that went away say this). `priority`: interactive | batch, the lease's class ("" without an
orchestrator lease). `share`: its weight's share among the live (not lost, not
released) leases of its group in the rows; a lost lease has none. `reason` and `expected_wait_s` only while
waiting. `state_bytes`: the run's device memory (weights, gradients, AdamW moments: a LoRA adapter's, or for full
fine-tuning the whole model's), as its kernel reports it; None while its kernel is away. `variant`: a fork's
`{"forked_from", "step", "settings"}` (`Lab.fork`), None for a run that is not one. `devices`: how many devices
the run is sharded over (1: one device, also for a control plane that predates gangs and says nothing); `ranks`:
for a gang (devices > 1), where each rank lives, rank 0 first (`{"kernel", "group", "host", "device"}`; `kernel`
and `host` are rank 0's), else []. `devices_text(row)` is the line the views show for a gang. `collapse_since`: the
step at which the collapse its last logged step is in began (openrl_lab/collapse.py), None when it is not in one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

ROW_KEYS = (
    "name",
    "group",
    "state",
    "resident",
    "share",
    "weight",
    "priority",
    "used_s",
    "slices",
    "queue_position",
    "reason",
    "expected_wait_s",
    "kernel",
    "host",
    "model_id",
    "base_model",
    "state_bytes",
    "last_step",
    "last_metrics",
    "last_reward",
    "collapse_since",
    "last_checkpoint",
    "checkpoint_time",
    "variant",
    "devices",
    "ranks",
)
LIVE = ("running", "waiting", "idle", "evicted")


def _as_dict(x: Any) -> dict:
    return dict(x.to_dict() if hasattr(x, "to_dict") else x)


def group_names(groups: Iterable[Any] | Mapping[str, str]) -> dict[str, str]:
    """Every name a group answers to -> its id, from GroupInfo objects or dicts (or such a mapping already)."""
    if isinstance(groups, Mapping):
        return dict(groups)
    out: dict[str, str] = {}
    for g in groups:
        d = _as_dict(g)
        for n in (d["group_id"], *d.get("aliases", ())):
            out[n] = d["group_id"]
    return out


def _state(o: dict | None) -> str:
    if o is None:
        return "idle"
    if o.get("state") == "holding":
        return "running"
    if o.get("state") == "waiting":
        return "waiting"
    return "evicted" if o.get("resident") in ("host", "evicting") else "idle"


def _kernel_lost(lab: dict) -> bool:
    """Whether the run's kernel is gone: the control plane gives no placement for it (the kernel it was placed on
    was lost, or restarted since), or says its kernel is not up."""
    p = lab.get("placement")
    return p is None or p.get("state") not in (None, "up")


def lease_rows(
    lab_leases: Iterable[Mapping], orchestrator_leases: Iterable[Any], groups: Iterable[Any] | Mapping[str, str]
) -> list[dict[str, Any]]:
    """The joined rows: each lab lease (in the order given), then each orchestrator lease no lab lease names.

    `lab_leases`: the dicts of `GET /api/v1/lab/leases` (`leases`); `orchestrator_leases`: LeaseInfo objects or
    their dicts (the caller's own); `groups`: GroupInfo objects or dicts (or a name -> id mapping) to resolve the
    group a lab lease was asked on (maybe an alias) to the id its orchestrator lease is on."""
    names = group_names(groups)
    orch = [_as_dict(o) for o in orchestrator_leases]
    by_key = {(o["group_id"], o["name"]): o for o in orch}
    used: set[tuple[str, str]] = set()
    rows: list[dict[str, Any]] = []
    for lab in lab_leases:
        asked = lab.get("group") or ""
        placement = lab.get("placement") or {}
        key = (names.get(asked, asked), lab["name"])
        o = by_key.get(key)
        if o is None and placement.get("group"):  # asked on a name the orchestrator no longer knows
            o = by_key.get((names.get(placement["group"], placement["group"]), lab["name"]))
        if o is not None:
            used.add((o["group_id"], o["name"]))
        for rank in placement.get("ranks") or []:  # a gang's other ranks: leases of its name on their groups
            if rank and rank.get("group"):
                used.add((names.get(rank["group"], rank["group"]), lab["name"]))
        lost = _kernel_lost(lab)
        rows.append(
            _row(
                lab["name"],
                o["group_id"] if o else names.get(asked) or names.get(placement.get("group") or "", "") or asked,
                o,
                lab,
                lost,
            )
        )
    for o in orch:
        if (o["group_id"], o["name"]) not in used:
            rows.append(_row(o["name"], o["group_id"], o, None, False))
    _shares(rows)
    return rows


def _row(name: str, group: str, o: dict | None, lab: Mapping | None, lost: bool) -> dict[str, Any]:
    lab = lab or {}
    placement = lab.get("placement") or {}
    state = "lost" if lost else _state(o)
    waiting = state == "waiting"
    wait = o.get("expected_wait_s") if (o and waiting) else None
    return {
        "name": name,
        "group": group,
        "state": state,
        "resident": bool(o and not lost and o.get("resident") == "device"),
        "share": 0.0,
        "weight": float(o["weight"]) if o else 1.0,
        "priority": str(o.get("priority") or "batch") if o else "",
        "used_s": float(o.get("used_s") or 0.0) if o else 0.0,
        "slices": int(o.get("slices") or 0) if o else 0,
        "queue_position": int(o.get("queue_position") or 0) if (o and waiting) else 0,
        "reason": str(o.get("reason") or "") if (o and waiting) else "",
        "expected_wait_s": None if wait is None or wait < 0 else float(wait),
        "kernel": placement.get("kernel"),
        "host": placement.get("host"),
        "model_id": lab.get("model_id"),
        "base_model": lab.get("base_model"),
        "state_bytes": lab.get("state_bytes"),
        "last_step": lab.get("last_step"),
        "last_metrics": dict(lab.get("last_metrics") or {}),
        "last_reward": lab.get("last_reward"),
        "collapse_since": lab.get("collapse_since"),
        "last_checkpoint": lab.get("checkpoint"),
        "checkpoint_time": lab.get("checkpoint_time"),
        "variant": lab.get("variant"),
        "devices": int(lab.get("devices") or 1),
        "ranks": [dict(r) for r in placement.get("ranks") or [] if r] if int(lab.get("devices") or 1) > 1 else [],
    }


def _shares(rows: list[dict[str, Any]]) -> None:
    total: dict[str, float] = {}
    for r in rows:
        if r["state"] in LIVE:
            total[r["group"]] = total.get(r["group"], 0.0) + r["weight"]
    for r in rows:
        t = total.get(r["group"], 0.0)
        r["share"] = r["weight"] / t if r["state"] in LIVE and t > 0 else 0.0


def variant_text(variant: Mapping[str, Any] | None) -> str:
    """A fork's origin and settings in a line: `fork of sweep @ 12: learning_rate=0.001` ("" for no fork)."""
    if not variant or not variant.get("forked_from"):
        return ""
    step = variant.get("step")
    settings = ", ".join(
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in (variant.get("settings") or {}).items()
    )
    return (
        f"fork of {variant['forked_from']}{'' if step is None else f' @ {step}'}{': ' + settings if settings else ''}"
    )


def devices_text(row: Mapping[str, Any]) -> str:
    """A gang's devices in a line: `devices 2: cpu0,cpu1` (each rank's group, rank 0 first; its kernels where
    the ranks share a group), `devices 2` while its kernels are unknown, "" for a run on one device."""
    n = int(row.get("devices") or 1)
    if n <= 1:
        return ""
    ranks = [r for r in row.get("ranks") or () if r]
    groups = [str(r.get("group") or "") for r in ranks]
    where = groups if all(groups) and len(set(groups)) == len(groups) else [str(r.get("kernel") or "?") for r in ranks]
    return f"devices {n}" + (f": {','.join(where)}" if where else "")


def released_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row of a lease that went away (released), as views that still show it for a while do."""
    return {
        **row,
        "state": "released",
        "resident": False,
        "share": 0.0,
        "queue_position": 0,
        "reason": "",
        "expected_wait_s": None,
    }
