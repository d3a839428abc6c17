"""The orchestrator alone, for tests, benchmarks and debugging (the control plane runs it in-process):

    openrl-lab orchestrator --store /tmp/orch.db --port 50051 [--config groups.toml]
        [--holder-timeout 10] [--keys-db <home>/state.db] [--service-user openrl-kernel ...]

Prints `listening on HOST:PORT` once serving; stops on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="openrl-lab orchestrator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--store", type=Path, default=None, help="SQLite file (default: in memory)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--config", default=None, help="groups and settings (.toml or .json)")
    p.add_argument("--holder-timeout", type=float, default=None, help="seconds (overrides the config)")
    p.add_argument(
        "--keys-db",
        type=Path,
        default=None,
        help="authenticate callers against this control plane's API keys (its state.db)",
    )
    p.add_argument(
        "--service-user",
        action="append",
        default=[],
        help="a user that may create leases on behalf of other users (repeatable)",
    )
    args = p.parse_args(argv)
    from openrl_lab.settings import check

    check("openrl-lab orchestrator")
    from openrl_lab.orchestrator.config import load_config
    from openrl_lab.orchestrator.service import serve_orchestrator

    config = load_config(args.config)
    if args.holder_timeout is not None:
        import dataclasses

        config = dataclasses.replace(config, holder_timeout_s=args.holder_timeout)
    authenticate = None
    if args.keys_db is not None:
        from openrl_lab.identity import KeyStore

        authenticate = KeyStore(args.keys_db).user_for_key
    server = serve_orchestrator(
        args.store, args.port, args.host, authenticate=authenticate, config=config, service_users=args.service_user
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(f"listening on {server.target}", flush=True)
    done.wait()
    server.stop(grace=1).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
