"""`openrl-lab` command line: serve | keys | tokens | kernel | demo | install-kernelspec | lab."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from openrl_lab.home import default_home, secure_home
from openrl_lab.sample import SAMPLERS
from openrl_lab.settings import check


def _serve(args: argparse.Namespace) -> None:
    import json
    import os

    from openrl_lab.home import CatalogError, served_models, with_catalog, with_tokenizer_aliases
    from openrl_lab.server import ServeOptions, serve
    from openrl_lab.settings import settings

    # The catalog goes to this process and every kernel it starts through the environment, checked first.
    try:
        catalog = with_catalog(served_models(), args.models, args.model)
        aliases = with_tokenizer_aliases(
            dict(settings().lab_tokenizer_aliases), args.models, args.tokenizer_alias, catalog
        )
    except CatalogError as e:
        sys.exit(f"openrl-lab serve: {e}")
    if catalog:
        os.environ["OPENRL_LAB_MODELS"] = json.dumps(catalog)
    if aliases:
        os.environ["OPENRL_LAB_TOKENIZER_ALIASES"] = json.dumps(aliases)

    fields = ServeOptions.__dataclass_fields__
    options = ServeOptions(**{name: getattr(args, name) for name in fields if name != "grpc_port"})
    options.grpc_port = None if args.grpc_port < 0 else args.grpc_port
    serve(options)


def _keys(args: argparse.Namespace) -> None:
    from openrl_lab.identity import KeyStore

    home = secure_home((args.home or default_home()).resolve())
    store = KeyStore(home / "state.db")
    try:
        if args.keys_cmd == "create":
            try:
                print(store.add_key(args.name, args.label or "default"))
            except ValueError as e:
                sys.exit(f"openrl-lab keys create: {e}")
        elif args.keys_cmd == "revoke":
            n = store.revoke_keys(args.name, args.label, args.id)
            which = " ".join(
                filter(
                    None, [f"labelled {args.label!r}" if args.label else "", f"with id {args.id}" if args.id else ""]
                )
            )
            if not n:
                sys.exit(
                    f"openrl-lab keys revoke: user {args.name!r} has no key{' ' + which if which else ''} "
                    f"(see `openrl-lab keys list`)"
                )
            print(
                f"revoked {n} key{'s' if n > 1 else ''} of {args.name}{' ' + which if which else ''}; "
                f"requests with {'them' if n > 1 else 'it'} are refused from now on"
            )
        else:
            for row in store.list_keys():
                print(f"{row['key_id']}\t{row['user']}\t{row['name']}")
    finally:
        store.close()


def _tokens(args: argparse.Namespace) -> None:
    from openrl_lab.identity import KeyStore

    home = secure_home((args.home or default_home()).resolve())
    store = KeyStore(home / "state.db")
    try:
        if args.tokens_cmd == "create":
            if not args.kernel:
                sys.exit("openrl-lab tokens create: say what the token is for: --kernel (a kernel's join token)")
            print(store.add_join_token(args.label or "kernel"))
        elif args.tokens_cmd == "revoke":
            n = store.revoke_join_tokens(args.id)
            if not n:
                sys.exit(
                    f"openrl-lab tokens revoke: no join token has an id starting with {args.id!r} "
                    "(see `openrl-lab tokens list`)"
                )
            print(
                f"revoked {n} join token{'s' if n > 1 else ''}; kernels that joined with "
                f"{'them' if n > 1 else 'it'} leave the fleet within seconds"
            )
        else:
            for row in store.list_join_tokens():
                print(f"{row['token_id']}\t{row['label']}")
    finally:
        store.close()


def _kernel(args: argparse.Namespace) -> None:
    rest = [a for a in args.rest if a != "--"] if args.rest[:1] == ["--"] else args.rest
    if rest[:1] == ["join"]:
        from openrl_lab.kernel.process import join_main

        join_main(rest[1:])
    elif rest[:1] == ["list"]:
        _kernel_list(rest[1:])
    else:
        from openrl_lab.kernel.process import main as kernel_main

        kernel_main(rest)


def _orchestrator(args: argparse.Namespace) -> None:
    from openrl_lab.orchestrator.__main__ import main as orchestrator_main

    sys.exit(orchestrator_main(args.rest[1:] if args.rest[:1] == ["--"] else args.rest))


def _kernel_list(argv: list[str]) -> None:
    """The fleet as the control plane sees it, through its HTTP API with the caller's key."""
    import time

    from openrl_lab.lab.connection import LabError, find_connection
    from openrl_lab.sockets import http_client

    p = argparse.ArgumentParser(prog="openrl-lab kernel list", description="List the kernels of a control plane.")
    p.add_argument("--home", type=Path, default=None, help="find the control plane through this lab home")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    try:
        conn = find_connection(home=args.home)
    except LabError as e:
        sys.exit(f"openrl-lab kernel list: {e}")
    if conn is None:
        sys.exit(
            "openrl-lab kernel list: no control plane found (start one with `openrl-lab serve`, give its "
            "--home, or set OPENRL_LAB_URL and OPENRL_LAB_API_KEY)"
        )
    with http_client(timeout=10) as http:
        r = http.get(f"{conn.base_url.rstrip('/')}/api/v1/lab/kernels", headers={"X-API-Key": conn.api_key})
    if r.status_code != 200:
        sys.exit(f"openrl-lab kernel list: {r.status_code} {r.text[:300]}")
    kernels = r.json()["kernels"]
    if args.json:
        import json

        print(json.dumps(kernels, indent=2))
        return
    print(
        f"{'NAME':<20} {'STATE':<6} {'GROUP':<14} {'DEVICE':<8} {'SAMPLER':<7} {'HOST':<20} {'JOBS':>4} {'MEMORY':>10} "
        "HEARTBEAT"
    )
    for k in kernels:
        mem = k["device_bytes"] or k["rss_bytes"] or 0
        ago = f"{time.time() - k['last_heartbeat']:.1f}s ago"
        print(
            f"{k['name']:<20} {k['state']:<6} {k['group']:<14} {k['device']:<8} {k['sampler'] or '-':<7} "
            f"{k['host'][:20]:<20} "
            f"{k['jobs']:>4} "
            f"{mem / 2**20:>8.0f}MiB {ago}" + (f"  ({k['lost_why']})" if k["lost_why"] else "")
        )


