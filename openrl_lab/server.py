"""Starting the control plane: in this process (`serve`) or as a child process (`LabServer`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from openrl_lab.home import connection_file, default_home, read_connection, secure_home, write_private
from openrl_lab.sockets import lab_answers, listening_socket

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


def _local_kernels(
    device: str, cpu_kernels: int | None, configured, sampler: str | None = None, sampler_fallback: bool = False
) -> list[dict]:
    """`Fleet.add_local`'s arguments for each kernel this machine runs: one per group of the orchestrator's config
    (`configured`: its GroupSpecs, None without an orchestrator), with the group's sampler settings. `sampler`
    (`serve --sampler`): the sampler of the group that serves samples (`sampler-group`), whatever the config says;
    InvalidArgument when no group is named so."""
    from openrl_lab.cluster.local import core_sets
    from openrl_lab.orchestrator.config import fleet_groups, with_sampler

    groups = configured if configured is not None else fleet_groups(_devices(device, cpu_kernels))
    if sampler is not None and groups:
        groups = with_sampler(tuple(groups), sampler, sampler_fallback)
    cpu_groups = [g for g in groups if g.devices[0].startswith("cpu")]
    cores = iter(core_sets(len(cpu_groups)) if len(cpu_groups) > 1 else [None] * len(cpu_groups))
    out = []
    for g in groups:
        dev = g.devices[0]
        cpu = dev.startswith("cpu")
        out.append(
            {
                "group": g.id,
                "device": "cpu" if cpu else dev,
                "cores": next(cores) if cpu else None,
                "sampler": g.sampler,
                "sampler_fallback": g.sampler_fallback,
                "python": g.kernel_python,
                "sampler_models": g.sampler_models,
            }
        )
    return out


def _devices(device: str, cpu_kernels: int | None) -> list[str]:
    """The devices of the local kernels: N CPU kernels, the devices found (`auto`), or the one named."""
    from openrl_lab.orchestrator.config import discover_devices

    if cpu_kernels is not None:
        return [f"cpu:{i}" for i in range(cpu_kernels)] if cpu_kernels > 1 else ["cpu"]
    if device == "auto":
        return discover_devices()
    return [device]


def serve(
    home: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "auto",
    grpc_port: int | None = 50051,
    cpu_kernels: int | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    kernel_ca: Path | None = None,
    checkpoint_store: Path | None = None,
    kernel_tls_name: str | None = None,
    join_token_file: Path | None = None,
    api_keys_dir: Path | None = None,
    kernel_launcher: str = "local",
    launcher_config: Path | None = None,
    sampler: str | None = None,
    sampler_fallback: bool = False,
) -> None:
    """`cpu_kernels`: run that many CPU kernels (each its own group, pinned to its own cores; 0: none, only
    kernels that join); else one kernel per device (`device`: auto, cpu, cuda:N). `tls_cert`/`tls_key`: the
    gRPC port (orchestrator and kernel joins) serves TLS; `kernel_ca`: roots for joined kernels' certificates,
    `kernel_tls_name`: the name they must carry (default: their address). `join_token_file`, `api_keys_dir`: see
    `register_given_secrets`. `kernel_launcher` "kubernetes": no local kernels; the groups and the kernel Pods
    that join them come from `launcher_config` (launcher.json, `cluster/kubernetes.py`). `sampler` (torch, vllm),
    `sampler_fallback`: the sampler of the local kernel of the group samplers go to (`sampler-group`), overriding
    the config file's setting for that group (the other groups keep theirs)."""
    import grpc
    import uvicorn

    from openrl_lab.cluster.fleet import Fleet
    from openrl_lab.cluster.join import add_fleet_service
    from openrl_lab.gateway.app import create_app
    from openrl_lab.gateway.store import Store
    from openrl_lab.identity import KERNEL_USER
    from openrl_lab.kernel.client import KernelError
    from openrl_lab.orchestrator import serve_orchestrator
    from openrl_lab.orchestrator.config import fleet_groups, load_config
    from openrl_lab.orchestrator.errors import InvalidArgument
    from openrl_lab.orchestrator.types import group_names

    if bool(tls_cert) != bool(tls_key):
        sys.exit("openrl-lab serve: --tls-cert and --tls-key go together")
    pods = None  # launcher.json, with --kernel-launcher kubernetes
    if kernel_launcher == "kubernetes":
        from openrl_lab.cluster.kubernetes import LauncherConfigError, load_launcher_config

        if launcher_config is None or grpc_port is None:
            sys.exit(
                "openrl-lab serve: --kernel-launcher kubernetes needs --launcher-config FILE and the gRPC port "
                "(kernel Pods join there)"
            )
        try:
            pods = load_launcher_config(launcher_config)
        except LauncherConfigError as e:
            sys.exit(f"openrl-lab serve: {e}")
    elif kernel_launcher != "local":
        sys.exit(f"openrl-lab serve: unknown --kernel-launcher {kernel_launcher!r} (local or kubernetes)")
    home = secure_home((home or default_home()).resolve())
    store = Store(home / "state.db")
    try:
        register_given_secrets(store, join_token_file, api_keys_dir)
    except ValueError as e:
        store.close()
        sys.exit(f"openrl-lab serve: {e}")
    key = ensure_local_key(store, home)
    # Kernels' keys live as long as one run of `serve`: those of earlier runs (a kernel left over from a crash
    # would still hold one) must not authenticate, least of all as the identity that acts for any user.
    store.revoke_keys(KERNEL_USER)

    def plan(groups) -> list[dict]:  # the local kernels; a --sampler that no group takes ends the start here
        try:
            return _local_kernels(device, cpu_kernels, groups, sampler, sampler_fallback)
        except InvalidArgument as e:
            store.close()
            sys.exit(f"openrl-lab serve: --sampler {sampler}: {e}")

    orchestrator = None
    fleet = Fleet(home, token_valid=lambda h: store.join_token_label(h) is not None)
    if grpc_port is not None:  # the time-slicing service; kernels run every primitive as a phase through it
        # Kernels acquire slices under their own identity, with a key made fresh for this run, and create the
        # leases of users' jobs on those users' behalf (the users own them: their limits, their view).
        kernel_key = store.add_key(KERNEL_USER, "kernel")
        if pods is not None:  # the kernel Pods' groups, and no others
            config = load_config({"groups": pods.group_specs()})
        elif cpu_kernels is None:
            config = load_config(None)
        else:
            config = load_config({"groups": fleet_groups(_devices(device, cpu_kernels))})
        planned = plan(config.groups if cpu_kernels != 0 and pods is None else ())
        credentials = None
        if tls_cert and tls_key:  # both or neither (checked above)
            credentials = grpc.ssl_server_credentials([(tls_key.read_bytes(), tls_cert.read_bytes())])
        orchestrator = serve_orchestrator(
            home / "orchestrator.db",
            port=grpc_port,
            host=host,
            authenticate=store.user_for_key,
            service_users={KERNEL_USER},
            config=config,
            credentials=credentials,
            services=[
                add_fleet_service(
                    fleet, store, kernel_key, kernel_ca.read_bytes() if kernel_ca else None, kernel_tls_name
                )
            ],
        )
        scheduler = orchestrator.scheduler
        fleet.orchestrator = (f"127.0.0.1:{orchestrator.port}", kernel_key)
        fleet.group_source = lambda: group_names(scheduler.list_groups())
        # A lost kernel's residency and slices go at once: nobody waits out a holder timeout for it.
        fleet.on_lost.append(
            lambda rec: scheduler.drop_stale_residency(KERNEL_USER, rec.name, fleet.lost_incarnation())
        )
        if tls_cert and planned:
            orchestrator.stop(0)
            sys.exit(
                "openrl-lab serve: with --tls-cert the control plane runs no kernels of its own yet (local kernels "
                "reach the orchestrator in plaintext on loopback): add --cpu-kernels 0 and let kernels join"
            )
    else:
        planned = plan(None if cpu_kernels != 0 else ())
    for kernel in planned:  # started now so the first request does not wait for them
        try:
            fleet.add_local(**kernel)
        except KernelError as e:  # it exited at start (a bad device, vLLM not installed...): its reason, and out
            fleet.stop()
            if orchestrator:
                orchestrator.stop(0)
            store.close()
            sys.exit(f"openrl-lab serve: {e}")
    fleet.start()
    sock = listening_socket(host, port)
    bound = sock.getsockname()[1]
    launcher = None
    if pods is not None:  # after the orchestrator and the port: the Pods' kernels find their groups when they join
        from openrl_lab.cluster.kubernetes import KubernetesLauncher

        try:
            launcher = KubernetesLauncher(pods, on_kernel_gone=fleet.lost_elsewhere).start()
        except Exception as e:  # noqa: BLE001 - no kubeconfig, the API refused us...: one line, and out
            fleet.stop()
            if orchestrator:  # always, with Pods (they need the gRPC port)
                orchestrator.stop(0)
            store.close()
            sys.exit(f"openrl-lab serve: the Kubernetes launcher cannot start: {e}")
    shown = f"[{host}]" if ":" in host else host
    base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else shown}:{bound}"
    conn = {"base_url": base_url, "api_key": key, "home": str(home), "pid": os.getpid()}
    if orchestrator:
        conn["grpc_target"] = f"{'127.0.0.1' if host in ('0.0.0.0', '::') else shown}:{orchestrator.port}"
    write_private(connection_file(home), json.dumps(conn, indent=2) + "\n")
    kernels = ", ".join(f"{r.name} ({r.device}, group {r.group})" for r in fleet.records()) or "none yet"
    if launcher is not None and pods is not None:  # a launcher only with pods
        kernels = f"{len(launcher.slots)} kernel Pods in namespace {pods.namespace}, joining"
    print(f"OpenRL Lab serving the Tinker API at {base_url} (home {home}; kernels: {kernels})", flush=True)
    app = create_app(
        home,
        store,
        fleet,
        scheduler=orchestrator.scheduler if orchestrator else None,
        checkpoint_root=checkpoint_store.resolve() if checkpoint_store else None,
    )
    app.state.grpc_target = conn.get("grpc_target")  # told to notebook clients (GET /api/v1/lab/info)
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=75)
    # uvicorn stops gracefully on SIGTERM, then raises the signal again with the handler it found: make that
    # handler an exit, so the cleanup below runs (the default would kill the process before it).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        if launcher is not None:  # first: the Pods' kernels must not outlive the control plane that made them
            launcher.stop()
        fleet.stop()
        if orchestrator:
            orchestrator.stop(1).wait(5)
        store.revoke_keys(KERNEL_USER)
        store.close()


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
        conn = connection_file(self.home)
        conn.unlink(missing_ok=True)
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
                raise RuntimeError(
                    f"openrl-lab serve exited with {self.proc.returncode}; see {self.home / 'server.log'}"
                )
            if conn.exists() and self._read_ports(conn) and lab_answers(self.base_url):
                return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"openrl-lab serve did not come up in {timeout:.0f}s; see {self.home / 'server.log'}")

    def _read_ports(self, conn: Path) -> bool:
        """The ports the server bound, from the connection file it wrote (False while it is not complete)."""
        try:
            saved = json.loads(conn.read_text())
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
