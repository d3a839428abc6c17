"""One sandbox: untrusted, model-written code run on this Linux host with the kernel's own isolation, no Docker.

Each sandbox is a bubblewrap (`bwrap`) process with every namespace unshared (user, pid, net, ipc, uts, cgroup):

- **files**: a read-only view of the system (/usr and its /bin, /lib, /lib64, /sbin, a minimal /etc written for it,
  the Python interpreter's own prefix `sys.base_prefix` and the lab's venv with its packages (numpy and the like,
  which graders import, at /opt/openrl-lab-venv wherever it lies; OPENRL_SANDBOX_LAB_PACKAGES=0: the bare
  interpreter), so that /root or /home around them stay unseen); the program's cwd `/sandbox` is a tmpfs of
  `scratch_bytes`, and /tmp a link into it (so the two hold `scratch_bytes` in all); /dev/shm a tmpfs of its own
  (`SHM_BYTES`); / and /dev remounted read-only. Nothing of the lab's home, the rest of /work, the host's /tmp or
  other users' files is there at all.
- **processes**: its own PID namespace (`/proc` shows only its own PIDs) whose init is the stub (`_stub.py`);
  when the stub exits or is killed, the kernel kills everything left in it, a daemonized child included.
- **network**: its own network namespace, so only its own loopback: the host's 127.0.0.1 and everything outside
  are unreachable.
- **privileges**: `--cap-drop ALL`, `--new-session` (no TIOCSTI into a terminal), `--die-with-parent`, a clean
  environment (`--clearenv`, small PATH/HOME/LANG). When the lab runs as root, each sandbox runs as an
  unprivileged uid of its own (`UID_BASE` + n, taken with a lock file so several labs on one host never share
  one), so RLIMIT_NPROC (which root ignores) holds, and a fork bomb in one sandbox cannot starve another or the
  host. Not as root, the sandbox runs as the user's own uid: it still cannot reach the user's files (they are not
  mounted), and on kernels >= 5.14 RLIMIT_NPROC counts per user namespace, so only the sandbox's own processes;
  on older kernels it counts all the user's processes, so a user with many processes may see the sandbox's
  forks fail early.
- **seccomp** (`seccomp_filter`, made with pyseccomp over the system's libseccomp, handed to bwrap as BPF):
  default allow, EPERM for the kernel's attack surface that a program never needs: ptrace and cross-process
  memory (would let the program reach the stub), mounts and namespaces (escape routes; bwrap has made its own by
  then), keyrings, bpf, perf, userfaultfd (a race amplifier in exploits), io_uring (bypasses seccomp for the
  operations it carries), module loading, kexec, reboot, swap, clock setting, `open_by_handle_at` (the classic
  container escape), the new mount API, pidfd_getfd and kcmp; clone3 answers ENOSYS (its flags live in memory a
  filter cannot read, so libc falls back to clone, whose namespace flags are refused); sockets only of the
  families the network namespace isolates (unix, inet, inet6, netlink; vsock, for one, is not namespaced and
  reaches the hypervisor); prlimit only on itself. Other architectures' syscall tables (int 0x80) kill.
- **rlimits**: CPU, AS, FSIZE, NOFILE, NPROC and CORE=0, set by the stub in the program's process just before it
  runs, per execution (so a warm sandbox serves any `Limits`), inherited by everything it starts and never
  raisable again (no capabilities). The wall limit is the host's: past `wall_s` it SIGKILLs the stub.

Memory note: the tmpfs pages (scratch, /dev/shm) are not counted in RLIMIT_AS: a sandbox holds up to
`memory_bytes` + `scratch_bytes` + `SHM_BYTES` of the host's memory.

`Sandbox` is one such process, started warm and used once; `pool.SandboxPool` keeps several ready.

**pod isolation** (OPENRL_SANDBOX_ISOLATION=pod, `PodSandbox`): inside the chart's sandbox Pods, where bubblewrap
usually cannot run (no user namespaces under gVisor and many runtimes) and the Pod is the boundary (gVisor, a
NetworkPolicy with no egress, no service account token, non-root, read-only root). The same stub runs as a plain
child process per program, in a fresh 0700 scratch directory with an unguessable name under
OPENRL_SANDBOX_SCRATCH_DIR (an in-memory emptyDir), removed after the run, with the same rlimits and, where
pyseccomp works, the same seccomp filter (applied by the stub to itself) plus setsid/setpgid refused, so the
process group holds everything the program starts and is killed as one. What it does not give: namespaces (the
programs of one Pod share its uid, network and /proc: a hostile program that works at it can find a concurrent
run's scratch; `sandbox.poolSize: 1` where that matters), a per-run scratch size (the emptyDir's sizeLimit bounds
them all). It refuses to start outside a Pod (KUBERNETES_SERVICE_HOST) unless OPENRL_SANDBOX_POD_FORCE=1.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import fcntl
import functools
import json
import math
import os
import posixpath
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openrl_lab.settings import settings

LANGUAGES: tuple[str, ...] = ("python", "bash")

# When the lab runs as root: sandbox n runs as uid UID_BASE + n (n < UID_COUNT), each uid held by one sandbox at a
# time, host-wide (a lock file per uid under UID_LOCK_DIR). Pick a range no real user has on the host.
UID_BASE = 20000
UID_COUNT = 1000
UID_LOCK_DIR = "/run/openrl-lab-sandbox"  # 0755: the lock files in it are root's (0600)
# As root, the interpreter's prefix is usually under /root (0700), which bwrap, already the sandbox's uid, cannot
# resolve; a private mount namespace (util-linux `unshare`) binds it here first, then `setpriv` drops to the uid.
PREFIX_VIEW = UID_LOCK_DIR + "/python"
VENV_VIEW = UID_LOCK_DIR + "/venv"
# Where the lab's venv is inside a sandbox, wherever it lies on the host (under /tmp, say, where the sandbox puts
# a /tmp of its own): a venv finds itself by its pyvenv.cfg beside the interpreter it is started as.
VENV_IN_SANDBOX = "/opt/openrl-lab-venv"
# Paths the sandbox makes for itself: the interpreter's prefix cannot be bound under them.
OWN_PATHS = ("/tmp", "/sandbox", "/proc", "/dev", "/etc")
SCRATCH = "/sandbox"
SHM_BYTES = 1 << 20  # /dev/shm: POSIX semaphores and small shared memory (multiprocessing's locks live there)
START_TIMEOUT_S = 30.0  # a sandbox that is not warm by then failed (bwrap and the interpreter take ~60 ms)
REPORT_GRACE_S = 5.0  # after the program ends: its fetch_files and the namespace's teardown
PATH = "/usr/local/bin:/usr/bin:/bin"
_STUB = (Path(__file__).with_name("_stub.py")).read_text()


class SandboxUnavailable(RuntimeError):
    """The host cannot run sandboxes; the message names what it lacks and how to get it."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0  # wall-clock limit of the program
    cpu_s: float = 10.0  # RLIMIT_CPU
    memory_bytes: int = 512 << 20  # RLIMIT_AS
    processes: int = 64  # processes/threads the sandbox may have at once
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file it may write
    scratch_bytes: int = 64 << 20  # the writable scratch directory (and /tmp) in all
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 1 << 20  # stdout and stderr each; beyond it truncated

    def check(self) -> None:
        """ValueError naming the first limit out of range."""
        for name, lo, hi in (
            ("wall_s", 0.01, 24 * 3600.0),
            ("cpu_s", 0.01, 24 * 3600.0),
            ("memory_bytes", 32 << 20, 1 << 40),
            ("processes", 1, 1 << 16),
            ("file_bytes", 0, 1 << 40),
            ("scratch_bytes", 1 << 20, 1 << 40),
            ("open_files", 16, 1 << 20),
            ("output_bytes", 0, 1 << 31),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"limits.{name} must be a finite number, not {value!r}")
            if not lo <= value <= hi:
                raise ValueError(f"limits.{name}={value!r} is out of range [{lo}, {hi}]")


