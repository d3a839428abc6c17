"""Starting the control plane: in this process (`serve`) or as a child process (`LabServer`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from openrl_lab.home import connection_file, default_home, read_connection, secure_home, write_private
from openrl_lab.sockets import lab_answers, listening_socket

if TYPE_CHECKING:
    from openrl_lab.cluster.launchers import Launcher

LOCAL_USER = "local"
# The labels under which `serve --join-token-file` / `--api-keys-dir` keep what they registered (`tokens list`,
# `keys list` show them): the next start replaces exactly those.
FILE_TOKEN_LABEL = "join-token-file"
DIR_KEYS_LABEL = "api-keys-dir"


def read_keys_dir(directory: Path) -> dict[str, str]:
    """user -> key from a directory of one file per user, named after the user (a Kubernetes Secret mounted as a
    volume: its `..data` links and other dot-entries are not users)."""
    return {
        f.name: f.read_text().strip() for f in sorted(directory.iterdir()) if not f.name.startswith(".") and f.is_file()
    }


def register_given_secrets(store, join_token_file: Path | None, api_keys_dir: Path | None) -> None:
    """The join token and users' keys given as files (Secrets a Helm chart made) made valid in `store`; a
    ValueError names what is wrong with them."""
    if join_token_file is not None:
        store.set_join_token(FILE_TOKEN_LABEL, join_token_file.read_text().strip())
    if api_keys_dir is not None:
        store.set_keys(DIR_KEYS_LABEL, read_keys_dir(api_keys_dir))


def ensure_local_key(store, home: Path) -> str:
    """The key of this machine's user, created with mode 0600 on first start."""
    key_file = home / "api_key"
    if key_file.exists():
        key = key_file.read_text().strip()
        if store.user_for_key(key):
            return key
    key = store.add_key(LOCAL_USER, "default")
    write_private(key_file, key + "\n")
    return key


@dataclass
class ServeOptions:
    """What `openrl-lab serve` was asked for (cli.py fills it from its flags). `cpu_kernels`, `device`, `sampler`,
    `sampler_fallback`: the local kernels (`LocalLauncher`). `grpc_port` None: no orchestrator (phases run
    unarbitrated). `tls_cert`/`tls_key`: the gRPC port (orchestrator and kernel joins) serves TLS; `kernel_ca`:
    roots for joined kernels' certificates, `kernel_tls_name`: the name they must carry (default: their address).
    `join_token_file`, `api_keys_dir`: see `register_given_secrets`. `kernel_launcher` "kubernetes": no local
    kernels; the groups and the kernel Pods that join them come from `launcher_config` (`PodLauncher`)."""

    home: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    grpc_port: int | None = 50051
    cpu_kernels: int | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    kernel_ca: Path | None = None
    checkpoint_store: Path | None = None
    kernel_tls_name: str | None = None
    join_token_file: Path | None = None
    api_keys_dir: Path | None = None
    kernel_launcher: str = "local"
    launcher_config: Path | None = None
    sampler: str | None = None
    sampler_fallback: bool = False

    def problems(self) -> list[str]:
        """What does not go together, each a line for `openrl-lab serve: ...` (empty: it can start)."""
        bad = []
        if self.cpu_kernels is not None and self.cpu_kernels < 0:
            bad.append("--cpu-kernels must be >= 0")
        if bool(self.tls_cert) != bool(self.tls_key):
            bad.append("--tls-cert and --tls-key go together")
        if self.kernel_launcher not in ("local", "kubernetes"):
            bad.append(f"unknown --kernel-launcher {self.kernel_launcher!r} (local or kubernetes)")
        if self.kernel_launcher == "kubernetes":
            if self.launcher_config is None:
                bad.append("--kernel-launcher kubernetes needs --launcher-config FILE (launcher.json)")
            if self.cpu_kernels:
                bad.append(
                    "--kernel-launcher kubernetes runs no kernels of its own: drop --cpu-kernels "
                    f"{self.cpu_kernels} (the groups come from {self.launcher_config})"
                )
            if self.grpc_port is None:
                bad.append("--kernel-launcher kubernetes needs the gRPC port (kernel Pods join there)")
        elif self.launcher_config is not None:
            bad.append("--launcher-config goes with --kernel-launcher kubernetes")
        if self.sampler_fallback and self.sampler != "vllm":
            bad.append("--sampler-fallback goes with --sampler vllm")
        if self.sampler is not None and (self.kernel_launcher == "kubernetes" or self.cpu_kernels == 0):
            bad.append(
                "--sampler sets the sampler of the kernels serve starts, and it starts none here: set `sampler` "
                "on the group in launcher.json, or pass --sampler to `openrl-lab kernel join`"
            )
        for f in (self.tls_cert, self.tls_key, self.kernel_ca, self.launcher_config, self.join_token_file):
            if f is not None and not f.is_file():
                bad.append(f"{f} is not a readable file")
        if self.api_keys_dir is not None and not self.api_keys_dir.is_dir():
            bad.append(f"{self.api_keys_dir} is not a directory")
        return bad

    def launcher(self) -> Launcher:
        from openrl_lab.cluster.launchers import LocalLauncher, PodLauncher

        if self.kernel_launcher == "kubernetes":
            assert self.launcher_config is not None  # problems() says so first
            return PodLauncher(self.launcher_config)
        return LocalLauncher(
            self.device, self.cpu_kernels, self.sampler, self.sampler_fallback, tls=bool(self.tls_cert)
        )


