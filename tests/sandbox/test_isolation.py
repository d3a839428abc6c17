"""The sandbox's isolation against hostile programs: each attempt is refused or contained, and the pool still
serves the next run (`print(1)` after each). Real bubblewrap, real namespaces, real seccomp; no stand-ins."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from openrl_lab.sandbox.isolation import UID_BASE, Limits, check_host
from openrl_lab.sandbox.pool import SandboxPool

pytestmark = [pytest.mark.server, pytest.mark.timeout(60)]

FAST = Limits(wall_s=5.0, cpu_s=5.0)


@pytest.fixture(scope="module")
def loop():
    check_host()
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def pool(loop):
    p = SandboxPool(size=2, limits=FAST)
    loop.run_until_complete(p.start())
    yield p
    loop.run_until_complete(p.aclose())


def run(loop, pool, code, language="python", **kw):
    return loop.run_until_complete(pool.run(code, language, **kw))


def still_serves(loop, pool):
    r = run(loop, pool, "print(1)")
    assert (r.status, r.return_code, r.stdout) == ("Finished", 0, "1\n"), r


def test_check_host_names_the_mechanism():
    line = check_host()
    assert "bubblewrap" in line and "seccomp" in line and "rlimits" in line


def test_cannot_read_host_secrets(loop, pool, tmp_path):
    token = uuid.uuid4().hex
    secrets = [tmp_path / "secret.txt", Path("/root") / f".openrl-sandbox-test-{token}"]
    for s in secrets:
        s.write_text(token)
    try:
        code = (
            "import os, sys\n"
            f"paths = {[str(s) for s in secrets]!r} + ['/work', '/home', '/root', os.path.expanduser('~/..')]\n"
            "for i, p in enumerate(paths):\n"
            "    try:\n"
            "        print(i, open(p).read() if os.path.isfile(p) else os.listdir(p))\n"
            "    except OSError as e:\n"
            "        print(i, 'refused', type(e).__name__)\n"
        )
        r = run(loop, pool, code)
        assert r.status == "Finished" and r.return_code == 0, r
        assert token not in r.stdout
        assert "0 refused" in r.stdout and "1 refused" in r.stdout
        assert "2 refused" in r.stdout  # /work: nothing (the lab's venv, wherever it lies, is at its own path)
        assert "3 refused" in r.stdout and "4 ['.pyenv']" in r.stdout  # /home; /root: only the prefix's path
    finally:
        secrets[1].unlink()
    still_serves(loop, pool)


def test_proc_shows_only_its_own_processes(loop, pool):
    code = (
        "import os\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "try:\n    open('/proc/1/environ','rb').read(); print('pid1 environ readable')\n"
        "except OSError as e:\n    print('pid1', type(e).__name__)\n"
    )
    r = run(loop, pool, code)
    pids = eval(r.stdout.splitlines()[0])
    assert pids and max(pids) < 10, r.stdout  # its own namespace: the stub (1) and the program (2)
    assert "pid1 environ readable" not in r.stdout  # PID 1 is the sandbox's stub (non-dumpable), not the host's
    assert "OPENRL" not in r.stdout
    still_serves(loop, pool)


def test_writes_outside_scratch_fail_and_scratch_is_fresh(loop, pool):
    code = (
        "import os\n"
        "for p in ['/x', '/usr/x', '/etc/x', '/dev/x']:\n"
        "    try:\n        open(p, 'w').write('x'); print('wrote', p)\n"
        "    except OSError as e:\n        print('refused', p)\n"
        "print(sorted(os.listdir('.')), sorted(os.listdir('/tmp')))\n"
        "open('left.txt','w').write('x'); open('/tmp/left.txt','w').write('x')\n"
    )
    r = run(loop, pool, code)
    assert "wrote" not in r.stdout and r.stdout.count("refused") == 4, r
    assert "['.tmp', 'main.py'] []" in r.stdout
    r2 = run(loop, pool, "import os; print(os.path.exists('left.txt'), os.path.exists('/tmp/left.txt'))")
    assert r2.stdout == "False False\n", r2


def test_no_network(loop, pool):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]
    accepted = []

    def accept():
        srv.settimeout(8)
        with contextlib.suppress(OSError):
            accepted.append(srv.accept())

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    code = (
        "import socket\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    try:\n        socket.create_connection(addr, timeout=2); print('connected', addr)\n"
        "    except OSError as e:\n        print('refused', addr, type(e).__name__)\n"
    )
    try:
        r = run(loop, pool, code)
        # the control: the server is reachable from the host
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        t.join(10)
    finally:
        srv.close()
    assert "connected" not in r.stdout and r.stdout.count("refused") == 3, r
    assert len(accepted) == 1  # only the host's own connection
    still_serves(loop, pool)


def _sandbox_procs(uids: set[int]) -> int:
    """Processes below this one, or of one of `uids` (this pool's sandboxes', as root): not the machine's, where
    other test runs start processes and sandboxes of their own meanwhile (`make test` runs tests/vllm and
    tests/cookbook, whose lab has a sandbox pool, beside this suite)."""
    below = {p.pid for p in psutil.Process().children(recursive=True)}
    by_uid = {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in uids}
    return len(below | by_uid)


def _pool_uids() -> set[int]:
    """The sandbox uids of the processes below this one (this pool's warm sandboxes, as root)."""
    uids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            uids.add(p.uids().real)
        except psutil.Error:
            continue
    return {u for u in uids if u >= UID_BASE}


def test_fork_bomb_is_contained(loop, pool):
    uids = _pool_uids()  # the bomb runs in one of the warm sandboxes these are
    before = _sandbox_procs(uids)
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.monotonic()
    r = run(loop, pool, code, limits=Limits(wall_s=2.0, cpu_s=2.0, processes=16))
    assert r.status == "TimeLimitExceeded", r
    assert time.monotonic() - t0 < 20
    after = _sandbox_procs(uids)
    assert after < before + 10, (before, after)  # the bomb is gone (the pool's warm sandboxes are a few)
    still_serves(loop, pool)


def test_memory_exhaustion_fails_inside(loop, pool):
    code = "try:\n    b = bytearray(4 << 30); print('allocated')\nexcept MemoryError:\n    print('MemoryError')\n"
    r = run(loop, pool, code)
    assert r.stdout == "MemoryError\n", r
    assert psutil.Process().memory_info().rss < 4 << 30
    still_serves(loop, pool)


def test_disk_exhaustion_fails_inside(loop, pool):
    code = (
        "chunk = b'x' * (1 << 20)\n"
        "for name, n in [('big.bin', 8), ('/tmp/a.bin', 3), ('b.bin', 3), ('c.bin', 3)]:\n"
        "    try:\n"
        "        with open(name, 'wb') as f:\n"
        "            for _ in range(n): f.write(chunk)\n"
        "        print('ok', name)\n"
        "    except OSError as e:\n        print('failed', name, e.errno)\n"
    )
    r = run(loop, pool, code, limits=Limits(wall_s=5, cpu_s=5, file_bytes=4 << 20, scratch_bytes=8 << 20))
    assert "failed big.bin 27" in r.stdout, r  # EFBIG: past file_bytes
    assert "ok /tmp/a.bin" in r.stdout and "failed c.bin 28" in r.stdout, r  # ENOSPC: scratch and /tmp in all
    still_serves(loop, pool)


def test_infinite_loop_times_out(loop, pool):
    t0 = time.monotonic()
    r = run(loop, pool, "while True: pass", limits=Limits(wall_s=1.0, cpu_s=10))
    assert r.status == "TimeLimitExceeded" and r.return_code is None, r
    assert 0.9 <= r.execution_time < 5, r
    assert time.monotonic() - t0 < 15  # liveness bound, generous
    still_serves(loop, pool)


def test_cpu_limit(loop, pool):
    r = run(loop, pool, "while True: pass", limits=Limits(wall_s=10.0, cpu_s=1.0))
    assert r.status == "TimeLimitExceeded" and "CPU" in r.message, r


def test_orphan_dies_with_the_sandbox(loop, pool):
    marker = uuid.uuid4().hex[:8]
    code = f"import subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\nprint('{marker}')\n"
    r = run(loop, pool, code)
    assert r.status == "Finished" and r.stdout == f"{marker}\n", r
    sleepers = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "1000"]]
    assert sleepers == []
    still_serves(loop, pool)