@dataclass
class Execution:
    status: str  # "Finished" (ran to its end, any return code) | "TimeLimitExceeded" | "Error" (the sandbox failed)
    return_code: int | None  # None unless Finished; a signal as -N
    stdout: str  # utf-8, errors="replace", at most output_bytes
    stderr: str
    execution_time: float  # wall seconds the program ran
    truncated: bool = False
    files: dict[str, bytes] = field(default_factory=dict)  # fetch_files that existed, by the name asked
    message: str = ""  # for Error, what failed


def check_name(name: str) -> str:
    """A file name relative to the scratch directory, normalized; ValueError if it escapes it."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ValueError(f"file name {name!r} is empty or not a string")
    if name.startswith("/"):
        raise ValueError(f"file name {name!r} is absolute: names are relative to the scratch directory {SCRATCH}")
    norm = posixpath.normpath(name)
    if norm == "." or norm == ".." or norm.startswith("../"):
        raise ValueError(f"file name {name!r} escapes the scratch directory {SCRATCH}")
    return norm


def check_request(
    code: str, language: str, stdin: str, files: Mapping[str, bytes] | None, fetch_files: Sequence[str], limits: Limits
) -> None:
    """ValueError naming the problem with a request, before any sandbox is used."""
    if language not in LANGUAGES:
        raise ValueError(f"unknown language {language!r}: one of {', '.join(LANGUAGES)}")
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, not {type(code).__name__}")
    if not isinstance(stdin, str):
        raise ValueError(f"stdin must be a str, not {type(stdin).__name__}")
    if not isinstance(limits, Limits):
        raise ValueError(f"limits must be a Limits, not {type(limits).__name__}")
    limits.check()
    script = "main.py" if language == "python" else "main.sh"
    for name, data in (files or {}).items():
        if check_name(name) == script:
            raise ValueError(f"file name {name!r} is the program's own {script}")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ValueError(f"files[{name!r}] must be bytes, not {type(data).__name__}")
    if isinstance(fetch_files, str):
        raise ValueError("fetch_files must be a sequence of names, not one str")
    for name in fetch_files:
        check_name(name)


# --- the host ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Host:
    bwrap: str
    bwrap_version: str
    python: str  # the interpreter the sandbox runs: the lab's venv's (a link to the real one), else the real one
    prefix: str  # sys.base_prefix, bound read-only when outside /usr
    venv: str | None  # the lab's venv (sys.prefix), bound read-only: its packages (numpy, ...) for programs
    as_root: bool
    seccomp: bytes  # the filter as BPF


def _python() -> tuple[str, str, str | None]:
    """(the interpreter to run, the base prefix, the venv to bind or None). Programs get the lab's own Python
    packages (numpy and the like, which graders import: what a SandboxFusion image offers too), read-only, unless
    OPENRL_SANDBOX_LAB_PACKAGES=0 or the lab runs outside a venv: then the bare interpreter."""
    prefix = os.path.realpath(sys.base_prefix)
    real = os.path.realpath(sys.executable)
    if not real.startswith(prefix + "/"):
        real = os.path.join(prefix, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    venv = os.path.realpath(sys.prefix)
    if venv == prefix or not settings().sandbox_lab_packages:
        return real, prefix, None
    return os.path.join(venv, "bin", os.path.basename(real)), prefix, venv


def seccomp_filter(pod: bool = False) -> tuple[bytes, int]:
    """The sandbox's seccomp filter as BPF (see the module docstring for what it refuses and why), and its rule
    count. `pod`: also setsid and setpgid (with no PID namespace, the process group is how every process of a
    program is found and killed). SandboxUnavailable if pyseccomp or the system's libseccomp is missing."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError, RuntimeError) as e:
        raise SandboxUnavailable(
            f"seccomp: pyseccomp or the system's libseccomp.so.2 is missing ({e}): "
            "pip install pyseccomp; apt-get install libseccomp2"
        ) from None
    f = sc.SyscallFilter(sc.ALLOW)
    rules = 0
    denied = [
        "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
        "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
        "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
        "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
        "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
        "reboot", "swapon", "swapoff", "io_uring_setup", "io_uring_enter", "io_uring_register",
        "acct", "quotactl", "syslog", "open_by_handle_at", "name_to_handle_at", "fanotify_init",
        "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "iopl", "ioperm", "uselib", "vhangup",
        "lookup_dcookie", "nfsservctl", "personality",
    ]  # fmt: skip
    for name in denied:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
            rules += 1
        except (OSError, ValueError, RuntimeError):  # a syscall this architecture or libseccomp does not know
            pass
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    # clone with any namespace flag (CLONE_NEWNS .. CLONE_NEWNET)
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    allowed_families = {1, 2, 10, 16}  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
    for call in ("socket", "socketpair"):
        for family in range(64):
            if family not in allowed_families:
                f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.EQ, family))
        f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.GE, 64))
    f.add_rule(sc.ERRNO(errno.EPERM), "prlimit64", sc.Arg(0, sc.NE, 0))
    rules += 3 + 7 + 2 * 61 + 1
    if pod:
        f.add_rule(sc.ERRNO(errno.EPERM), "setsid")
        f.add_rule(sc.ERRNO(errno.EPERM), "setpgid")
        rules += 2
    with tempfile.TemporaryFile() as tmp:
        f.export_bpf(tmp)
        tmp.seek(0)
        return tmp.read(), rules


