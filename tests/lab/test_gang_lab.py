"""Leases on several devices (gangs, issue 31) from the notebook surface: `Lab.lease(..., devices=N)`,
`%openrl lease NAME --devices N`, and the rows / `%openrl status` / LeasePanel text that say where a gang's ranks
are. The fast tests need no control plane; the last one needs the gateway's gang support (`openrl_devices`)."""

from __future__ import annotations

import importlib.util
import json
import sqlite3

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from openrl_lab.lab import Lab, LabError
from openrl_lab.lab.client import DEVICES_KEY, MAX_DEVICES, check_devices, devices_metadata
from openrl_lab.lab.connection import Connection
from openrl_lab.lab.magics import _parser
from openrl_lab.lab.rows import ROW_KEYS, devices_text, lease_rows
from openrl_lab.lab.widgets.lease_panel import render_text
from openrl_lab.orchestrator.types import GroupInfo, LeaseInfo
from tests.lab.helpers import datum, eval_loss, train_steps

GROUPS = [GroupInfo("cpu0", aliases=("trainer-group",)), GroupInfo("cpu1", aliases=("sampler-group",))]


def lab_row(name: str, devices: int | None = None, ranks=None, kernel="kernel-cpu0") -> dict:
    """A lease as GET /api/v1/lab/leases gives it; `devices=None`: a server that predates gangs (no field)."""
    placement = {"kernel": kernel, "group": "cpu0", "host": "vm", "device": "cpu", "state": "up"}
    if ranks is not None:
        placement["ranks"] = ranks
    row = {
        "name": name,
        "group": "trainer-group",
        "base_model": "m",
        "rank": 4,
        "model_id": f"s:train:{name}",
        "job_id": "j",
        "checkpoint": None,
        "last_step": 2,
        "placement": placement,
    }
    return row if devices is None else row | {"devices": devices}


def holding(name: str, group: str = "cpu0") -> LeaseInfo:
    return LeaseInfo(f"lease-{name}", name, group, "alice", 1.0, 0.0, 1.5, 3, 60.0, 0.0, 0.0, "holding", "device")


RANKS = [
    {"kernel": "kernel-cpu0", "group": "cpu0", "host": "vm", "device": "cpu:0"},
    {"kernel": "kernel-cpu1", "group": "cpu1", "host": "vm", "device": "cpu:1"},
]


# --- Lab.lease(devices=N): what it checks and what it sends --------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, MAX_DEVICES + 1, 2.0, "2", True, None])
def test_a_bad_number_of_devices_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match=rf"devices must be a whole number of devices from 1 to 64, got {bad!r}"):
        check_devices(bad)


def test_only_a_gang_sends_openrl_devices_so_single_device_requests_stay_as_they_were():
    assert devices_metadata(1) == {}  # byte-identical to a request made before gangs existed
    assert devices_metadata(2) == {DEVICES_KEY: "2"} and DEVICES_KEY == "openrl_devices"
    assert devices_metadata(MAX_DEVICES) == {"openrl_devices": "64"}  # a string: user_metadata's values are
    with pytest.raises(ValueError, match="got 65"):
        devices_metadata(65)


def test_lease_checks_devices_before_it_asks_the_lab_anything():
    # nothing listens on port 9 (discard): a check that came after a request would fail with "did not answer"
    lab = Lab(Connection("http://127.0.0.1:9", "tml-nobody"))
    try:
        with pytest.raises(ValueError, match="devices must be a whole number of devices from 1 to 64, got 0"):
            lab.lease("g", devices=0)
        with pytest.raises(ValueError, match="got 'two'"):
            lab.lease("g", devices="two")  # type: ignore[arg-type] - what a careless caller passes
        with pytest.raises(LabError, match="did not answer"):  # a good value goes on to the lab
            lab.lease("g", devices=2)
    finally:
        lab.close()


# --- %openrl lease --devices N -------------------------------------------------------------------------------------
def test_the_lease_magic_parses_devices_and_defaults_to_one():
    p = _parser()
    assert p.parse_args(["lease", "run"]).devices == 1
    assert p.parse_args(["lease", "run", "--devices", "2"]).devices == 2
    assert p.parse_args(["lease", "run", "--devices=64", "--full"]).devices == 64


@pytest.mark.parametrize("value", ["0", "65", "two", "1.5", "-2"])
def test_a_bad_devices_value_is_a_one_line_usage_error(value):
    with pytest.raises(UsageError) as e:
        _parser().parse_args(["lease", "run", "--devices", value])
    assert str(e.value) == (
        f"%openrl lease: argument --devices: {value!r} is not a number of devices: a whole number from 1 to 64 "
        "(see %openrl lease --help)"
    )


def test_lease_help_names_devices(capsys):
    from openrl_lab.lab.magics import _HelpShown, usage

    with pytest.raises(_HelpShown):
        _parser().parse_args(["lease", "--help"])
    out = capsys.readouterr().out
    assert "--devices N" in out and "shard the run over N devices" in out
    assert "--devices N: sharded over N devices" in usage()


