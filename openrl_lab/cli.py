"""`openrl-lab` command line: serve | keys | kernel | demo | install-kernelspec | lab."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openrl_lab.home import default_home, secure_home


def _serve(args: argparse.Namespace) -> None:
    from openrl_lab.server import serve

    serve(args.home, args.host, args.port, args.device, None if args.grpc_port < 0 else args.grpc_port)


def _keys(args: argparse.Namespace) -> None:
    from openrl_lab.gateway.store import Store

    home = secure_home((args.home or default_home()).resolve())
    store = Store(home / "state.db")
    try:
        if args.keys_cmd == "create":
            try:
                print(store.add_key(args.name, args.label or "default"))
            except ValueError as e:
                sys.exit(f"openrl-lab keys create: {e}")
        elif args.keys_cmd == "revoke":
            n = store.revoke_keys(args.name, args.label, args.id)
            which = " ".join(filter(None, [f"labelled {args.label!r}" if args.label else "",
                                           f"with id {args.id}" if args.id else ""]))
            if not n:
                sys.exit(f"openrl-lab keys revoke: user {args.name!r} has no key{' ' + which if which else ''} "
                         f"(see `openrl-lab keys list`)")
            print(f"revoked {n} key{'s' if n > 1 else ''} of {args.name}{' ' + which if which else ''}; "
                  f"requests with {'them' if n > 1 else 'it'} are refused from now on")
        else:
            for row in store.list_keys():
                print(f"{row['key_id']}\t{row['user']}\t{row['name']}")
    finally:
        store.close()


def _kernel(args: argparse.Namespace) -> None:
    from openrl_lab.kernel.process import main as kernel_main

    kernel_main(args.rest)


def _demo(args: argparse.Namespace) -> None:
    from openrl_lab.demo import main as demo_main

    sys.exit(demo_main(args.home, args.steps, args.seed))


def _install_kernelspec(args: argparse.Namespace) -> None:
    from openrl_lab.lab.kernelspec import install_kernelspec

    prefix = args.prefix or (sys.prefix if args.sys_prefix else None)
    path = install_kernelspec(user=prefix is None, prefix=prefix, name=args.name)
    print(f"Installed the \"OpenRL (Python 3)\" kernel ({args.name}) in {path}")


def _lab(args: argparse.Namespace) -> None:
    """JupyterLab on the tutorials, with the server extension, the OpenRL kernel and a control plane (one that
    already runs for this home, else one started here and stopped when JupyterLab exits)."""
    import os
    import signal
    import subprocess

    from jupyter_server.extension.serverextension import toggle_server_extension_python

    from openrl_lab.lab.connection import LabError, find_connection
    from openrl_lab.lab.kernelspec import install_kernelspec
    from openrl_lab.server import LabServer

    install_kernelspec(user=False, prefix=sys.prefix)  # the kernel runs this environment's Python
    toggle_server_extension_python("openrl_lab", enabled=True, sys_prefix=True)  # editable installs lack data-files
    home = (args.home or default_home()).expanduser().resolve()
    notebooks = args.notebook_dir.expanduser().resolve()
    notebooks.mkdir(parents=True, exist_ok=True)
    try:
        conn = find_connection(home=home)
    except LabError as e:
        sys.exit(f"openrl-lab lab: {e}")
    server = None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean up below when told to stop
    try:
        if conn is None:
            print(f"Starting a control plane (home {home}; log {home / 'server.log'}) ...", flush=True)
            # Ctrl-C goes to JupyterLab (which asks to confirm), not to the control plane: it is stopped below.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                server = LabServer(home, device=args.device).start()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            print(f"OpenRL Lab control plane at {server.base_url} (orchestrator {server.grpc_target})", flush=True)
        else:
            print(f"Using the running control plane at {conn.base_url}", flush=True)
        env = {**os.environ, "OPENRL_LAB_HOME": str(home)}  # the extension and the notebooks find it there
        extra = [a for a in args.jupyter_args if a != "--"]
        cmd = [sys.executable, "-m", "jupyterlab", f"--notebook-dir={notebooks}", f"--ServerApp.ip={args.ip}", *extra]
        proc = subprocess.Popen(cmd, env=env)
        try:
            while True:
                try:
                    rc = proc.wait()
                    break
                except KeyboardInterrupt:  # JupyterLab got it too and decides (it asks to confirm)
                    continue
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    finally:
        if server is not None and not args.keep_server:
            print("Stopping the control plane ...", flush=True)
            server.stop()
    sys.exit(rc)


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
    kl = ksub.add_parser("list", help="list key ids, users and key labels (never the keys)")
    kl.add_argument("--home", type=Path, default=None)
    kr = ksub.add_parser("revoke", help="revoke user NAME's keys (all, or those of --label or --id); at once, "
                                        "also in a running server")
    kr.add_argument("name")
    kr.add_argument("--label", default=None, help="only the keys with this label")
    kr.add_argument("--id", default=None, help="only the key whose id (from `keys list`) starts with this")
    kr.add_argument("--home", type=Path, default=None)
    k.set_defaults(func=_keys)

    kn = sub.add_parser("kernel", help="run one kernel process (the control plane starts these)")
    kn.add_argument("rest", nargs=argparse.REMAINDER)
    kn.set_defaults(func=_kernel)

    d = sub.add_parser("demo", help="start a lab; SFT warm-up then RL on a toy task through the tinker SDK")
    d.add_argument("--home", type=Path, default=None, help="the demo lab's data directory (default <data dir>/demo)")
    d.add_argument("--steps", type=int, default=150, help="RL steps (default 150)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_demo)

    ik = sub.add_parser("install-kernelspec",
                        help="install the \"OpenRL (Python 3)\" Jupyter kernel (IPython with %%openrl loaded)")
    where = ik.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into the per-user Jupyter data dir (the default)")
    where.add_argument("--sys-prefix", action="store_true", help=f"into this environment ({sys.prefix})")
    where.add_argument("--prefix", type=Path, default=None, help="into PREFIX/share/jupyter/kernels")
    ik.add_argument("--name", default="openrl", help="kernel name (default openrl)")
    ik.set_defaults(func=_install_kernelspec)

    lb = sub.add_parser("lab", help="JupyterLab on the tutorials, with the OpenRL kernel, extension and a control plane")
    lb.add_argument("--home", type=Path, default=None, help="lab home (default $OPENRL_LAB_HOME or the per-user dir)")
    lb.add_argument("--notebook-dir", type=Path, default=Path("notebooks"), help="JupyterLab's root (default notebooks)")
    lb.add_argument("--device", default="auto", help="the control plane's device, when one is started here")
    lb.add_argument("--ip", default="127.0.0.1", help="JupyterLab's bind address (default loopback only)")
    lb.add_argument("--keep-server", action="store_true", help="leave the control plane started here running")
    lb.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="more arguments for jupyter lab (after --)")
    lb.set_defaults(func=_lab)

    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