@functools.cache
def _host() -> _Host:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: apt-get install bubblewrap (or `make sandbox-tools`)"
        )
    try:
        max_ns = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        max_ns = -1
    if max_ns == 0:
        raise SandboxUnavailable(
            "user namespaces are disabled here (user.max_user_namespaces=0): "
            "sysctl -w user.max_user_namespaces=15000 (as root), or run the lab where they are allowed"
        )
    with contextlib.suppress(OSError, ValueError):
        if Path("/proc/sys/kernel/unprivileged_userns_clone").read_text().strip() == "0" and os.geteuid() != 0:
            raise SandboxUnavailable(
                "unprivileged user namespaces are disabled here (kernel.unprivileged_userns_clone=0): "
                "sysctl -w kernel.unprivileged_userns_clone=1 (as root)"
            )
    out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10, check=False)
    version = out.stdout.strip() or "bubblewrap ?"
    python, prefix, venv = _python()
    clash = next((p for p in OWN_PATHS if prefix == p or prefix.startswith(p + "/")), None)
    if clash is not None:
        raise SandboxUnavailable(
            f"the lab's Python lies under {clash} ({prefix}), which a sandbox makes for itself: install the lab with "
            "a Python elsewhere (/usr, /opt, a home directory)"
        )
    bpf, _ = seccomp_filter()
    return _Host(bwrap, version, python, prefix, venv, os.geteuid() == 0, bpf)


