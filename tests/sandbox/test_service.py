"""The sandbox service where its users meet it: SandboxFusion's run_code over real HTTP on a real lab (the key in
the URL, as a client that sends no headers of its own passes it), the notebook's client (`lab.sandbox`), hostile
programs run through the lab (each contained, the service serving the next one), users sharing the pool, the
caller's own accounting and the operator's /metrics. The isolation itself, program by program: test_isolation."""

from __future__ import annotations

import asyncio
import base64
import re
import textwrap
import threading
import time

import httpx
import psutil
import pytest

from openrl_lab.lab import Lab
from openrl_lab.sandbox.client import SandboxError, sandbox_url, status_line
from tests.conftest import make_key

pytestmark = pytest.mark.server


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture(scope="module")
def alice(lab):
    client = Lab.connect(lab.base_url, api_key=lab.api_key, home=lab.home)
    yield client
    client.close()


@pytest.fixture(scope="module")
def bob(lab):
    client = Lab.connect(lab.base_url, api_key=make_key(lab.home, "bob-sandbox"))
    yield client
    client.close()


def test_run_code_speaks_sandboxfusion_with_the_key_in_the_url(lab):
    body = {
        "code": "import sys\ndata = open('data.txt').read()\nopen('out.txt', 'w').write(data[::-1])\n"
        "print(data.upper(), input())\nprint('to stderr', file=sys.stderr)",
        "language": "python",
        "run_timeout": 10,
        "compile_timeout": 10,  # SandboxFusion's; accepted
        "stdin": "from stdin\n",
        "files": {"data.txt": b64("abc")},
        "fetch_files": ["out.txt", "missing.txt"],
        "extra_field_of_sandboxfusion": True,  # ignored, as SandboxFusion's other fields are
    }
    r = httpx.post(sandbox_url(lab.base_url, lab.api_key), json=body, timeout=60)  # user info: HTTP Basic
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["status"] == "Success" and d["message"] == "" and d["compile_result"] is None
    run = d["run_result"]
    assert (run["status"], run["return_code"], run["stdout"]) == ("Finished", 0, "ABC from stdin\n")
    assert run["stderr"] == "to stderr\n" and run["execution_time"] > 0
    assert d["files"] == {"out.txt": b64("cba")}  # a file it did not write is not there
    bash = httpx.post(
        f"{lab.base_url}/sandbox/run_code",
        json={"code": "echo $((6 * 7)) $(cat n.txt)", "language": "bash", "files": {"n.txt": b64("x")}},
        headers={"Authorization": f"Bearer {lab.api_key}"},
        timeout=60,
    ).json()
    assert bash["status"] == "Success" and bash["run_result"]["stdout"] == "42 x\n"


def test_a_programs_failures_are_answers_and_a_bad_request_is_named(lab, alice):
    sb = alice.sandbox
    failed = sb.run("import sys\nprint('partial')\nsys.exit(3)")
    assert (failed.status, failed.return_code, failed.stdout, failed.ok) == ("Failed", 3, "partial\n", False)
    assert "return code 3" in failed.message
    slow = sb.run("while True:\n    pass", timeout=1)
    assert slow.status == "Failed" and slow.timed_out and slow.return_code is None
    assert "run_timeout" in slow.message and 1 <= slow.execution_time < 30
    raised = sb.run("raise ValueError('boom')")
    assert raised.return_code == 1 and "ValueError: boom" in raised.stderr

    url = f"{lab.base_url}/sandbox/run_code"
    key = {"X-API-Key": lab.api_key}

    def refused(body: dict, status: int = 400) -> str:
        r = httpx.post(url, json=body, headers=key, timeout=30)
        assert r.status_code == status, (body, r.status_code, r.text)
        return r.json()["detail"] if isinstance(r.json()["detail"], str) else r.text

    assert "cobol" in refused({"code": "x", "language": "cobol"})
    assert "files" in refused({"code": "x", "files": {"a.txt": "not base64!"}})
    assert "run_timeout 100000 s is over this lab's limit" in refused({"code": "x", "run_timeout": 100000})
    assert "memory_limit_MB" in refused({"code": "x", "memory_limit_MB": 1 << 30})
    assert "../escape" in refused({"code": "x", "files": {"../escape": b64("x")}})
    assert "code" in refused({"language": "python"})
    r = httpx.post(url, json={"code": "print(1)"}, timeout=30)
    assert r.status_code == 401 and "missing API key" in r.json()["detail"]
    r = httpx.post(url, json={"code": "print(1)"}, headers={"X-API-Key": "tml-" + "x" * 40}, timeout=30)
    assert r.status_code == 401 and "unknown API key" in r.json()["detail"]
    r = httpx.post(url.replace("://", "://openrl:tml-wrong@"), json={"code": "print(1)"}, timeout=30)
    assert r.status_code == 401
    with pytest.raises(SandboxError, match="cobol"):
        sb.run("x", language="cobol")


LEAKED = "LEAKED"