class StartError(Exception):
    """`serve` cannot start; one line. What it started before is stopped again."""


def serve(options: ServeOptions) -> None:
    """The control plane in this process until SIGTERM or SIGINT: the orchestrator, the fleet with its launcher's
    kernels, the gateway. However it ends (a start that fails, a signal, a crash), what it started is stopped
    again, in the reverse order."""
    from openrl_lab.cluster.launchers import LaunchError

    problems = options.problems()
    if problems:
        sys.exit(f"openrl-lab serve: {problems[0]}")
    try:
        with contextlib.ExitStack() as started:
            _serve(options, started)
    except (StartError, LaunchError) as e:
        sys.exit(f"openrl-lab serve: {e}")


def _serve(o: ServeOptions, started: contextlib.ExitStack) -> None:
    import uvicorn

    from openrl_lab.cluster.fleet import Fleet
    from openrl_lab.gateway.app import create_app
    from openrl_lab.gateway.store import Store
    from openrl_lab.identity import KERNEL_USER

    launcher = o.launcher()
    home = secure_home((o.home or default_home()).resolve())
    started.enter_context(_home_lock(home))
    store = Store(home / "state.db")
    started.callback(store.close)
    try:
        register_given_secrets(store, o.join_token_file, o.api_keys_dir)
    except ValueError as e:
        raise StartError(str(e)) from None
    key = ensure_local_key(store, home)
    # Kernels' keys live as long as one run of `serve`: those of earlier runs (a kernel left over from a crash
    # would still hold one) must not authenticate, least of all as the identity that acts for any user.
    store.revoke_keys(KERNEL_USER)
    started.callback(store.revoke_keys, KERNEL_USER)
    fleet = Fleet(home, token_valid=lambda h: store.join_token_label(h) is not None)
    orchestrator, groups = _orchestrator(o, home, store, fleet, launcher) if o.grpc_port is not None else (None, None)
    if orchestrator is not None:
        started.callback(lambda: orchestrator.stop(1).wait(5))
    started.callback(fleet.stop)
    started.callback(launcher.stop)  # the first to stop: kernel Pods must not outlive the control plane
    kernels = launcher.start(fleet, groups)
    fleet.start()
    try:
        sock = listening_socket(o.host, o.port)
    except OSError as e:
        raise StartError(f"cannot listen on {o.host}:{o.port}: {e.strerror or e}") from None
    shown = "127.0.0.1" if o.host in ("0.0.0.0", "::") else f"[{o.host}]" if ":" in o.host else o.host
    base_url = f"http://{shown}:{sock.getsockname()[1]}"
    conn = {"base_url": base_url, "api_key": key, "home": str(home), "pid": os.getpid()}
    if orchestrator is not None:
        conn["grpc_target"] = f"{shown}:{orchestrator.port}"
    write_private(connection_file(home), json.dumps(conn, indent=2) + "\n")
    print(f"OpenRL Lab serving the Tinker API at {base_url} (home {home}; kernels: {kernels})", flush=True)
    app = create_app(
        home,
        store,
        fleet,
        scheduler=orchestrator.scheduler if orchestrator is not None else None,
        checkpoint_root=o.checkpoint_store.resolve() if o.checkpoint_store else None,
    )
    app.state.grpc_target = conn.get("grpc_target")  # told to notebook clients (GET /api/v1/lab/info)
    # the most orchestrator leases a user may hold open (the orchestrator refuses more): the doctor's `rights`
    app.state.max_leases_per_user = (
        orchestrator.scheduler.config.max_leases_per_user if orchestrator is not None else None
    )
    # uvicorn stops gracefully on SIGTERM, then raises the signal again with the handler it found: make that
    # handler an exit, so that the cleanup runs (the default would kill the process before it).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=75)).run(sockets=[sock])


@contextlib.contextmanager
def _home_lock(home: Path) -> Iterator[None]:
    """One `serve` per home, for as long as it runs (an flock: the kernel releases it when the process dies, even
    by SIGKILL). A second one would revoke the first's kernel keys and fail its users' jobs mid-run."""
    import fcntl

    lock = open(home / "serve.lock", "a")  # noqa: SIM115 - held until the context ends; never inherited by kernels
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        try:
            other = read_connection(home)
            who = f" (pid {other.get('pid')}, {other.get('base_url')})"
        except (OSError, ValueError):
            who = ""
        raise StartError(
            f"another openrl-lab serve{who} is using the home {home}: stop it, or give this one another --home"
        ) from None
    try:
        yield
    finally:
        lock.close()