def _uid_lock() -> tuple[int, int] | None:
    """An unprivileged uid of its own for one sandbox, held (flock) until the returned fd is closed."""
    os.makedirs(PREFIX_VIEW, mode=0o755, exist_ok=True)
    os.makedirs(VENV_VIEW, mode=0o755, exist_ok=True)
    os.chmod(UID_LOCK_DIR, 0o755)
    start = int.from_bytes(os.urandom(2), "big") % UID_COUNT  # spread, so a just-freed uid is rarely taken again
    for i in range(UID_COUNT):
        uid = UID_BASE + (start + i) % UID_COUNT
        try:
            pwd.getpwuid(uid)
            continue  # a real user of this host: never
        except KeyError:
            pass
        fd = os.open(os.path.join(UID_LOCK_DIR, f"uid-{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return uid, fd
    return None


def _etc(uid: int) -> dict[str, bytes]:
    return {
        "/etc/passwd": f"root:x:0:0::/nonexistent:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}::{SCRATCH}:/bin/bash\n"
        "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n".encode(),
        "/etc/group": f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n".encode(),
        "/etc/hosts": b"127.0.0.1 localhost sandbox\n::1 localhost\n",
        "/etc/hostname": b"sandbox\n",
    }


def _pipe_with(data: bytes) -> int:
    """The read end of a pipe holding `data` (small: it fits the pipe's buffer), its write end closed."""
    r, w = os.pipe()
    try:
        os.write(w, data)
    finally:
        os.close(w)
    return r


def _bwrap_argv(host: _Host, uid: int | None, scratch_bytes: int, data_fds: dict[str, int], seccomp_fd: int,
                status_fd: int, ctl: int, rep: int) -> list[str]:  # fmt: skip
    argv = []
    prefix_source, venv_source = host.prefix, host.venv
    if uid is not None:
        # the interpreter's prefix (and the venv) may lie under /root (0700): bound where the sandbox's uid reaches
        venv = (host.venv, VENV_VIEW) if host.venv else (host.prefix, PREFIX_VIEW)  # (no venv: the same bind again)
        argv += ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c"]
        argv += ['mount --bind "$0" "$1" && mount --bind "$2" "$3" && shift 3 && exec "$@"']
        argv += [host.prefix, PREFIX_VIEW, *venv]
        argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        prefix_source, venv_source = PREFIX_VIEW, VENV_VIEW if host.venv else None
    argv += [host.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--as-pid-1"]
    argv += ["--hostname", "sandbox", "--json-status-fd", str(status_fd)]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "lib32", "libx32", "sbin"):
        p = Path("/" + top)
        if p.is_symlink():
            argv += ["--symlink", os.readlink(p), str(p)]
        elif p.is_dir():
            argv += ["--ro-bind", str(p), str(p)]
    for etc in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/localtime",
                "/etc/nsswitch.conf", "/etc/mime.types"):  # fmt: skip
        if os.path.exists(etc):
            argv += ["--ro-bind", etc, etc]
    for dest, fd in data_fds.items():
        argv += ["--ro-bind-data", str(fd), dest]
    if not host.prefix.startswith("/usr/"):
        argv += ["--ro-bind", prefix_source, host.prefix]
    if host.venv and venv_source:
        argv += ["--ro-bind", venv_source, VENV_IN_SANDBOX]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm"]
    argv += ["--size", str(scratch_bytes), "--tmpfs", SCRATCH, "--dir", f"{SCRATCH}/.tmp"]
    argv += ["--symlink", f"{SCRATCH}/.tmp", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SCRATCH]
    argv += ["--clearenv", "--setenv", "PATH", f"{host.prefix}/bin:{PATH}", "--setenv", "HOME", SCRATCH]
    argv += ["--setenv", "LANG", "C.UTF-8", "--setenv", "TMPDIR", "/tmp", "--setenv", "USER", "sandbox"]
    argv += ["--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--seccomp", str(seccomp_fd)]
    python = os.path.join(VENV_IN_SANDBOX, "bin", os.path.basename(host.python)) if host.venv else host.python
    argv += ["--", python, "-I", "-c", _STUB, str(ctl), str(rep)]
    return argv


class Sandbox:
    """One sandbox process, single-use: `start()` brings bwrap and the stub's interpreter up (warm, waiting);
    `run()` hands it one program and returns its Execution; afterwards nothing of it is left. `kill()` at any
    time ends it (the pool's aclose)."""

    def __init__(self, scratch_bytes: int = Limits.scratch_bytes) -> None:
        self.scratch_bytes = scratch_bytes
        self.proc: asyncio.subprocess.Process | None = None
        self.uid: int | None = None
        self._uid_fd: int | None = None
        self._ctl: int | None = None
        self._rep: asyncio.StreamReader | None = None
        self._rep_transport: asyncio.BaseTransport | None = None
        self._child_pid: int | None = None
        self._status_fd: int | None = None
        self._closed = False

    # --- start ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the sandbox and wait until its interpreter is up; RuntimeError (with bwrap's words) if not."""
        loop = asyncio.get_running_loop()
        ctl_r, ctl_w = os.pipe()
        rep_r, rep_w = os.pipe()
        try:
            self.proc = await self._spawn(ctl_r, rep_w)
        except BaseException:
            os.close(ctl_w)
            os.close(rep_r)
            raise
        finally:
            os.close(ctl_r)
            os.close(rep_w)
        self._ctl = ctl_w
        os.set_blocking(ctl_w, False)
        self._rep = asyncio.StreamReader(limit=1 << 30)
        self._rep_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(self._rep), os.fdopen(rep_r, "rb", 0)
        )
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                self._child_pid = await self._stub_pid()
                ready = await self._rep.read(1)
        except TimeoutError:
            ready = b""
        if ready != b"R":
            why = await self._startup_error()
            await self.kill()
            raise RuntimeError(f"the sandbox did not start: {why}")

    async def _spawn(self, ctl_r: int, rep_w: int) -> asyncio.subprocess.Process:
        """bwrap with the stub inside, handed the two pipe ends."""
        host = _host()
        if host.as_root:
            got = _uid_lock()
            if got is None:
                raise RuntimeError(f"all {UID_COUNT} sandbox uids from {UID_BASE} are in use")
            self.uid, self._uid_fd = got
        uid = self.uid if self.uid is not None else os.getuid()
        st_r, st_w = os.pipe()
        self._status_fd = st_r
        data_fds = {dest: _pipe_with(data) for dest, data in _etc(uid).items()}
        seccomp_fd = _pipe_with(host.seccomp)
        child_fds = [st_w, seccomp_fd, *data_fds.values()]
        try:
            return await asyncio.create_subprocess_exec(
                *_bwrap_argv(host, self.uid, self.scratch_bytes, data_fds, seccomp_fd, st_w, ctl_r, rep_w),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=[ctl_r, rep_w, *child_fds],
                cwd="/",
                start_new_session=True,
            )
        finally:
            for fd in child_fds:
                os.close(fd)

    async def _stub_pid(self) -> int | None:
        """The stub's PID as the host sees it (bwrap's first status document names it)."""
        assert self._status_fd is not None
        fd, self._status_fd = self._status_fd, None
        return await asyncio.to_thread(_read_child_pid, fd)

    async def _startup_error(self) -> str:
        assert self.proc is not None and self.proc.stderr is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2):
                err = await self.proc.stderr.read(4096)
                return err.decode(errors="replace").strip() or f"bwrap exited with {await self.proc.wait()}"
        return "it did not answer within its start timeout"

    # --- run -----------------------------------------------------------------------------------------------
    async def run(
        self,
        code: str,
        language: str = "python",
        *,
        stdin: str = "",
        files: Mapping[str, bytes] | None = None,
        fetch_files: Sequence[str] = (),
        limits: Limits = Limits(),
    ) -> Execution:
        """Run one program in this (started, unused) sandbox; the sandbox is gone afterwards. The request must
        have passed `check_request`."""
        assert self.proc is not None and self._rep is not None and self._ctl is not None, "start() first"
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        proc, rep = self.proc, self._rep
        request = {
            "language": language,
            "code": code,
            "files": {check_name(n): base64.b64encode(bytes(d)).decode() for n, d in (files or {}).items()},
            "fetch_files": [check_name(n) for n in fetch_files],
            "limits": {k: v for k, v in asdict(limits).items() if k not in ("wall_s", "output_bytes")},
        }
        body = json.dumps(request).encode()
        out_task = asyncio.ensure_future(_drain(proc.stdout, limits.output_bytes))
        err_task = asyncio.ensure_future(_drain(proc.stderr, limits.output_bytes))
        writers = [
            asyncio.ensure_future(_write_fd(self._ctl, len(body).to_bytes(4, "big") + body)),
            asyncio.ensure_future(_feed(proc.stdin, stdin.encode("utf-8", "surrogatepass"))),
        ]
        status, return_code, message, fetched = "Error", None, "", {}
        started = time.monotonic()
        ran = 0.0
        try:
            try:
                async with asyncio.timeout(START_TIMEOUT_S):
                    mark = await rep.read(1)
            except TimeoutError:
                mark = b""
            if mark != b"S":  # the stub could not place the files (an error frame), or it died
                report = await _frame(rep, REPORT_GRACE_S, first=mark) if mark else None
                message = (report or {}).get("error", "the sandbox ended before the program started")
            else:
                started = time.monotonic()
                try:
                    async with asyncio.timeout(limits.wall_s):
                        report = await _frame(rep, None)
                except TimeoutError:
                    report, status = None, "TimeLimitExceeded"
                    message = f"the program ran past its wall-clock limit ({limits.wall_s:g} s) and was killed"
                ran = time.monotonic() - started
                if report is not None:
                    status, return_code, message, fetched = _outcome(report, limits)
                elif status != "TimeLimitExceeded":
                    message = "the sandbox ended without reporting the program's outcome"
        finally:
            await self.kill(graceful=status != "TimeLimitExceeded")
            for t in writers:
                t.cancel()
        (stdout, cut_out), (stderr, cut_err) = await asyncio.gather(
            _bounded(out_task, REPORT_GRACE_S), _bounded(err_task, REPORT_GRACE_S)
        )
        return Execution(
            status=status,
            return_code=return_code,
            stdout=stdout.decode("utf-8", errors="replace"),
            stderr=stderr.decode("utf-8", errors="replace"),
            execution_time=ran,
            truncated=cut_out or cut_err,
            files=fetched,
            message=message,
        )

    # --- end -----------------------------------------------------------------------------------------------
    async def kill(self, graceful: bool = False) -> None:
        """End the sandbox: SIGKILL its init (the kernel then kills everything in its PID namespace) and bwrap,
        and wait for bwrap, which returns only once the namespace is empty. `graceful`: give a stub that has
        reported a moment to exit by itself first. Idempotent."""
        if self._closed:
            return
        self._closed = True
        proc = self.proc
        if proc is not None:
            if proc.returncode is None and graceful:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await proc.wait()
            for pid in (self._child_pid, proc.pid):
                if pid is not None and proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REPORT_GRACE_S):
                    await proc.wait()
        if self._rep_transport is not None:
            self._rep_transport.close()
        if self._ctl is not None:
            with contextlib.suppress(OSError):
                os.close(self._ctl)
            self._ctl = None
        if self._status_fd is not None:
            os.close(self._status_fd)
            self._status_fd = None
        if self.uid is not None and self._uid_fd is not None:
            if proc is None or proc.returncode is None:
                _sweep_uid(self.uid)
            os.close(self._uid_fd)
            self._uid_fd = None