def test_output_flood_is_truncated(loop, pool):
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100): sys.stdout.write(chunk)\n"
    code += "print('end', file=sys.stderr)\n"
    t0 = time.monotonic()
    r = run(loop, pool, code, limits=Limits(wall_s=20, cpu_s=20, output_bytes=1 << 16))
    assert r.truncated and len(r.stdout) == 1 << 16 and r.stderr == "end\n", (r.status, len(r.stdout), r.stderr)
    assert r.status == "Finished" and r.return_code == 0
    assert time.monotonic() - t0 < 20  # liveness bound, generous
    still_serves(loop, pool)


def test_seccomp_refuses_ptrace_unshare_mount(loop, pool):
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for name, call in [('ptrace', lambda: libc.ptrace(16, 1, 0, 0)),\n"
        "                   ('unshare', lambda: libc.unshare(0x10000000)),\n"
        "                   ('mount', lambda: libc.mount(b'none', b'/sandbox', b'tmpfs', 0, None))]:\n"
        "    rc = call(); print(name, rc, os.strerror(ctypes.get_errno()))\n"
    )
    r = run(loop, pool, code)
    assert r.stdout.splitlines() == [
        "ptrace -1 Operation not permitted",
        "unshare -1 Operation not permitted",
        "mount -1 Operation not permitted",
    ], r
    still_serves(loop, pool)


def test_files_in_and_out_and_stdin(loop, pool):
    code = (
        "import sys\ndata = open('data/in.txt').read()\n"
        "open('out.txt', 'w').write(data.upper() + sys.stdin.read())\nprint(__name__)\n"
    )
    r = run(loop, pool, code, stdin="from stdin", files={"data/in.txt": b"hello "}, fetch_files=["out.txt", "none"])
    assert r.stdout == "__main__\n" and r.files == {"out.txt": b"HELLO from stdin"}, r
    b = run(loop, pool, "read x; echo got $x; exit 7", "bash", stdin="abc\n")
    assert (b.status, b.return_code, b.stdout) == ("Finished", 7, "got abc\n"), b


def test_bad_input_raises(loop, pool):
    for kw, word in [
        ({"language": "cobol"}, "language"),
        ({"files": {"../x": b""}}, "escapes"),
        ({"files": {"/etc/x": b""}}, "absolute"),
        ({"fetch_files": ["../../etc/passwd"]}, "escapes"),
        ({"limits": Limits(wall_s=-1)}, "wall_s"),
        ({"limits": Limits(memory_bytes=0)}, "memory_bytes"),
    ]:
        with pytest.raises(ValueError, match=word):
            run(loop, pool, "print(1)", **kw)
    still_serves(loop, pool)


def test_many_runs_at_once(loop):
    async def go():
        p = SandboxPool(size=2, limits=FAST)
        try:
            return await asyncio.gather(*(p.run(f"print({i} * 2)") for i in range(6)))
        finally:
            await p.aclose()

    results = loop.run_until_complete(go())
    assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(6)], results
