"""`%openrl` in a real IPython shell against a real control plane: usage errors are one line, commands work."""

from __future__ import annotations

import os
import re
import time

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from tests.conftest import make_key


@pytest.fixture(scope="module")
def ip(lab):
    shell = InteractiveShell.instance()
    mp = pytest.MonkeyPatch()
    mp.setenv("OPENRL_LAB_URL", lab.base_url)
    mp.setenv("OPENRL_LAB_API_KEY", lab.api_key)
    shell.run_line_magic("load_ext", "openrl_lab")
    yield shell
    magics = shell.magics_manager.registry["OpenRLMagics"]
    if magics.lab is not None:
        magics.lab.close()
    mp.undo()


@pytest.mark.parametrize(
    "line, message",
    [
        ("", "a command is needed: connect, lease"),
        ("bogus", "invalid choice: 'bogus'"),
        ("lease", "the following arguments are required: name"),
        ("lease x --rank many", "argument --rank: invalid int value: 'many'"),
        ("attach ghost-run", "%openrl attach: no lease named 'ghost-run'"),
        ("lease x --group nowhere", "openrl_group 'nowhere' is not a group of this server"),
        ("lease x --as 2bad", "--as '2bad' is not a Python identifier"),
        ("lease x --full --rank 8", "%openrl lease: full fine-tuning trains every weight: it takes no LoRA rank"),
        ("phase --group default", "%%openrl phase is a cell magic"),
        ("lease 'unclosed", "%openrl: No closing quotation"),
        ("autophase on", "%openrl autophase: nothing is registered: %openrl resident VAR"),
        ("autophase maybe", "argument switch: invalid choice: 'maybe'"),
        ("resident ghost_var", "%openrl resident: no variable named ghost_var in this kernel"),
        ("resident --close", "%openrl resident: no resident state to close in this kernel"),
        ("lease x --priority urgent", "argument --priority: invalid choice: 'urgent'"),
        ("lease x --devices 0", "%openrl lease: argument --devices: '0' is not a number of devices: a whole number"),
    ],
)
def test_wrong_usage_is_a_one_line_usage_error(ip, line, message):
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("openrl", line)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_line_commands_are_not_cell_magics(ip):
    with pytest.raises(UsageError, match="only `phase` is a cell magic"):
        ip.run_cell_magic("openrl", "status", "x = 1")


def test_help_prints_and_does_not_raise(ip, capsys):
    ip.run_line_magic("openrl", "lease --help")
    out = capsys.readouterr().out
    assert "--group" in out and "--rank" in out and "VAR_training_client" in out
    ip.run_line_magic("openrl", "--help")
    assert "attach" in capsys.readouterr().out


def test_lease_binds_handles_then_status_plot_release(ip, capsys):
    ip.run_line_magic("openrl", "connect")
    ip.run_line_magic("openrl", "lease magic-run --group trainer-group --rank 2 --as job")
    out = capsys.readouterr().out
    assert "bound: job, job_training_client, job_sample" in out
    ns = ip.user_ns
    assert ns["job"].name == "magic-run" and ns["job_training_client"] is ns["job"].training
    assert isinstance(ns["job_sample"]("ab", 2, max_tokens=3), list)
    ns["job"].log(0, loss=2.0)
    ns["job"].log(1, loss=1.5)
    ip.run_line_magic("openrl", "status")
    assert "magic-run" in capsys.readouterr().out
    ip.run_line_magic("openrl", "top")
    top = capsys.readouterr().out
    assert "default" in top and re.search(r"kernel-default \[up\] group default, cpu on \S+: [1-9]\d* jobs?, ", top), (
        top
    )
    ip.run_line_magic("openrl", "plot magic-run --metrics loss")
    assert "magic-run" in capsys.readouterr().out  # the plot's text repr
    ip.run_line_magic("openrl", "attach magic-run")
    assert "history: 2 steps (last 1)" in capsys.readouterr().out
    classes = lambda: {L.name: L.priority for L in ns["job"].lab.orchestrator.leases()}  # noqa: E731
    assert classes()["magic-run"] == "interactive"  # a notebook's lease, by default
    ip.run_line_magic("openrl", "release magic-run")
    assert "released magic-run" in capsys.readouterr().out
    ip.run_line_magic("openrl", "lease batch-run --rank 2 --priority batch --as other")
    assert classes()["batch-run"] == "batch"
    ip.run_line_magic("openrl", "release batch-run")
    with pytest.raises(UsageError, match="no lease named 'magic-run'"):
        ip.run_line_magic("openrl", "attach magic-run")