def _sweep_uid(uid: int) -> None:
    """Belt and braces before a uid is handed on: nothing may still run as it (the PID namespace's end has
    killed everything already; this finds what would have escaped it)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_uid == uid:
                os.kill(int(entry.name), signal.SIGKILL)


def _read_child_pid(fd: int) -> int | None:
    """bwrap's first status document names the sandbox's init (our stub) by its host PID."""
    with os.fdopen(fd, "rb") as f:
        line = f.readline()
    m = re.search(rb'"child-pid"\s*:\s*(\d+)', line)
    return int(m.group(1)) if m else None


def _outcome(report: dict, limits: Limits) -> tuple[str, int | None, str, dict[str, bytes]]:
    if "error" in report:
        return "Error", None, str(report["error"]), {}
    files = {name: base64.b64decode(data) for name, data in report.get("files", {}).items()}
    cpu = float(report.get("cpu_s", 0.0))
    if "signal" in report:
        sig = int(report["signal"])
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= max(1, math.ceil(limits.cpu_s))):
            return "TimeLimitExceeded", None, f"the program used its CPU time limit ({limits.cpu_s:g} s)", files
        return "Finished", -sig, "", files
    return "Finished", int(report["exit"]), "", files


async def _frame(reader: asyncio.StreamReader, timeout: float | None, first: bytes = b"") -> dict | None:
    """One length-prefixed JSON frame from the stub, or None if the pipe ended first."""
    try:
        async with asyncio.timeout(timeout):
            head = first + await reader.readexactly(4 - len(first))
            return json.loads(await reader.readexactly(int.from_bytes(head, "big")))
    except (asyncio.IncompleteReadError, TimeoutError, ValueError):
        return None


async def _drain(stream: asyncio.StreamReader, keep: int) -> tuple[bytes, bool]:
    """Read a stream to its end, keeping the first `keep` bytes (the rest is read and dropped, so the program
    never blocks on a full pipe); whether anything was dropped."""
    buf = bytearray()
    cut = False
    while chunk := await stream.read(1 << 16):
        room = keep - len(buf)
        if room > 0:
            buf += chunk[:room]
        if len(chunk) > max(room, 0):
            cut = True
    return bytes(buf), cut


async def _bounded(task: asyncio.Future, timeout: float) -> tuple[bytes, bool]:
    try:
        async with asyncio.timeout(timeout):
            return await task
    except TimeoutError:
        return b"", True


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        if data:
            stdin.write(data)
            await stdin.drain()
        stdin.close()


async def _write_fd(fd: int, data: bytes) -> None:
    """Write to a non-blocking pipe without blocking the loop (the stub reads it as it comes)."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_writer(fd, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_writer(fd)
        except OSError:
            return


