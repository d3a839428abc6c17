"""The first process inside a sandbox (its PID 1): it starts with the sandbox, waits warm for one program, runs it
once and reports how it ended. Never imported by the lab: `isolation.py` runs this file's text with
`python -I -c` inside bubblewrap, its two pipe fds as arguments (pod isolation, with no bubblewrap: also the
scratch directory and the seccomp filter's fd, which this process applies to itself).

    ctl (read)    the host's one request: a 4-byte big-endian length, then JSON {language, code, files: {name:
                  base64}, fetch_files, limits: {cpu_s, memory_bytes, processes, file_bytes, open_files}}
    rep (write)   b"R" once warm (interpreter up, waiting), b"S" when the program starts, then one frame (length +
                  JSON): {"exit": N} or {"signal": N}, "cpu_s", "files": {name: base64}; or {"error": "..."}

Why the program cannot forge what the host reads: the host takes stdout and stderr from its own pipes, and the
outcome from `rep`, which only this process holds. The program runs in a forked child that closes `rep` and
`ctl` before any of its code runs; this process makes itself non-dumpable (so the program, same uid, cannot
open /proc/1/fd/N, nor pidfd_getfd it; ptrace is off by seccomp besides) and, being PID 1 of the sandbox's PID
namespace, cannot be signalled from inside it (the kernel drops signals to a namespace's init that it has no
handler for: SIGINT's is reset here). When it exits, the kernel kills everything left in the namespace.

Python runs in this warm interpreter (forked, so the interpreter's ~35 ms start is paid before the request
comes, see benchmarks/sandbox_throughput.py) as `python main.py` would: `__name__ == "__main__"`, sys.argv
["main.py"], /sandbox first on sys.path, tracebacks and SystemExit as CPython prints and exits. bash runs
`bash main.sh` (exec'd). The program's rlimits are set in the child just before its first instruction, so a
warm sandbox serves any `Limits` and its own start-up is not charged to the program's CPU time.
"""

import base64
import builtins
import ctypes
import json
import os
import resource
import signal
import stat
import sys
import types

SCRATCH = "/sandbox"  # pod isolation: the directory given as the third argument
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


def _prctl_dumpable(on):
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0)


def _read_exact(fd, n):
    chunks = []
    while n:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            raise EOFError("the host closed the request pipe")
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _frame(obj):
    body = json.dumps(obj).encode()
    return len(body).to_bytes(4, "big") + body


def _inside(path):
    real = os.path.realpath(os.path.join(SCRATCH, path))
    return real.startswith(SCRATCH + "/")


def _place(name, data):
    if not _inside(name):
        raise ValueError(f"{name!r} is outside {SCRATCH}")
    path = os.path.join(SCRATCH, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)


def _fetch(name, limit):
    """A regular file of the scratch directory the program left, read without following it anywhere else (a
    symlink to /proc/1/fd/N, a FIFO: skipped), at most `limit` bytes."""
    if not _inside(name):
        return None
    try:
        fd = os.open(os.path.join(SCRATCH, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks, left = [], limit
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _limit(limits):
    cpu = max(1, int(-(-limits["cpu_s"] // 1)))
    for which, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU at the soft limit, SIGKILL a second later
        (resource.RLIMIT_AS, (limits["memory_bytes"],) * 2),
        (resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
        # counted per uid in this sandbox's user namespace: this process and the program's; +1 for this one
        (resource.RLIMIT_NPROC, (limits["processes"] + 1,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(which, value)


def _run_python(path):
    """Run main.py here as CPython runs a script; returns the exit status."""
    sys.argv[:] = ["main.py"]
    sys.path.insert(0, SCRATCH)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None, __spec__=None)
    sys.modules["__main__"] = main
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with open(path, "rb") as f:
            source = f.read()
        code = compile(source, path, "exec")
    except SyntaxError as e:
        sys.excepthook(type(e), e.with_traceback(None), None)
        return 1
    try:
        exec(code, main.__dict__)
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - the program's own exception, printed as CPython prints it
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # without this file's frame
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        if isinstance(e, KeyboardInterrupt):
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        return 1
    return 0


def _finish(status):
    """End the program's process as CPython's shutdown would, less the teardown of every module (~10-20 ms that
    only frees memory): non-daemon threads joined, atexit handlers run, stdio flushed."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed, as CPython prints an atexit handler's error
        sys.excepthook(*sys.exc_info())
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - a closed or broken stdout: as CPython, status 120
            status = 120 if status == 0 else status
    os._exit(status & 0xFF)


def _seccomp(fd):
    """Pod isolation: load the host's seccomp filter (BPF, from `fd`) for this process and all it starts."""
    with os.fdopen(fd, "rb") as f:
        bpf = f.read()

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    for args in ((PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0)):
        if libc.prctl(*args) != 0:
            raise OSError(ctypes.get_errno(), f"prctl{args[:2]} failed: the seccomp filter cannot be applied")


def main():
    global SCRATCH  # noqa: PLW0603 - one value for the whole (single-run) process, set before any use
    ctl, rep = int(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:  # pod isolation: no bwrap around it; the scratch and the filter are given
        SCRATCH = sys.argv[3]
        os.chdir(SCRATCH)
        if len(sys.argv) > 4:
            _seccomp(int(sys.argv[4]))
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 with no handler: the program cannot signal it
    _prctl_dumpable(False)
    _write_all(rep, b"R")
    try:
        req = json.loads(_read_exact(ctl, int.from_bytes(_read_exact(ctl, 4), "big")))
    except (EOFError, ValueError):
        os._exit(3)
    os.close(ctl)
    language = req["language"]
    try:
        for name, data in req["files"].items():
            _place(name, base64.b64decode(data))
        script = "main.py" if language == "python" else "main.sh"
        _place(script, req["code"].encode("utf-8", "surrogatepass"))
    except (OSError, ValueError) as e:
        _write_all(rep, _frame({"error": f"could not place the program's files in {SCRATCH}: {e}"}))
        os._exit(0)
    path = os.path.join(SCRATCH, script)
    _write_all(rep, b"S")
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rep)
            _prctl_dumpable(True)
            _limit(req["limits"])
            if language == "python":
                _finish(_run_python(path))
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            os.execv("/bin/bash", ["bash", "main.sh"])
        except BaseException as e:  # noqa: BLE001 - reported on stderr; the host sees the exit status 127
            print(f"sandbox: could not start the program: {e}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    out = {"cpu_s": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(status):
        out["signal"] = os.WTERMSIG(status)
    else:
        out["exit"] = os.WEXITSTATUS(status)
    files = {}
    for name in req["fetch_files"]:
        data = _fetch(name, req["limits"]["file_bytes"])
        if data is not None:
            files[name] = base64.b64encode(data).decode()
    out["files"] = files
    _write_all(rep, _frame(out))
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
