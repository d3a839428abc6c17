"""The kernel process: a long-lived worker that holds jobs' resident state and runs their primitives.

It listens on a TCP socket speaking `multiprocessing.connection`'s framing (pickled messages,
HMAC-authenticated with a key the control plane hands it), so the same kernel can run as a local child
process or as a Pod. Each connection is authenticated and served by its own thread, so a peer that
connects and stays silent holds only its own thread, and only for the handshake's deadline; the engine
runs one primitive at a time.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import AuthenticationError, Connection
from pathlib import Path

from openrl_lab.kernel.client import handshake
from openrl_lab.kernel.engine import Engine, NotFound, UserError
from openrl_lab.orchestrator.errors import ResourceExhausted
from openrl_lab.sockets import listening_socket
from openrl_lab.train.loss_spec import LossInputError

# Exceptions that mean "the request was wrong", not "the kernel broke" (a lease past its quota included).
USER_ERRORS = (UserError, LossInputError, ValueError, ResourceExhausted)


def _serve_peer(sock: socket.socket, authkey: bytes, engine: Engine) -> None:
    try:
        conn = handshake(sock, authkey, server=True)
    except (AuthenticationError, OSError, EOFError):
        return  # not a key holder, or silent past the deadline: drop it
    _serve_connection(conn, engine)


def _serve_connection(conn: Connection, engine: Engine) -> None:
    with conn:
        while True:
            try:
                op, kwargs = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if op == "ping":
                    result = "pong"
                else:
                    result = getattr(engine, op)(**kwargs)
                reply = ("ok", result)
            except NotFound as e:
                reply = ("not_found", str(e))
            except USER_ERRORS as e:
                reply = ("user", str(e))
            except Exception as e:  # a bug or an accelerator failure: report it, keep serving
                traceback.print_exc()
                reply = ("server", f"{type(e).__name__}: {e}")
            try:
                conn.send(reply)
            except (EOFError, OSError):
                return


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
    with listening_socket(host, port) as listener:
        # The control plane reads this line to learn the port (port 0 = any free port).
        print(f"OPENRL_KERNEL_READY {listener.getsockname()[1]}", flush=True)
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # e.g. out of descriptors for a moment: keep listening
                time.sleep(0.05)
                continue
            threading.Thread(target=_serve_peer, args=(sock, authkey, engine), daemon=True).start()


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