def test_fork_makes_variants_and_compare_shows_them(ip, capsys):
    ip.run_line_magic("openrl", "connect")
    ip.run_line_magic("openrl", "lease fork-parent --rank 2 --as parent")
    ip.user_ns["parent"].log(0, loss=2.0, reward=0.1)
    ip.run_line_magic("openrl", "fork fork-parent --as v-a,v-b --set learning_rate=3e-4,1e-3 --set tag=sweep")
    out = capsys.readouterr().out
    assert "LabLease 'v-a'" in out and "'learning_rate': 0.0003, 'tag': 'sweep'" in out and "bound: forks" in out
    forks = ip.user_ns["forks"]
    assert forks["v-b"].variant["settings"] == {"learning_rate": 1e-3, "tag": "sweep"}
    ip.run_line_magic("openrl", "compare fork-parent,v-a,v-b --metrics loss")
    out = capsys.readouterr().out
    assert "learning_rate" in out and "v-b" in out and "loss last" in out
    with pytest.raises(UsageError, match="--set 'lr': expected KEY=V1,V2"):
        ip.run_line_magic("openrl", "fork fork-parent --as v-c --set lr")
    for name in ("fork-parent", "v-a", "v-b"):
        ip.run_line_magic("openrl", f"release {name}")


def test_doctor_prints_a_line_per_check(ip, capsys):
    ip.run_line_magic("openrl", "connect")
    capsys.readouterr()
    ip.run_line_magic("openrl", "doctor")
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[1] for ln in out[:-1]][:3] == ["http", "key", "version"] and len(out) == 15
    assert re.fullmatch(r"doctor: (all 14 checks passed|\d+ failed, \d+ warned of 14 checks)", out[-1]), out


def test_lease_full_states_its_memory_in_the_lease_line_and_status(ip, capsys):
    ip.run_line_magic("openrl", "lease full-magic --full --as ft")
    out = capsys.readouterr().out
    assert "full fine-tuning on trainer-group" in out and "17.0 MiB of device memory" in out, out
    assert ip.user_ns["ft"].training.get_info().is_lora is False
    deadline = time.monotonic() + 10
    while True:  # the status rows have it once the fleet heard from the kernel (each second)
        ip.run_line_magic("openrl", "status --once")
        lines = capsys.readouterr().out.splitlines()
        assert "memory" in lines[1].split()
        (row,) = [ln for ln in lines if ln.startswith("full-magic ")]
        if "17.0 MiB" in row or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert "17.0 MiB" in row, lines
    ip.run_line_magic("openrl", "release full-magic")


def test_phase_cell_holds_the_group_and_releases_on_error(ip, capsys):
    ip.run_cell_magic("openrl", "phase --group trainer-group --kind notebook-cell --verbose", "phase_ran = 41 + 1")
    assert ip.user_ns["phase_ran"] == 42
    assert "phase on trainer-group: waited" in capsys.readouterr().out
    ip.run_cell_magic("openrl", "phase --group trainer-group", "raise RuntimeError('boom in a phase')")
    lab = ip.magics_manager.registry["OpenRLMagics"].lab
    status = lab.orchestrator.get_status("trainer-group")
    assert status.holder is None  # the raising cell released its slice
    timeline = lab.timeline("default")
    assert "notebook-cell" in timeline["kind"].tolist()
    assert set(timeline[timeline["kind"] == "notebook-cell"]["priority"]) <= {"interactive", "interactive-capped"}
    assert {L.name: L.priority for L in lab.orchestrator.leases()}[lab.orchestrator.job] == "interactive"
    ip.run_cell_magic("openrl", "phase --group trainer-group --kind batch-cell --priority batch", "x = 1")
    timeline = lab.timeline("default")
    assert set(timeline[timeline["kind"] == "batch-cell"]["priority"]) == {"batch"}


# --- in a real notebook kernel (ipykernel via jupyter_client): help, and status as a live panel ----------


@pytest.fixture(scope="module")
def kernel(lab):
    import os
    from pathlib import Path

    from jupyter_client.manager import start_new_kernel

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OPENRL_LAB_URL=lab.base_url, OPENRL_LAB_API_KEY=lab.api_key)
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(root), env=env)
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def execute(kc, code: str, timeout: float = 120) -> tuple[dict, list[dict]]:
    """Runs `code` in the kernel: (its execute_reply's content, the IOPub messages it published)."""
    msgs: list[dict] = []
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=msgs.append)
    errors = ["\n".join(m["content"]["traceback"]) for m in msgs if m["msg_type"] == "error"]
    assert reply["content"]["status"] == "ok", errors
    return reply["content"], msgs


def printed(msgs: list[dict]) -> str:
    return "".join(m["content"]["text"] for m in msgs if m["msg_type"] == "stream")


def test_help_lists_every_subcommand_in_a_kernel(kernel):
    from openrl_lab.lab.magics import COMMANDS

    execute(kernel, "%load_ext openrl_lab")
    reply, _ = execute(kernel, "%openrl?")
    (page,) = [p for p in reply.get("payload", []) if p.get("source") == "page"]
    text = page["data"]["text/plain"]
    for name, line in COMMANDS.items():
        assert name in text and line.split(";")[0] in text, name
    for line in ("%openrl --help", "%openrl help"):
        out = printed(execute(kernel, line)[1])
        assert out.splitlines()[0].startswith("%openrl COMMAND")
        assert [ln.split()[0] for ln in out.splitlines() if ln.startswith("  ")] == list(COMMANDS)


