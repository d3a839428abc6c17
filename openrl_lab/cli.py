"""`openrl-lab` command line: serve | keys | kernel | demo."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openrl_lab.home import default_home


def _serve(args: argparse.Namespace) -> None:
    from openrl_lab.server import serve

    serve(args.home, args.host, args.port, args.device, None if args.grpc_port < 0 else args.grpc_port)


def _keys(args: argparse.Namespace) -> None:
    from openrl_lab.gateway.store import Store

    home = (args.home or default_home()).resolve()
    store = Store(home / "state.db")
    if args.keys_cmd == "create":
        try:
            key = store.add_key(args.name, args.label or "default")
        except ValueError as e:
            sys.exit(f"openrl-lab keys create: {e}")
        print(key)
    else:
        for row in store.list_keys():
            print(f"{row['user']}\t{row['name']}")
    store.close()


def _kernel(args: argparse.Namespace) -> None:
    from openrl_lab.kernel.process import main as kernel_main

    kernel_main(args.rest)


def _demo(args: argparse.Namespace) -> None:
    from openrl_lab.demo import main as demo_main

    sys.exit(demo_main(args.home, args.steps, args.seed))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="openrl-lab", description="OpenRL Lab: RL post-training on shared accelerators.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the control plane (Tinker HTTP API) and its kernels")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--home", type=Path, default=None, help="data directory (default $OPENRL_LAB_HOME or ~/.local/share/openrl-lab)")
    s.add_argument("--device", default="auto", help="kernel device: auto, cpu, cuda, cuda:N")
    s.add_argument("--grpc-port", type=int, default=50051,
                   help="time-slicing orchestrator (gRPC) port; 0 = any free port, -1 = no orchestrator")
    s.set_defaults(func=_serve)

    k = sub.add_parser("keys", help="manage API keys")
    ksub = k.add_subparsers(dest="keys_cmd", required=True)
    kc = ksub.add_parser("create", help="create an API key for user NAME and print it")
    kc.add_argument("name")
    kc.add_argument("--label", default=None, help="a label for the key")
    kc.add_argument("--home", type=Path, default=None)
    kl = ksub.add_parser("list", help="list users and key labels (never the keys)")
    kl.add_argument("--home", type=Path, default=None)
    k.set_defaults(func=_keys)

    kn = sub.add_parser("kernel", help="run one kernel process (the control plane starts these)")
    kn.add_argument("rest", nargs=argparse.REMAINDER)
    kn.set_defaults(func=_kernel)

    d = sub.add_parser("demo", help="start a lab; SFT warm-up then RL on a toy task through the tinker SDK")
    d.add_argument("--home", type=Path, default=None, help="the demo lab's data directory (default <data dir>/demo)")
    d.add_argument("--steps", type=int, default=150, help="RL steps (default 150)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_demo)

    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