# --- check_host ----------------------------------------------------------------------------------------------


def check_host() -> str:
    """One line naming the isolation in use (OPENRL_SANDBOX_ISOLATION), after starting one trivial sandbox (once;
    the answer is cached). SandboxUnavailable, saying what the host lacks and how to get it, if it cannot."""
    return _check_pod() if settings().sandbox_isolation == "pod" else _check_bubblewrap()


def new_sandbox(scratch_bytes: int = Limits.scratch_bytes) -> Sandbox:
    """An unstarted sandbox of the isolation in use (OPENRL_SANDBOX_ISOLATION)."""
    return PodSandbox(scratch_bytes) if settings().sandbox_isolation == "pod" else Sandbox(scratch_bytes)


def _probe(sandbox: Sandbox) -> Execution:
    """Start `sandbox` and run a trivial program in it (from a coroutine too: then on a thread of its own)."""

    async def probe() -> Execution:
        try:
            await sandbox.start()
        except RuntimeError as e:
            raise SandboxUnavailable(_explain(str(e))) from None
        return await sandbox.run("import os; print(os.getppid())", limits=Limits(wall_s=30, cpu_s=30))

    try:
        asyncio.get_running_loop()
        inside_loop = True
    except RuntimeError:
        inside_loop = False
    if inside_loop:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as ex:
            return ex.submit(asyncio.run, probe()).result()
    return asyncio.run(probe())