def comm_values(kc, until, timeout: float = 30.0) -> list[str]:
    """The HTML values the kernel's widgets send after the cell ran (background refreshes), until `until(value)`."""
    import queue

    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        if msg["msg_type"] == "comm_msg":
            value = msg["content"]["data"].get("state", {}).get("value")
            if isinstance(value, str):
                seen.append(value)
                if until(value):
                    return seen
    raise AssertionError(f"no refresh showed what was wanted within {timeout} s; last: {seen[-1:]}")


def test_status_in_a_kernel_is_a_live_panel_and_once_a_snapshot(kernel, lab):

    execute(kernel, "%load_ext openrl_lab\n%openrl connect\n%openrl lease status-run --group trainer-group --rank 2")
    execute(
        kernel,
        "run.log(0, reward=0.25, loss=1.0)\nckpt = run.save('status-ckpt')\nrun.flush()\n"
        "from openrl_lab.lab.widgets import LivePlot",
    )
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient
    from openrl_lab.orchestrator.types import group_names

    with TimeSliceOrchestratorClient(lab.grpc_target, api_key=lab.api_key) as orch:
        canonical = group_names(orch.list_groups())["trainer-group"]

    text = printed(execute(kernel, "%openrl status --once")[1])
    lines = text.splitlines()
    assert lines[0].startswith("leases: ")
    header = lines[1].split()
    assert header[:3] == ["name", "group", "state"] and "reason" in header and header[-2:] == ["checkpoint", "variant"]
    row = next(ln for ln in lines[2:] if ln.startswith("status-run "))
    cols = row.split()
    assert cols[1] == canonical  # the group its orchestrator lease is on (the alias resolved), not a guess
    assert cols[2] in ("running", "idle", "evicted")
    assert cols[2] not in row[lines[1].index("reason") : lines[1].index("resident")]  # reason: empty unless waiting
    assert "tinker://" in row and "status-ckpt" in row and "0.25" in row

    _, msgs = execute(kernel, "%openrl status")
    (shown,) = [m for m in msgs if m["msg_type"] == "display_data"]
    data = shown["content"]["data"]
    assert "application/vnd.jupyter.widget-view+json" in data  # the live widget
    assert "status-run" in data["text/plain"] and "tinker://" in data["text/plain"]  # its text: a snapshot
    # The cell is done; the panel refreshes from its thread: a new step's reward shows up by itself.
    # (A comm message after the cell is done: only the panel's thread sends one. No bound on how soon: the 1 s
    # interval is the panel's own (tests/lab/test_lease_panel.py), and a loaded machine delays the kernel, not the
    # rule.)
    execute(kernel, "run.log(1, reward=0.75)\nrun.flush()")
    comm_values(kernel, lambda v: "0.75" in v, timeout=120)
    execute(kernel, "%openrl release status-run")
    comm_values(kernel, lambda v: "released" in v)  # its row stays, marked released (the kernel's lease lingers)
    out = printed(execute(kernel, "print(repr(get_ipython().find_line_magic('openrl').__self__.status_panel))")[1])
    assert "status-run" in out and "released" in out  # the repr follows the live rows
    execute(kernel, "get_ipython().find_line_magic('openrl').__self__.status_panel.close()")


def test_top_shows_each_waiter_with_the_orchestrators_reason_and_rough_wait(ip, lab, capsys):
    import threading

    from openrl_lab.orchestrator import TimeSliceOrchestratorClient

    bob_key = make_key(lab.home, "bob-top")
    holder = TimeSliceOrchestratorClient(lab.grpc_target, api_key=bob_key, job="bob-top-secret")
    mine = TimeSliceOrchestratorClient(lab.grpc_target, api_key=lab.api_key, job="top-waiter")
    try:
        with holder.on_accelerators("default", kind="warm"):
            pass  # one phase of bob's: its length is known
        held = holder.acquire("default", kind="bob_hold")
        t = threading.Thread(target=lambda: mine.release(mine.acquire("default", kind="wait_here", timeout=60)))
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not mine.get_status("default").queue:
            time.sleep(0.05)
        ip.run_line_magic("openrl", "top")
        out = capsys.readouterr().out
        line = next(ln for ln in out.splitlines() if "top-waiter" in ln)
        assert line.strip().startswith("#1 top-waiter (wait_here): next: waits for another user's job"), line
        assert re.search(r", ~\d+ s$", line), line
        assert "bob-top-secret" not in out and "bob_hold" not in out
        holder.release(held)
        t.join(60)
    finally:
        holder.close()
        mine.close()


def test_sandbox_says_where_it_stands_and_sets_the_url_for_sandboxfusion_clients(ip, capsys, monkeypatch):
    monkeypatch.delenv("SANDBOX_URL", raising=False)
    ip.run_line_magic("openrl", "connect")
    capsys.readouterr()
    ip.run_line_magic("openrl", "sandbox --env")
    line, note = capsys.readouterr().out.splitlines()
    assert line.startswith("sandbox: bubblewrap") and "warm of" in line and "you: " in line, line
    assert "SANDBOX_URL set" in note and os.environ["SANDBOX_URL"].endswith("/sandbox/run_code")
    assert ip.user_ns.get("SANDBOX_URL") is None  # the key-bearing URL is not printed or bound