def hostile_programs(lab) -> dict[str, tuple[str, dict]]:
    """Each prints LEAKED if its attack worked; `kw`: run's settings for it."""
    home, pid, port = str(lab.home), psutil.Process().pid, lab.port
    programs = {
        "the lab's home (its database, keys, other users' checkpoints)": f"""
            import os
            for p in [{home!r} + "/state.db", {home!r} + "/checkpoints", {home!r}]:
                try:
                    os.listdir(p) if os.path.isdir(p) else open(p, "rb").read(1)
                    print("LEAKED", p)
                except OSError:
                    pass""",
        "another process and its environment": f"""
            import os
            print(sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
            try:
                open("/proc/{pid}/environ", "rb").read()
                print("LEAKED")
            except OSError:
                pass""",
        "the lab's own port on loopback": f"""
            import socket
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", {port}))
                print("LEAKED")
            except OSError as e:
                print("refused", e)""",
        "writes outside its scratch": """
            for p in ["/etc/x", "/usr/x", "/x", "/proc/sys/kernel/x"]:
                try:
                    open(p, "w").write("x")
                    print("LEAKED", p)
                except OSError:
                    pass""",
        "a fork bomb": """
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass""",
        "memory": """
            x = bytearray(8 << 30)
            print("LEAKED")""",
        "disk": """
            f = open("big", "wb")
            for _ in range(4096):
                f.write(b"x" * (1 << 20))
            print("LEAKED")""",
        "a child that outlives it": """
            import subprocess
            subprocess.Popen(["sleep", "4321"], start_new_session=True)
            print("started")""",
        "an output flood": """
            import sys
            for _ in range(100):
                sys.stdout.write("x" * (1 << 20))""",
    }
    settings = {"a fork bomb": {"timeout": 3}, "an output flood": {"timeout": 20}}
    return {name: (textwrap.dedent(code).strip(), settings.get(name, {})) for name, code in programs.items()}


def test_hostile_programs_are_contained_and_the_service_keeps_serving(lab, alice):
    sb = alice.sandbox
    before = {p.pid for p in psutil.process_iter()}
    for name, (code, kw) in hostile_programs(lab).items():
        r = sb.run(code, **kw)
        assert LEAKED not in r.stdout, (name, r)
        assert r.status in ("Success", "Failed"), (name, r)  # contained by the sandbox, not a sandbox failure
        if name == "an output flood":
            assert r.truncated and len(r.stdout) <= (1 << 20) + 1024, (name, len(r.stdout))
        if name in ("memory", "disk"):
            assert not r.ok, (name, r)
        after = sb.run("print(1)")
        assert (after.status, after.stdout) == ("Success", "1\n"), (name, after)
    time.sleep(0.5)
    left = [p for p in psutil.process_iter(["pid", "cmdline"]) if p.pid not in before]
    assert not [p for p in left if p.info["cmdline"] and "4321" in p.info["cmdline"]], left  # the orphan died too


def test_a_batch_answers_in_order_and_one_users_group_does_not_hold_the_pool(lab, alice, bob):
    results = alice.sandbox.run_many([f"print({i} * {i})" for i in range(10)] + [{"code": "exit(2)"}])
    assert [r.stdout for r in results[:10]] == [f"{i * i}\n" for i in range(10)]
    assert results[10].return_code == 2
    assert [r.stdout for r in asyncio.run(alice.sandbox.arun_many(["print('a')", "print('b')"]))] == ["a\n", "b\n"]

    # alice's RL group: 8 programs of 3 s, at most 4 of hers at once; bob's one check does not wait behind them
    per_user = alice.sandbox.status()["limits"]["per_user"]
    done = []
    group = threading.Thread(
        target=lambda: done.append(alice.sandbox.run_many(["import time\ntime.sleep(3)"] * (2 * per_user))),
        daemon=True,
    )
    group.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        you = alice.sandbox.status()["you"]
        if you["running"] == per_user and you["waiting"] == per_user:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"alice's group never ran {per_user} at once with {per_user} waiting: {you}")
    assert bob.sandbox.run("print('bob')").stdout == "bob\n"
    assert group.is_alive(), "bob's run came back only after alice's whole group"  # it waited for none of hers
    group.join(120)
    assert done and all(r.ok for r in done[0]), done


def test_status_is_the_callers_own_and_metrics_count_outcomes(lab, alice, bob):
    alice.sandbox.run("print(1)")
    mine, theirs = alice.sandbox.status(), bob.sandbox.status()
    assert mine["available"] and "bubblewrap" in mine["isolation"]
    assert mine["you"]["runs"] > theirs["you"]["runs"] >= 0 and mine["you"]["outcomes"]["success"] >= 1
    assert mine["pool"]["size"] >= 1
    line = status_line(mine)
    assert line.startswith("sandbox: ") and "warm of" in line and "success" in line
    text = httpx.get(f"{lab.base_url}/metrics", timeout=30).text  # open on loopback
    success = re.search(r'^openrl_sandbox_executions_total\{outcome="success"\} (\S+)$', text, re.M)
    assert success and float(success.group(1)) >= mine["you"]["outcomes"]["success"]
    assert re.search(r"^openrl_sandbox_warm \S+$", text, re.M) and "openrl_sandbox_execution_seconds_bucket" in text
    assert "bob-sandbox" not in text  # no user names in the operator's series