def _orchestrator(o: ServeOptions, home: Path, store, fleet, launcher: Launcher):
    """The time-slicing service on the launcher's groups, and those groups. Kernels run every primitive as a phase
    through it: they acquire slices under their own identity, with a key made fresh for this run, and create the
    leases of users' jobs on those users' behalf (the users own them: their limits, their view)."""
    import grpc

    from openrl_lab.cluster.join import add_fleet_service
    from openrl_lab.identity import KERNEL_USER
    from openrl_lab.orchestrator import serve_orchestrator
    from openrl_lab.orchestrator.config import load_config
    from openrl_lab.orchestrator.types import group_names

    kernel_key = store.add_key(KERNEL_USER, "kernel")
    credentials = None
    if o.tls_cert and o.tls_key:  # both or neither (problems() says so first)
        credentials = grpc.ssl_server_credentials([(o.tls_key.read_bytes(), o.tls_cert.read_bytes())])
    config = load_config(launcher.groups())
    try:
        orchestrator = serve_orchestrator(
            home / "orchestrator.db",
            port=o.grpc_port,
            host=o.host,
            authenticate=store.user_for_key,
            service_users={KERNEL_USER},
            config=config,
            credentials=credentials,
            services=[
                add_fleet_service(
                    fleet, store, kernel_key, o.kernel_ca.read_bytes() if o.kernel_ca else None, o.kernel_tls_name
                )
            ],
        )
    except OSError as e:
        raise StartError(str(e)) from None
    scheduler = orchestrator.scheduler
    fleet.orchestrator = (f"127.0.0.1:{orchestrator.port}", kernel_key)
    fleet.group_source = lambda: group_names(scheduler.list_groups())
    # A lost kernel's residency and slices go at once: nobody waits out a holder timeout for it.
    fleet.on_lost.append(lambda rec: scheduler.drop_stale_residency(KERNEL_USER, rec.name, fleet.lost_incarnation()))
    return orchestrator, config.groups


class LabServer:
    """`openrl-lab serve` as a child process on a free loopback port; for tests, demos and notebooks."""

    def __init__(
        self,
        home: Path,
        port: int = 0,
        device: str = "cpu",
        grpc_port: int = 0,
        detach: bool = False,
        args: tuple[str, ...] = (),
        python: str | None = None,
        env: dict[str, str] | None = None,
    ):
        """`args`: more `openrl-lab serve` arguments (e.g. `--cpu-kernels 2`); `python`: the interpreter that
        runs it (default this one's); `env`: more environment variables for it."""
        self.home = Path(home)
        self.args = tuple(args)
        self.python = python or sys.executable
        self.env = dict(env or {})  # on top of the environment as it is at start()
        # detach: its own session, so it outlives the process that started it (a notebook kernel restart)
        self.detach = detach
        # 0: the server picks free ports itself and writes them to its connection file (read in start()); a port
        # picked here and released would be a race with every other process that binds one meanwhile.
        self.port = port
        self.grpc_port = grpc_port
        self.device = device
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> LabServer:
        conn = connection_file(self.home)  # an earlier one stays: it may be a live server's, which this one then meets
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        log_fd = os.open(self.home / "server.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with open(log_fd, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [
                    self.python,
                    "-m",
                    "openrl_lab.cli",
                    "serve",
                    "--home",
                    str(self.home),
                    "--port",
                    str(self.port),
                    "--device",
                    self.device,
                    "--grpc-port",
                    str(self.grpc_port),
                    *self.args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=self.detach,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                lines = (self.home / "server.log").read_text(errors="replace").strip().splitlines()
                said = f": {lines[-1]}" if lines else ""
                raise RuntimeError(
                    f"openrl-lab serve exited with {self.proc.returncode}{said} (see {self.home / 'server.log'})"
                )
            if conn.exists() and self._read_ports(conn) and lab_answers(self.base_url):
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"openrl-lab serve did not come up in {timeout:.0f}s; see {self.home / 'server.log'}")

    def _read_ports(self, conn: Path) -> bool:
        """The ports the server bound, from the connection file it wrote (False while it has not written it)."""
        try:
            saved = json.loads(conn.read_text())
            if self.proc is None or saved.get("pid") != self.proc.pid:
                return False  # an earlier server's
            self.port = int(saved["base_url"].rsplit(":", 1)[1])
            if "grpc_target" in saved:
                self.grpc_port = int(saved["grpc_target"].rsplit(":", 1)[1])
        except (OSError, ValueError, KeyError):
            return False
        return True

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def api_key(self) -> str:
        return read_connection(self.home)["api_key"]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LabServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