@functools.cache  # the answer, once it is one; a failure (raised) is tried again next time
def _check_bubblewrap() -> str:
    host = _host()
    result = _probe(Sandbox(1 << 20))
    if result.status != "Finished" or result.return_code != 0 or result.stdout.strip() != "1":
        raise SandboxUnavailable(
            f"a trivial sandboxed program failed ({result.status}, rc {result.return_code}): "
            f"{(result.message or result.stderr).strip()[-300:]}"
        )
    _, rules = seccomp_filter()
    who = f"uids {UID_BASE}-{UID_BASE + UID_COUNT - 1} (one per sandbox)" if host.as_root else f"uid {os.getuid()}"
    return (
        f"{host.bwrap_version} (namespaces user,pid,net,ipc,uts,cgroup; read-only system, tmpfs scratch), "
        f"seccomp-bpf ({rules} rules, libseccomp via pyseccomp), rlimits cpu,as,fsize,nofile,nproc,core=0, {who}"
    )


# --- pod isolation: inside a sandbox Pod, where the Pod is the boundary -------------------------------------


@dataclass(frozen=True)
class _PodHost:
    python: str
    scratch_root: str  # 0711: each execution's directory in it is 0700 with an unguessable name
    seccomp: bytes | None  # the filter as BPF, applied by the stub to itself and the program; None: not available
    seccomp_note: str


