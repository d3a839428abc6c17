"""The test run's watchdog: a process of its own that outlives pytest, so that nothing a run started outlives it.

`tests/harness.py` starts it at the beginning of every pytest run (`python tests/reaper.py RUN_DIR TOKEN`), in a
session of its own (a Ctrl-C at the terminal does not reach it), holding the read end of a pipe whose write end
only pytest holds. Every process the run starts inherits `OPENRL_TEST_RUN_<token>=1` in its environment (one
variable per run, so that a pytest run inside a test carries both its own and its parent's). When the
pipe closes (pytest ended: normally, by SIGTERM, SIGINT or SIGKILL, or by a crash), the reaper kills every process
that carries the token or that it has seen below pytest in the process tree (servers, kernels, Jupyter, ipykernels,
Chromium and Playwright's driver, whatever started them and whatever session they put themselves in).

It also keeps the whole-suite deadline (`OPENRL_TEST_DEADLINE`, seconds since the epoch, which `make test` sets):
past it, it writes which test was running (and pytest's Python stacks) to the terminal, stops pytest, and sweeps.

Standard library only, Linux `/proc` only (elsewhere it does nothing): it must run in every environment the suite
runs in, the vLLM and cookbook ones and a bare GPU machine included.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path

TOKEN_PREFIX = "OPENRL_TEST_RUN_"
DEADLINE_VAR = "OPENRL_TEST_DEADLINE"
POLL_S = 1.0  # how often the process tree below pytest is read while it runs
GRACE_S = 5.0  # SIGTERM, then this long, then SIGKILL


def _say(msg: str) -> None:
    try:  # the terminal's stderr: tests/harness.py started this process with pytest's capture suspended
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    except OSError:
        pass


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat): with the pid, a process's identity."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _parents() -> dict[int, int]:
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(root: int) -> set[int]:
    """Every process below `root` in the process tree now."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def carrying(token: str) -> set[int]:
    """Every process whose environment says it belongs to the test run `token`."""
    needle = f"\0{TOKEN_PREFIX}{token}=1\0".encode()
    out = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                env = Path(f"/proc/{entry.name}/environ").read_bytes()
            except OSError:
                continue
            if needle in b"\0" + env + b"\0":
                out.add(int(entry.name))
    return out


def describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"{pid} {cmd[:160]}"


def _alive(pid: int, started: int | None) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and (started is None or _start_time(pid) == started)


def sweep(token: str, seen: dict[int, int | None], spare: set[int]) -> list[str]:
    """Kills what the run left behind: processes that carry `token`, and those in `seen` (pid -> start time) that
    are still the same processes. SIGTERM first, SIGKILL after GRACE_S. Returns what it found, described."""
    targets = {pid: _start_time(pid) for pid in carrying(token)}
    targets.update({pid: t for pid, t in seen.items() if pid not in targets})
    targets = {pid: t for pid, t in targets.items() if pid not in spare and _alive(pid, t)}
    found = [describe(pid) for pid in sorted(targets)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, t in targets.items():
            if _alive(pid, t):
                with contextlib.suppress(OSError):  # gone since _alive looked
                    os.kill(pid, sig)
        end = time.monotonic() + (GRACE_S if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < end and any(_alive(p, t) for p, t in targets.items()):
            time.sleep(0.1)
    return found


def _over_time(pytest_pid: int, run_dir: Path, deadline: float) -> None:
    """Past the suite's deadline: says where it was and why it stops, then stops pytest."""
    current = (run_dir / "current").read_text().strip() if (run_dir / "current").exists() else "?"
    stacks = run_dir / "stacks.txt"
    try:  # SIGUSR1: faulthandler (registered by tests/harness.py) writes every thread's stack into stacks.txt
        os.kill(pytest_pid, signal.SIGUSR1)
        time.sleep(2.0)
    except OSError:
        pass
    budget = os.environ.get("OPENRL_TEST_BUDGET_MIN", "?")
    _say(
        f"\n*** openrl-lab tests: the run went past the suite's deadline ({budget} min, until "
        f"{time.strftime('%H:%M:%S', time.localtime(deadline))}) while running {current}; stopping pytest (pid "
        f"{pytest_pid}) and everything it started. Its threads were at:\n"
        + (stacks.read_text(errors="replace")[-6000:] if stacks.exists() else "(no stacks written)\n")
        + "*** end of the deadline report ***"
    )
    (run_dir / "over-time").write_text(current + "\n")
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 2.0)):
        try:
            os.kill(pytest_pid, sig)
        except OSError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end and _alive(pytest_pid, None):
            time.sleep(0.1)


class _Stopped(Exception):
    pass


def _stopped(*_) -> None:
    raise _Stopped


def main(run_dir: Path, token: str) -> None:
    pytest_pid = os.getppid()
    pytest_started = _start_time(pytest_pid)
    deadline = float(os.environ.get(DEADLINE_VAR) or "inf")
    me = {os.getpid()}
    seen: dict[int, int | None] = {}
    stop = sys.stdin.fileno()
    signal.signal(signal.SIGTERM, _stopped)  # a reaper told to stop still sweeps first
    try:
        while _alive(pytest_pid, pytest_started):  # a forked child may hold the pipe open: pytest's life decides
            ready, _, _ = select.select([stop], [], [], POLL_S)
            if ready and not os.read(stop, 4096):
                break  # EOF: pytest is gone, or ended and closed the pipe
            for pid in descendants(pytest_pid) - me:
                if pid not in seen:
                    seen[pid] = _start_time(pid)
            if time.time() > deadline:
                _over_time(pytest_pid, run_dir, deadline)
                break
        end = time.monotonic() + 15.0  # a pytest that ended normally is still finishing (atexit handlers)
        while time.monotonic() < end and _alive(pytest_pid, pytest_started):
            time.sleep(0.1)
    except _Stopped:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ended_normally = (run_dir / "ended").exists()
    found = sweep(token, seen, me | {pytest_pid})
    shutil.rmtree(run_dir, ignore_errors=True)
    if found:
        how = "ended, but a test or fixture left" if ended_normally else "was stopped; it had started"
        _say(
            f"openrl-lab tests: pytest (pid {pytest_pid}) {how} {len(found)} processes, killed now:\n  "
            + "\n  ".join(found)
        )


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe ends this process
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    main(Path(sys.argv[1]), sys.argv[2])