def _demo(args: argparse.Namespace) -> None:
    from openrl_lab.demo import main as demo_main

    sys.exit(demo_main(args.home, args.steps, args.seed))


def _install_kernelspec(args: argparse.Namespace) -> None:
    from openrl_lab.lab.kernelspec import install_kernelspec

    prefix = args.prefix or (sys.prefix if args.sys_prefix else None)
    path = install_kernelspec(user=prefix is None, prefix=prefix, name=args.name)
    print(f'Installed the "OpenRL (Python 3)" kernel ({args.name}) in {path}')


TUTORIALS = Path(__file__).resolve().parents[1] / "notebooks"  # in a source checkout; a wheel has none
_COPIED = ".openrl-tutorials.json"  # in the working copy: the hash of each tutorial as it was copied


def _tutorial_working_copy(src: Path, dest: Path) -> list[str]:
    """Copies the tutorials `src/*.ipynb` into `dest` (never writing into `src`): a missing copy is created,
    a copy still as it was copied is refreshed when its original changed, a copy the user changed (edited or
    run: autosave writes outputs) is kept. Returns one line per notable thing, for the console."""
    import hashlib
    import json
    import shutil

    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / _COPIED
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {}
    notes = []
    for original in sorted(src.glob("*.ipynb")) + sorted(src.glob("README.md")):
        copy, new = dest / original.name, digest(original)
        if copy.exists():
            current = digest(copy)
            if current == new:
                manifest[original.name] = new
                continue
            if manifest.get(original.name) != current:  # the user's copy: theirs to keep
                if manifest.get(original.name) != new:
                    notes.append(
                        f"{copy} differs from the tutorial {original} (yours is kept; delete it to get a fresh copy)"
                    )
                    manifest[original.name] = new  # say it once per new original
                continue
            notes.append(f"refreshed {copy} from {original}")
        shutil.copyfile(original, copy)
        manifest[original.name] = new
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return notes


