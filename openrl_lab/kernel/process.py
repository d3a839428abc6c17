"""The kernel process: a long-lived worker that holds jobs' resident state and runs their primitives.

It serves the kernel protocol (gRPC, `kernel.proto`; arguments and results as JSON with raw array bytes,
`codec.py`), authenticated by a key the control plane hands it, so the same kernel can run as a local
child process or as a Pod. It runs only the operations in OPERATIONS. Each call has its own worker thread
(a `cancel` or `metrics` call answers while a primitive runs), and every other operation runs on one
compute thread: the engine runs one primitive at a time anyway, and torch gives every thread that runs a
parallel op its own OpenMP team, so primitives spread over the pool's threads made each step ~1.5x slower.
"""

from __future__ import annotations

import argparse
import hmac
import inspect
import os
import sys
import threading
import time
import traceback
from concurrent import futures
from pathlib import Path

import grpc

from openrl_lab.kernel import codec
from openrl_lab.kernel import kernel_pb2 as pb
from openrl_lab.kernel import kernel_pb2_grpc as pb_grpc
from openrl_lab.kernel.client import CHANNEL_OPTIONS, HANDSHAKE_TIMEOUT_S, KEY_METADATA
from openrl_lab.kernel.engine import Engine, NotFound, UserError
from openrl_lab.orchestrator.errors import ResourceExhausted
from openrl_lab.train.loss_spec import LossInputError

# Exceptions that mean "the request was wrong", not "the kernel broke" (a lease past its quota included).
USER_ERRORS = (UserError, LossInputError, ValueError, ResourceExhausted)
# The engine's methods a peer may call, and nothing else (the gate's evict/restore hooks are not here).
OPERATIONS = frozenset({
    "model_info", "create_job", "create_job_from_checkpoint", "drop_job", "forward_backward", "optim_step",
    "save_state", "load_state", "snapshot_sampler", "save_sampler_weights", "open_sampler", "sample",
    "drop_sampler", "cancel", "metrics", "status", "swap_counters", "tokenizer_files"})
# Answered on the call's own gRPC thread, at once: they never wait for the running primitive.
INLINE = frozenset({"ping", "cancel", "metrics"})


class KernelServicer(pb_grpc.KernelServicer):
    def __init__(self, engine: Engine, authkey: bytes):
        self.engine = engine
        self._key = authkey
        self._compute = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kernel-compute")

    def Run(self, request, context):  # noqa: N802 - the gRPC method's name
        sent = dict(context.invocation_metadata() or ()).get(KEY_METADATA, "")
        if not hmac.compare_digest(sent.encode(), self._key):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "not this kernel's key")
        op = request.op
        if op != "ping" and op not in OPERATIONS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unknown operation {op[:64]!r}; this kernel runs: {', '.join(sorted(OPERATIONS))}")
        try:
            kwargs = codec.decode(request.args, list(request.blobs))
            if not isinstance(kwargs, dict):
                raise codec.CodecError("the arguments must be a JSON object")
            method = (lambda: "pong") if op == "ping" else getattr(self.engine, op)
            inspect.signature(method).bind(**kwargs)
        except (codec.CodecError, TypeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{op}: {e}")
        try:
            status, result = "ok", (method(**kwargs) if op in INLINE else
                                    self._compute.submit(method, **kwargs).result())
        except NotFound as e:
            status, result = "not_found", str(e)
        except USER_ERRORS as e:
            status, result = "user", str(e)
        except Exception as e:  # a bug or an accelerator failure: report it, keep serving
            traceback.print_exc()
            status, result = "server", f"{type(e).__name__}: {e}"
        data, blobs = codec.encode(result)
        return pb.Reply(status=status, result=data, blobs=blobs)


def _exit_with_parent() -> None:
    """A kernel whose control plane died (even by SIGKILL) must not hold the device forever."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _gate(group: str, engine: Engine, name: str):
    """Phases through the orchestrator when the control plane runs one, else unarbitrated.

    The kernel's clients name this process `name` (one live kernel per name) with a fresh incarnation:
    the orchestrator forgets at once what an earlier kernel of that name left on the device (it died with
    it), and can tell this kernel's own jobs from another process's when it asks for an eviction."""
    target = os.environ.get("OPENRL_ORCHESTRATOR_TARGET")
    if not target:
        return None
    import uuid

    from openrl_lab.orchestrator import OrchestratorGate, TimeSliceOrchestratorClient

    key, incarnation = os.environ["OPENRL_ORCHESTRATOR_KEY"], uuid.uuid4().hex

    def client_for(owner: str | None = None) -> TimeSliceOrchestratorClient:
        """A client for the leases of `owner`'s jobs (owned by that user, driven by this kernel)."""
        return TimeSliceOrchestratorClient(target, api_key=key, job=name, on_behalf_of=owner, instance=name,
                                           incarnation=incarnation)

    client = client_for()
    try:
        client.drop_stale_residency()
    except Exception as e:  # noqa: BLE001 - phases still work; only the previous kernel's ghosts wait out a timeout
        print(f"kernel {name}: could not tell the orchestrator that the previous kernel is gone: {e}",
              file=sys.stderr, flush=True)
    return OrchestratorGate(client, group, on_evict=engine.evict_job, on_restore=engine.restore_job,
                            on_evict_shared=engine.evict_shared, client_for=client_for)


def serve(host: str, port: int, authkey: bytes, home: Path, device: str, group: str = "default",
          name: str | None = None) -> None:
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    engine = Engine(home=home, device=_resolve_device(device))
    engine.gate = _gate(group, engine, name or f"kernel-{group}") or engine.gate
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="kernel-call"),
                         options=CHANNEL_OPTIONS + [("grpc.so_reuseport", 0),
                                                    ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000))])
    pb_grpc.add_KernelServicer_to_server(KernelServicer(engine, authkey), server)
    bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if bound == 0:
        sys.exit(f"openrl-lab kernel: cannot listen on {host}:{port}")
    server.start()
    # The control plane reads this line to learn the port (port 0 = any free port).
    print(f"OPENRL_KERNEL_READY {bound}", flush=True)
    server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="openrl-lab kernel", description="Run one OpenRL kernel process.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--home", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--group", default="default", help="the accelerator group this kernel's phases run on")
    p.add_argument("--name", default=None, help="this kernel's name, unique among live kernels (default: "
                                                "kernel-<group>); a restarted kernel of the same name replaces it")
    args = p.parse_args(argv)
    authkey = os.environ.get("OPENRL_KERNEL_AUTHKEY")
    if not authkey:
        sys.exit("openrl-lab kernel: OPENRL_KERNEL_AUTHKEY must be set (the control plane sets it)")
    serve(args.host, args.port, authkey.encode(), args.home, args.device, args.group, args.name)


if __name__ == "__main__":
    main()
