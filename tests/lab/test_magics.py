"""`%openrl` in a real IPython shell against a real control plane: usage errors are one line, commands work."""

from __future__ import annotations

import re

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell


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


@pytest.mark.parametrize("line, message", [
    ("", "a command is needed: connect, lease"),
    ("bogus", "invalid choice: 'bogus'"),
    ("lease", "the following arguments are required: name"),
    ("lease x --rank many", "argument --rank: invalid int value: 'many'"),
    ("attach ghost-run", "%openrl attach: no lease named 'ghost-run'"),
    ("lease x --group nowhere", "openrl_group 'nowhere' is not a group of this server"),
    ("lease x --as 2bad", "--as '2bad' is not a Python identifier"),
    ("phase --group default", "%%openrl phase is a cell magic"),
    ("lease 'unclosed", "%openrl: No closing quotation"),
])
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
    assert "default" in top and re.search(r"kernel-default \[up\] group default, cpu on \S+: [1-9]\d* jobs?, ", top), top
    ip.run_line_magic("openrl", "plot magic-run --metrics loss")
    assert "magic-run" in capsys.readouterr().out  # the plot's text repr
    ip.run_line_magic("openrl", "attach magic-run")
    assert "history: 2 steps (last 1)" in capsys.readouterr().out
    ip.run_line_magic("openrl", "release magic-run")
    assert "released magic-run" in capsys.readouterr().out
    with pytest.raises(UsageError, match="no lease named 'magic-run'"):
        ip.run_line_magic("openrl", "attach magic-run")


def test_phase_cell_holds_the_group_and_releases_on_error(ip, capsys):
    ip.run_cell_magic("openrl", "phase --group trainer-group --kind notebook-cell --verbose", "phase_ran = 41 + 1")
    assert ip.user_ns["phase_ran"] == 42
    assert "phase on trainer-group: waited" in capsys.readouterr().out
    ip.run_cell_magic("openrl", "phase --group trainer-group", "raise RuntimeError('boom in a phase')")
    lab = ip.magics_manager.registry["OpenRLMagics"].lab
    status = lab.orchestrator.get_status("trainer-group")
    assert status.holder is None  # the raising cell released its slice
    kinds = lab.timeline("default")["kind"].tolist()
    assert "notebook-cell" in kinds