def _lab(args: argparse.Namespace) -> None:
    """JupyterLab on a working copy of the tutorials, with the server extension, the OpenRL kernel and a control
    plane (one that already runs for this home, else one started here and stopped when JupyterLab exits).

    The tutorials in the repository stay as committed: JupyterLab opens copies (in `--notebook-dir`, by default
    `<home>/notebooks`; asked for the repository's `notebooks/` itself, it uses the default), where running and
    autosaving change nothing in git."""
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
    notebooks = (args.notebook_dir or home / "notebooks").expanduser().resolve()
    if TUTORIALS.is_dir() and notebooks == TUTORIALS.resolve():
        notebooks = home / "notebooks"
        print(f"The tutorials in {TUTORIALS} stay as committed: opening a working copy in {notebooks}", flush=True)
    notebooks.mkdir(parents=True, exist_ok=True)
    if TUTORIALS.is_dir():
        for note in _tutorial_working_copy(TUTORIALS, notebooks):
            print(note, flush=True)
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


def _sandbox(args: argparse.Namespace) -> None:
    from openrl_lab.sandbox.server import serve

    serve(args.host, args.port, args.token_file)


def _doctor(args) -> None:
    """Prints the checks; exits 1 when one failed (a script can gate on it)."""
    from openrl_lab.home import read_connection
    from openrl_lab.lab.doctor import FAIL, diagnose, render
    from openrl_lab.settings import settings

    url = args.url or settings().lab_url
    if not url:
        try:
            url = read_connection(args.home)["base_url"]
        except (OSError, ValueError, KeyError):
            sys.exit("doctor: no lab URL: give one (openrl-lab doctor URL) or set OPENRL_LAB_URL")
    checks = diagnose(url, api_key=args.key)
    print(render(checks))
    if any(c.status == FAIL for c in checks):
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="openrl-lab", description="OpenRL Lab: RL post-training on shared accelerators.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run the control plane (Tinker HTTP API) and its kernels")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--home", type=Path, default=None, help="data directory (default $OPENRL_LAB_HOME or ~/.local/share/openrl-lab)"
    )
    s.add_argument("--device", default="auto", help="kernel device: auto, cpu, cuda, cuda:N")
    s.add_argument(
        "--grpc-port",
        type=int,
        default=50051,
        help="time-slicing orchestrator (gRPC) port, where kernels join too; 0 = any free port, -1 = no orchestrator",
    )
    s.add_argument(
        "--cpu-kernels",
        type=int,
        default=None,
        metavar="N",
        help="run N CPU kernels, each its own group pinned to its own cores (0: none, only kernels that "
        "join); default: one kernel per device",
    )
    s.add_argument(
        "--checkpoint-store",
        type=Path,
        default=None,
        help="the checkpoint directory, at the same path on every kernel's host (default <home>/checkpoints)",
    )
    s.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: the gRPC port serves TLS")
    s.add_argument("--tls-key", type=Path, default=None, help="its PEM private key")
    s.add_argument(
        "--kernel-ca",
        type=Path,
        default=None,
        help="PEM roots that sign joined kernels' certificates (default: the system's)",
    )
    s.add_argument(
        "--kernel-tls-name",
        default=None,
        help="the name joined kernels' certificates must carry, whatever their address (e.g. one "
        "certificate shared by kernel Pods); default: their address",
    )
    # Secrets as files (Kubernetes mounts them so): registered at start, replacing what the last start registered
    s.add_argument(
        "--join-token-file",
        type=Path,
        default=None,
        help="a kernels' join token ('orl-join-...') to accept, read at start; it replaces the token an "
        "earlier start read from a file (tokens made with `tokens create` stay)",
    )
    s.add_argument(
        "--api-keys-dir",
        type=Path,
        default=None,
        help="users' API keys, one file per user named after the user and holding its 'tml-...' key, "
        "read at start; keys an earlier start read from a directory and now gone are revoked",
    )
    s.add_argument(
        "--kernel-launcher",
        choices=("local", "kubernetes"),
        default="local",
        help="where kernels run: local child processes (default), or Pods this control plane creates "
        "on Kubernetes (in-cluster, or $KUBECONFIG), described by --launcher-config",
    )
    s.add_argument(
        "--launcher-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="launcher.json for --kernel-launcher kubernetes (namespace, image, groups...; see "
        'docs/architecture.md, "Kernels as Pods")',
    )
    s.add_argument(
        "--sampler",
        choices=SAMPLERS,
        default=None,
        help="the sampler backend of the kernel of the group samplers go to (sampler-group), overriding "
        "the config file's `sampler` for that group; a vllm kernel runs the group's kernel_python, else "
        "$OPENRL_LAB_VLLM_PYTHON, else this Python (see docs/deploy.md)",
    )
    s.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME[=PATH]",
        help="serve a model under NAME: PATH is its directory, or a Hugging Face repo id found in the HF cache "
        "(no hub is contacted); NAME alone: NAME in the HF cache. Repeatable. With any, only these and the "
        "built-in models are served (and listed by get_server_capabilities)",
    )
    s.add_argument(
        "--models",
        type=Path,
        default=None,
        metavar="FILE",
        help='a TOML catalog: a [models] table of NAME = "PATH" (or "" for NAME in the HF cache); --model adds to it',
    )
    s.add_argument(
        "--tokenizer-alias",
        action="append",
        default=[],
        metavar="REPO=MODEL",
        help="the /hf mirror also serves served model MODEL's tokenizer as repo REPO (for tools that load a "
        "tokenizer from a repo of their own: tinker-cookbook loads every meta-llama/Llama-3* model's from "
        "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer). Repeatable; a catalog file's [tokenizers] table too",
    )
    s.add_argument(
        "--sampler-fallback",
        action="store_true",
        help="with --sampler vllm: a model vLLM cannot serve is sampled by the torch sampler instead of being refused",
    )
    s.set_defaults(func=_serve)

    k = sub.add_parser("keys", help="manage API keys")
    ksub = k.add_subparsers(dest="keys_cmd", required=True)
    kc = ksub.add_parser("create", help="create an API key for user NAME and print it")
    kc.add_argument("name")
    kc.add_argument("--label", default=None, help="a label for the key")
    kc.add_argument("--home", type=Path, default=None)
    kl = ksub.add_parser("list", help="list key ids, users and key labels (never the keys)")
    kl.add_argument("--home", type=Path, default=None)
    kr = ksub.add_parser(
        "revoke", help="revoke user NAME's keys (all, or those of --label or --id); at once, also in a running server"
    )
    kr.add_argument("name")
    kr.add_argument("--label", default=None, help="only the keys with this label")
    kr.add_argument("--id", default=None, help="only the key whose id (from `keys list`) starts with this")
    kr.add_argument("--home", type=Path, default=None)
    k.set_defaults(func=_keys)

    t = sub.add_parser("tokens", help="manage kernels' join tokens")
    tsub = t.add_subparsers(dest="tokens_cmd", required=True)
    tc = tsub.add_parser("create", help="make a join token and print it (stored hashed: shown once)")
    tc.add_argument("--kernel", action="store_true", help="a token for `openrl-lab kernel join`")
    tc.add_argument("--label", default=None, help="a label for the token")
    tc.add_argument("--home", type=Path, default=None)
    tl = tsub.add_parser("list", help="list join token ids and labels (never the tokens)")
    tl.add_argument("--home", type=Path, default=None)
    tr = tsub.add_parser("revoke", help="revoke the join token whose id (from `tokens list`) starts with ID")
    tr.add_argument("id")
    tr.add_argument("--home", type=Path, default=None)
    t.set_defaults(func=_tokens)

    kn = sub.add_parser(
        "kernel",
        help="kernels: `kernel join ...` (run one on this host, join a control plane), "
        "`kernel list` (the fleet); a bare `kernel` is what the control plane starts",
    )
    kn.add_argument("rest", nargs=argparse.REMAINDER)
    kn.set_defaults(func=_kernel)

    orch = sub.add_parser(
        "orchestrator",
        help="the time-slicing orchestrator alone (tests, benchmarks, debugging; `serve` runs it in-process)",
    )
    orch.add_argument("rest", nargs=argparse.REMAINDER)
    orch.set_defaults(func=_orchestrator)

    d = sub.add_parser("demo", help="start a lab; SFT warm-up then RL on a toy task through the tinker SDK")
    d.add_argument("--home", type=Path, default=None, help="the demo lab's data directory (default <data dir>/demo)")
    d.add_argument("--steps", type=int, default=250, help="RL steps (default 250)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=_demo)

    sb = sub.add_parser("sandbox", help="the sandbox service on its own (what the chart's sandbox Pods run)")
    sbsub = sb.add_subparsers(dest="sandbox_cmd", required=True)
    sbs = sbsub.add_parser(
        "serve", help="serve /sandbox/run_code, run_batch and status over this host's pool, for a lab's gateway"
    )
    sbs.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    sbs.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free one, printed)")
    sbs.add_argument(
        "--token-file", type=Path, required=True, help="the service token callers send (Authorization: Bearer)"
    )
    sb.set_defaults(func=_sandbox)

    dr = sub.add_parser(
        "doctor", help="connect as a client would: what works, what does not, and the fix (one line each)"
    )
    dr.add_argument("url", nargs="?", help="the lab's URL (default $OPENRL_LAB_URL or this machine's running lab)")
    dr.add_argument("--key", default=None, help="API key (default $OPENRL_LAB_API_KEY or the local one)")
    dr.add_argument("--home", type=Path, default=None, help="the lab's data directory (for its connection file)")
    dr.set_defaults(func=_doctor)

    ik = sub.add_parser(
        "install-kernelspec", help='install the "OpenRL (Python 3)" Jupyter kernel (IPython with %%openrl loaded)'
    )
    where = ik.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into the per-user Jupyter data dir (the default)")
    where.add_argument("--sys-prefix", action="store_true", help=f"into this environment ({sys.prefix})")
    where.add_argument("--prefix", type=Path, default=None, help="into PREFIX/share/jupyter/kernels")
    ik.add_argument("--name", default="openrl", help="kernel name (default openrl)")
    ik.set_defaults(func=_install_kernelspec)

    lb = sub.add_parser(
        "lab", help="JupyterLab on the tutorials, with the OpenRL kernel, extension and a control plane"
    )
    lb.add_argument("--home", type=Path, default=None, help="lab home (default $OPENRL_LAB_HOME or the per-user dir)")
    lb.add_argument(
        "--notebook-dir",
        type=Path,
        default=None,
        help="JupyterLab's root, holding a working copy of the tutorials (default <home>/notebooks; "
        "never the repository's notebooks/)",
    )
    lb.add_argument("--device", default="auto", help="the control plane's device, when one is started here")
    lb.add_argument("--ip", default="127.0.0.1", help="JupyterLab's bind address (default loopback only)")
    lb.add_argument("--keep-server", action="store_true", help="leave the control plane started here running")
    lb.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="more arguments for jupyter lab (after --)")
    lb.set_defaults(func=_lab)

    args = p.parse_args(argv)
    check("openrl-lab")  # a bad OPENRL_* variable: one line naming it, before anything starts
    args.func(args)


if __name__ == "__main__":
    main()
