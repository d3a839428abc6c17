"""The joined lease rows (`openrl_lab.lab.rows`) and the `LeasePanel` that shows them: canonical groups, the
orchestrator's reason and expected wait only while waiting, no share for a lease whose kernel was lost, a live
panel refreshed from a background thread whose text repr is a snapshot."""

from __future__ import annotations

import threading
import time

import pytest

from openrl_lab.lab.rows import ROW_KEYS, lease_rows
from openrl_lab.lab.widgets import LeasePanel
from openrl_lab.orchestrator.scheduler import Scheduler
from openrl_lab.orchestrator.types import GroupInfo, LeaseInfo
from tests.orchestrator.conftest import FakeClock

GROUPS = [GroupInfo("default", aliases=("trainer-group", "sampler-group")), GroupInfo("gpu1")]


def orch(
    name, group="default", state="idle", resident="none", weight=1.0, pos=0, reason="", wait=None, priority="batch"
):
    return LeaseInfo(
        f"lease-{name}",
        name,
        group,
        "alice",
        weight,
        0.0,
        1.5,
        3,
        60.0,
        0.0,
        0.0,
        state,
        resident,
        queue_position=pos,
        reason=reason,
        expected_wait_s=wait,
        priority=priority,
    )


def lab(name, group="trainer-group", kernel="kernel-default", state="up", **extra):
    placement = (
        None
        if kernel is None
        else {"kernel": kernel, "group": "default", "host": "vm", "device": "cpu", "state": state}
    )
    return {
        "name": name,
        "group": group,
        "base_model": "m",
        "rank": 4,
        "model_id": f"s:train:{name}",
        "job_id": "j",
        "checkpoint": None,
        "created_at": 0.0,
        "updated_at": 0.0,
        "last_step": None,
        "placement": placement,
        **extra,
    }


def test_rows_join_on_the_canonical_group_and_say_why_only_while_waiting():
    rows = lease_rows(
        [
            lab(
                "run-a",
                last_step=7,
                last_metrics={"reward": 0.5},
                last_reward=0.5,
                checkpoint="tinker://x/weights/s7",
                checkpoint_time=123.0,
            ),
            lab("run-b"),
            lab("run-lost", kernel=None),
            lab("run-dead", state="lost"),
        ],
        [
            orch("run-a", state="holding", resident="device", weight=2.0),
            orch("run-b", state="waiting", pos=1, reason="next: waits for your job 'run-a'", wait=4.5),
            orch("run-lost", resident="device", weight=5.0),
            orch("run-dead", weight=5.0),
            orch("script", group="gpu1", resident="host"),
        ],
        GROUPS,
    )
    assert [r["name"] for r in rows] == ["run-a", "run-b", "run-lost", "run-dead", "script"]
    assert all(list(r) == list(ROW_KEYS) for r in rows)
    a, b, lost, dead, script = rows
    assert a["group"] == "default" and script["group"] == "gpu1"  # the lease's own group id, not the alias asked
    assert (a["state"], a["resident"], a["reason"], a["expected_wait_s"]) == ("running", True, "", None)
    assert (a["last_step"], a["last_reward"], a["last_checkpoint"], a["checkpoint_time"]) == (
        7,
        0.5,
        "tinker://x/weights/s7",
        123.0,
    )
    assert (a["kernel"], a["host"]) == ("kernel-default", "vm")
    assert (b["state"], b["queue_position"], b["expected_wait_s"]) == ("waiting", 1, 4.5)
    assert b["reason"] == "next: waits for your job 'run-a'"
    # kernels lost (no placement any more, or a placement whose kernel is not up): no share, not resident
    for r in (lost, dead):
        assert (r["state"], r["share"], r["resident"]) == ("lost", 0.0, False)
    assert (a["share"], b["share"]) == (pytest.approx(2 / 3), pytest.approx(1 / 3))  # among the live ones
    assert (script["state"], script["share"], script["kernel"]) == ("evicted", 1.0, None)


def test_a_lab_lease_without_an_orchestrator_lease_yet_is_idle_on_its_groups_id():
    (row,) = lease_rows([lab("fresh")], [], GROUPS)
    assert (row["name"], row["group"], row["state"], row["share"], row["weight"]) == (
        "fresh",
        "default",
        "idle",
        1.0,
        1.0,
    )