def _in_a_pod() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


@functools.cache
def _pod_host() -> _PodHost:
    if not _in_a_pod() and not settings().sandbox_pod_force:
        raise SandboxUnavailable(
            "pod isolation (OPENRL_SANDBOX_ISOLATION=pod) runs programs as plain processes and relies on the "
            "Kubernetes Pod around it (gVisor, its NetworkPolicy, no token) for isolation, and this is not a Pod "
            "(no KUBERNETES_SERVICE_HOST): use bubblewrap here, or set OPENRL_SANDBOX_POD_FORCE=1 if you mean it"
        )
    python, _, _ = _python()
    base = settings().sandbox_scratch_dir or Path(tempfile.gettempdir())
    root = os.path.join(base, f"openrl-sandbox-{os.getuid()}")
    os.makedirs(root, mode=0o711, exist_ok=True)
    os.chmod(root, 0o711)
    try:
        bpf, note = seccomp_filter(pod=True)[0], "seccomp-bpf"
    except SandboxUnavailable as e:
        bpf, note = None, f"no seccomp filter ({e})"
    return _PodHost(python, root, bpf, note)


class PodSandbox(Sandbox):
    """`pod` isolation: the same stub as a plain child process, in a fresh private scratch directory, with the
    same rlimits and (where pyseccomp works) the same seccomp filter, applied by the stub to itself, plus setsid
    and setpgid refused so that the process group holds every process of the program; single-use, and killed as
    that group. No namespaces: the Pod is the boundary (see check_host's line and docs/deploy.md)."""

    def __init__(self, scratch_bytes: int = Limits.scratch_bytes) -> None:
        super().__init__(scratch_bytes)
        self.scratch: str | None = None

    async def _spawn(self, ctl_r: int, rep_w: int) -> asyncio.subprocess.Process:
        host = _pod_host()
        self.scratch = tempfile.mkdtemp(prefix="run-", dir=host.scratch_root)  # 0700
        os.mkdir(os.path.join(self.scratch, ".tmp"), 0o700)
        fds = [ctl_r, rep_w]
        argv = [host.python, "-I", "-c", _STUB, str(ctl_r), str(rep_w), self.scratch]
        seccomp_fd = None
        if host.seccomp is not None:
            seccomp_fd = _pipe_with(host.seccomp)
            fds.append(seccomp_fd)
            argv.append(str(seccomp_fd))
        env = {"PATH": f"{os.path.dirname(host.python)}:{PATH}", "HOME": self.scratch, "LANG": "C.UTF-8",
               "TMPDIR": os.path.join(self.scratch, ".tmp"), "USER": "sandbox",
               "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
        try:
            return await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=fds,
                cwd=self.scratch,
                env=env,
                start_new_session=True,  # its own process group: the program's, killed as one
            )
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)

    async def _stub_pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def kill(self, graceful: bool = False) -> None:
        proc = self.proc
        if not self._closed and proc is not None:
            if graceful and proc.returncode is None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the stub's group: the program and all it started
        await super().kill()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


@functools.cache
def _check_pod() -> str:
    host = _pod_host()
    result = _probe(PodSandbox(1 << 20))
    if result.status != "Finished" or result.return_code != 0:
        raise SandboxUnavailable(
            f"a trivial program failed under pod isolation ({result.status}, rc {result.return_code}): "
            f"{(result.message or result.stderr).strip()[-300:]}"
        )
    where = "in a Kubernetes Pod" if _in_a_pod() else "FORCED outside a Pod (OPENRL_SANDBOX_POD_FORCE)"
    return (
        f"pod isolation, {where}: relies on the Pod's runtime (gVisor when the chart's runtimeClassName is set), "
        f"its NetworkPolicy and no service account token; per program a plain process in a private scratch "
        f"directory, {host.seccomp_note}, rlimits cpu,as,fsize,nofile,nproc,core=0, "
        f"uid {os.getuid()} shared by the Pod's programs"
    )


def _explain(err: str) -> str:
    low = err.lower()
    if "namespace" in low or "operation not permitted" in low or "no permissions" in low:
        return (
            f"bubblewrap cannot create its namespaces here ({err.strip()[:300]}): user namespaces must be allowed "
            "(sysctl user.max_user_namespaces > 0; on Ubuntu 24.04+ an AppArmor profile for bwrap, or "
            "kernel.apparmor_restrict_unprivileged_userns=0; in a container, seccomp/AppArmor must allow unshare)"
        )
    return f"the sandbox did not start: {err.strip()[:400]}"