# --- rows, %openrl status, the LeasePanel ---------------------------------------------------------------------------
def test_a_gangs_row_says_its_devices_and_where_each_rank_is():
    rows = {r["name"]: r for r in lease_rows([lab_row("gang", 2, RANKS), lab_row("solo", 1)], [], GROUPS)}
    assert list(rows["gang"]) == list(ROW_KEYS)
    assert rows["gang"]["devices"] == 2 and [r["group"] for r in rows["gang"]["ranks"]] == ["cpu0", "cpu1"]
    assert rows["gang"]["kernel"] == "kernel-cpu0"  # rank 0's, as the top-level placement says
    assert (rows["solo"]["devices"], rows["solo"]["ranks"]) == (1, [])
    assert devices_text(rows["gang"]) == "devices 2: cpu0,cpu1"
    assert devices_text(rows["solo"]) == ""
    # ranks that share a group (multi-device kernels of one group): their kernels say where instead
    same = [dict(r, group="gpu") for r in RANKS]
    assert devices_text(lease_rows([lab_row("g", 2, same)], [], GROUPS)[0]) == "devices 2: kernel-cpu0,kernel-cpu1"
    # a gang whose placement is not known now (its kernel lost): the count alone
    gone = lab_row("g", 3) | {"placement": None}
    assert devices_text(lease_rows([gone], [], GROUPS)[0]) == "devices 3"


def test_a_server_that_sends_no_devices_field_is_read_as_one_device():
    (row,) = lease_rows([lab_row("old")], [holding("old")], GROUPS)
    assert (row["devices"], row["ranks"], row["state"]) == (1, [], "running")
    orchestrator_only = lease_rows([], [holding("script")], GROUPS)[0]
    assert (orchestrator_only["devices"], orchestrator_only["ranks"]) == (1, [])


def test_status_text_shows_a_gangs_devices_and_nothing_new_for_one_device():
    old = render_text(lease_rows([lab_row("solo")], [holding("solo")], GROUPS), "leases")
    same = render_text(lease_rows([lab_row("solo", 1, RANKS[:1])], [holding("solo")], GROUPS), "leases")
    assert same == old  # devices 1 (with or without the field, and its one rank) changes nothing
    assert "kernel-cpu0" in old and "devices" not in old
    text = render_text(
        lease_rows([lab_row("solo", 1), lab_row("gang", 2, RANKS)], [holding("solo"), holding("gang")], GROUPS),
        "leases",
    )
    lines = {ln.split()[0]: ln for ln in text.splitlines()[2:]}
    assert "devices 2: cpu0,cpu1" in lines["gang"] and "kernel-cpu0" not in lines["gang"]
    assert "kernel-cpu0" in lines["solo"] and "devices" not in lines["solo"]
    assert text.splitlines()[1].split() == old.splitlines()[1].split()  # the same columns


# --- against the gateway's gang support -----------------------------------------------------------------------------
@pytest.mark.server  # starts a lab of its own with two CPU kernels (LabServer)
@pytest.mark.timeout(300)
@pytest.mark.skipif(
    importlib.util.find_spec("openrl_lab.gateway.gang") is None,
    reason="the gateway does not run leases on several devices yet (openrl_lab/gateway/gang.py)",
)
def test_a_lease_on_two_devices_trains_and_every_view_shows_its_ranks(tmp_path, capsys):
    from openrl_lab.server import LabServer

    with LabServer(tmp_path / "lab", args=("--cpu-kernels", "2")) as server:
        lab = Lab.connect(server.base_url, api_key=server.api_key)
        try:
            run = lab.lease("gang-2", rank=4, seed=1, devices=2)
            assert run.devices == 2
            assert "on trainer-group, 2 devices" in repr(run)
            data = [datum(run.tokenizer(), "the cat sat on the mat")]
            losses = train_steps(run, data, 2)
            assert all(loss == loss for loss in losses)  # a number: the gang trained
            run.flush()
            solo = lab.lease("solo-1", rank=4, seed=1)
            assert solo.devices == 1 and "devices" not in repr(solo)
            # what reached the gateway: openrl_devices for the gang only (a one-device request is as it was)
            with sqlite3.connect(f"file:{tmp_path / 'lab' / 'state.db'}?mode=ro", uri=True) as db:
                sent = {
                    model_id: json.loads(md or "{}")
                    for model_id, md in db.execute("SELECT model_id, user_metadata FROM models")
                }
            assert sent[run.model_id]["openrl_devices"] == "2"
            assert "openrl_devices" not in sent[solo.model_id]

            rows = {r["name"]: r for r in lab.status()}
            assert rows["gang-2"]["devices"] == 2
            assert sorted(r["group"] for r in rows["gang-2"]["ranks"]) == ["cpu0", "cpu1"]
            assert rows["gang-2"]["ranks"][0]["kernel"] == rows["gang-2"]["kernel"]  # rank 0 first
            assert (rows["solo-1"]["devices"], rows["solo-1"]["ranks"]) == (1, [])
            text = render_text(list(rows.values()), "leases")
            line = next(ln for ln in text.splitlines() if ln.startswith("gang-2"))
            assert devices_text(rows["gang-2"]) in line and devices_text(rows["gang-2"]).startswith("devices 2: ")

            with pytest.raises(LabError, match="runs on 2 devices"):  # the gateway refuses forks of gangs
                lab.fork("gang-2", ["gang-2-b"])
            fresh = Lab.connect(server.base_url, api_key=server.api_key)
            again = fresh.attach("gang-2")
            assert again.devices == 2 and eval_loss(again, data) == eval_loss(run, data)
            fresh.close()

            # the magic, on the same lab
            shell = InteractiveShell.instance()
            shell.run_line_magic("load_ext", "openrl_lab")
            magics = shell.magics_manager.registry["OpenRLMagics"]
            magics.lab = lab
            shell.run_line_magic("openrl", "lease gang-magic --rank 2 --devices 2 --as g")
            assert "2 devices" in capsys.readouterr().out and shell.user_ns["g"].devices == 2
            shell.run_line_magic("openrl", "status --once")
            status = capsys.readouterr().out
            assert next(ln for ln in status.splitlines() if ln.startswith("gang-magic")).count("devices 2: ") == 1
            magics.lab = None
            for name in ("gang-2", "solo-1", "gang-magic"):
                lab.release(name)
        finally:
            lab.close()