def test_panel_repr_is_a_table_with_reason_wait_and_checkpoint_columns():
    rows = lease_rows(
        [
            lab("trainer", last_step=3, last_reward=0.25, checkpoint="tinker://r/weights/c1", state_bytes=17_844_224),
            lab(
                "trainer-b",
                variant={"forked_from": "trainer", "step": 3, "settings": {"learning_rate": 1e-3}},
            ),
        ],
        [
            orch("trainer", state="holding", resident="device", weight=2.0, priority="interactive"),
            orch("<b>x</b>", state="waiting", pos=1, reason="next: waits for your job 'trainer'", wait=12.4),
            orch("unknown-wait", state="waiting", pos=2, reason="1 ahead in the queue (policy weighted)"),
        ],
        GROUPS,
    )
    panel = LeasePanel(rows)
    try:
        lines = repr(panel).splitlines()
        assert lines[0] == "LeasePanel: 4 leases"
        assert lines[1].split() == [
            "name",
            "group",
            "state",
            "class",
            "share",
            "queue",
            "wait",
            "reason",
            "resident",
            "kernel",
            "memory",
            "step",
            "reward",
            "checkpoint",
            "variant",
        ]
        line = {ln.split()[0]: ln for ln in lines[2:]}
        assert line["trainer"].split()[:5] == ["trainer", "default", "running", "interactive", "40%"]
        assert line["unknown-wait"].split()[:4] == ["unknown-wait", "default", "waiting", "batch"]
        assert "tinker://r/weights/c1" in line["trainer"] and " 0.25 " in line["trainer"]
        assert " 17.0 MiB " in line["trainer"]  # its device memory (a full fine-tune of tiny-llama-1m)
        assert "waits for your job" not in line["trainer"]  # no reason, and not its state again, unless waiting
        assert "#1" in line["<b>x</b>"] and "~12 s" in line["<b>x</b>"] and "next: waits" in line["<b>x</b>"]
        assert "#2" in line["unknown-wait"] and " ? " in line["unknown-wait"]  # waiting, estimate unknown
        assert line["trainer-b"].endswith("fork of trainer @ 3: learning_rate=0.001")  # a fork says whose, and how
        assert "fork of" not in line["trainer"]
        col = lines[1].index("state")  # fixed width: the state column starts where the header's does
        assert all(ln[col:].split()[0] in ("state", "running", "waiting", "idle") for ln in lines[1:])
        assert "&lt;b&gt;x&lt;/b&gt;" in panel.widget.value and "<b>x</b>" not in panel.widget.value
        assert panel._repr_mimebundle_()["text/plain"] == repr(panel)
        panel.update(None)
        assert repr(panel) == "LeasePanel: no leases" and "no leases" in panel.widget.value
    finally:
        panel.close()
    assert panel.widget.comm is None
    assert panel._repr_mimebundle_() == {"text/plain": repr(panel)}


def test_panel_of_orchestrator_leases_shows_the_orchestrators_reason():
    s = Scheduler({"groups": [{"id": "g", "devices": ["d0"]}]}, clock=FakeClock())
    bob = s.create_lease("bob", "g", "bobs-run").lease_id
    mine = [s.create_lease("alice", "g", name).lease_id for name in ("first", "second")]
    s.acquire("bob", bob, "their_phase", timeout=0)
    for lease_id in mine:
        s.request("alice", lease_id, "train")
    panel = LeasePanel(s.list_leases("alice"))  # LeaseInfo objects, as the orchestrator gives them
    try:
        df = panel.dataframe
        assert dict(zip(df["name"], df["reason"])) == {
            "first": "next: waits for another user's job to finish its slice (revoked at 300 s)",
            "second": "1 ahead in the queue (policy weighted)",
        }
        assert "bobs-run" not in repr(panel) and "their_phase" not in repr(panel)
    finally:
        panel.close()


def test_live_panel_refreshes_from_its_source_and_keeps_released_leases():
    calls = []
    current = [[orch("a", state="holding", resident="device"), orch("b")]]

    def source():
        calls.append(threading.current_thread().name)
        return lease_rows([], current[0], GROUPS)

    panel = LeasePanel(source(), source=source, interval_s=0.05)
    try:
        assert panel.live
        current[0] = [orch("a", state="waiting", pos=1, reason="next: being granted", wait=0.0)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "released" not in repr(panel):
            time.sleep(0.02)
        text = repr(panel)
        assert "waiting" in text and "next: being granted" in text
        assert {r["name"]: r["state"] for r in panel.rows} == {"a": "waiting", "b": "released"}
        assert "openrl-lease-panel" in calls and "live: refreshed" in panel.widget.value
        current[0] = None  # the source fails: the panel says so and keeps its rows

        def broken():
            raise ConnectionError("the control plane went away")

        panel.source = broken
        while time.monotonic() < deadline and panel.error is None:
            time.sleep(0.02)
        assert "went away" in repr(panel) and "a" in [r["name"] for r in panel.rows]
    finally:
        panel.close()
    panel._thread.join(5)
    assert not panel.live


def test_live_panel_shows_a_lab_lease_whose_orchestrator_lease_lingers_as_released():
    current = [[lab("run")], [orch("run", resident="device")]]
    panel = LeasePanel(lease_rows(*current, GROUPS), source=lambda: lease_rows(*current, GROUPS), interval_s=0.05)
    try:
        current[0] = []  # released: the lab lease is gone, its orchestrator lease is closed later by the kernel
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and panel.rows[0]["state"] != "released":
            time.sleep(0.02)
        (row,) = panel.rows
        assert (row["state"], row["share"], row["kernel"]) == ("released", 0.0, "kernel-default")
        time.sleep(0.2)
        assert panel.rows[0]["state"] == "released"  # and stays so
    finally:
        panel.close()


def test_the_sidebars_row_type_has_every_row_key_in_order():
    """labextension/src/api.ts's ILeaseRow is the TypeScript copy of ROW_KEYS: a key added to the rows and not
    to it never reaches the sidebar (state_bytes, the memory fact, was lost that way)."""
    import re
    from pathlib import Path

    api = (Path(__file__).resolve().parents[2] / "labextension" / "src" / "api.ts").read_text()
    body = re.search(r"export interface ILeaseRow \{(.*?)\n\}", api, re.S)
    assert body, "ILeaseRow is missing from labextension/src/api.ts"
    fields = re.findall(r"^\s+(\w+)\??:", body.group(1), re.M)
    assert fields == list(ROW_KEYS), f"ILeaseRow {fields} != ROW_KEYS {list(ROW_KEYS)}"
