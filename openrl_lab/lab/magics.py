"""`%openrl` and `%%openrl phase`: a thin layer of IPython magics over `openrl_lab.lab.Lab`.

    %load_ext openrl_lab
    %openrl connect [URL] [--local]
    %openrl lease NAME --group G [--model M] [--rank R | --full] [--devices N] [--as VAR]
    %openrl attach NAME [--as VAR]
    %openrl status [--once] | top | timeline [--group G] | plot NAME | release NAME
    %%openrl phase --group G          (the cell runs as one phase: it holds the group while it runs)
    %openrl resident VAR [VAR ...] [--group G] [--name N]   (your own torch state, time-sliced at cell boundaries)
    %openrl autophase on|off          (every cell that uses registered state runs as a phase)

`%openrl?`, `%openrl --help` and `%openrl help` list the subcommands; every subcommand takes --help. A user
mistake is one line (IPython's UsageError), never a traceback. `%openrl status` in a notebook is a live
`LeasePanel` (refreshed about once a second from a background thread; its text repr is a snapshot); with
`--once`, or outside a kernel, it prints the snapshot.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from openrl_lab.home import DEFAULT_MODEL
from openrl_lab.lab.client import MAX_DEVICES, Lab, check_devices
from openrl_lab.lab.connection import LabError
from openrl_lab.orchestrator.types import PRIORITIES

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

    from openrl_lab.lab.cells import CellHooks
    from openrl_lab.lab.resident import ResidentState


class _HelpShown(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports instead of exiting the kernel."""

    def error(self, message: str):
        raise UsageError(f"%openrl {self.prog.split()[-1]}: {message} (see %openrl {self.prog.split()[-1]} --help)")

    def exit(self, status: int = 0, message: str | None = None):
        if message:
            print(message, end="")
        raise _HelpShown()


# The subcommands and their one-line help: the parser, `%openrl help`, `%openrl --help` and `%openrl?` use these.
COMMANDS = {
    "connect": "connect to a lab (or start an embedded one)",
    "lease": "start a named training run on a group (--devices N: sharded over N devices); binds its handles "
    "to variables",
    "attach": "rebind a named run after a notebook kernel restart; replays its history",
    "status": "your runs: group, state, share, queue and why (expected wait), kernel, last step, reward, "
    "checkpoint; live in a notebook (--once: a snapshot)",
    "top": "every group: holder, queue and why, duty cycle; every kernel of the fleet",
    "timeline": "slices per group (Gantt) with duty cycle",
    "plot": "live reward/loss plot of a run",
    "release": "end a named run: its kernel state is freed (checkpoints stay)",
    "fork": "new runs from a run's current weights and optimizer state (copied on its kernel), with settings",
    "compare": "runs' curves overlaid in one live plot, with a summary table",
    "phase": "(cell magic) run the cell as one phase holding the group (with `resident` state: restored first)",
    "resident": "register this kernel's own modules/optimizers/tensors as a job (notebook:NAME) on a group: "
    "moved to host memory after a cell when another job waits, restored by the next phase",
    "autophase": "on|off: every cell that uses registered state runs as one phase (no %%openrl phase needed)",
    "doctor": "connect as a client would: SDK, wire, HTTP / gRPC / lane, tokenizer mirror, kernels, clock, key and "
    "its rights, runs' sampler mismatch, a real phase; one line each with the fix",
    "sandbox": "the sandbox service (model-written code run in isolation: lab.sandbox): the isolation in use, "
    "the pool, your runs by outcome; --env: set SANDBOX_URL here for SandboxFusion clients (tinker-cookbook)",
    "help": "this list",
}


def usage() -> str:
    """The subcommand list, one line each."""
    width = max(map(len, COMMANDS))
    lines = [
        "%openrl COMMAND [options]   (%%openrl phase for a cell; %openrl COMMAND --help for its options)",
        "",
        "commands:",
    ]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def _setting(text: str) -> float | int | str:
    """A --set value as a number where it reads as one."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _devices(text: str) -> int:
    """A --devices value: a whole number from 1 to MAX_DEVICES (argparse turns the error into one line)."""
    try:
        return check_devices(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of devices: a whole number from 1 to {MAX_DEVICES}"
        ) from None


def _priority_argument(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--priority",
        choices=PRIORITIES,
        default="interactive",
        help="interactive (the default: its phases go before waiting batch phases, within the group's "
        "interactive share) or batch",
    )


def _parser() -> _Parser:
    p = _Parser(prog="%openrl", description="OpenRL Lab: lease accelerators, run RL loops, watch them live.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    c = sub.add_parser("connect", help=COMMANDS["connect"])
    c.add_argument("url", nargs="?", help="the lab's URL (default: $OPENRL_LAB_URL or this machine's running lab)")
    c.add_argument("--local", action="store_true", help="start an embedded control plane if none runs")
    c.add_argument("--home", help="the lab's data directory (default $OPENRL_LAB_HOME)")
    c.add_argument("--key", help="API key (default $OPENRL_LAB_API_KEY or the local one)")
    c = sub.add_parser("lease", help=COMMANDS["lease"])
    c.add_argument("name")
    c.add_argument("--group", default="trainer-group", help="the accelerator group (default trainer-group)")
    c.add_argument("--model", default=DEFAULT_MODEL, help=f"base model (default {DEFAULT_MODEL})")
    c.add_argument("--rank", type=int, default=None, help="LoRA rank (default 16)")
    c.add_argument(
        "--full",
        action="store_true",
        help="full fine-tuning: every weight, no adapter (the lease line "
        "says how much device memory it holds); not with --rank",
    )
    c.add_argument("--seed", type=int, default=None, help="seed of the adapter's initialisation")
    c.add_argument("--weight", type=float, default=None, help="fair-share weight of the lease (default 1)")
    c.add_argument("--quota", type=float, default=None, help="accelerator-seconds the lease may use")
    c.add_argument(
        "--devices",
        type=_devices,
        default=1,
        metavar="N",
        help=f"shard the run over N devices (1-{MAX_DEVICES}, default 1): N ranks on N kernels, rank 0 on "
        "--group, their slices granted together",
    )
    _priority_argument(c)
    c.add_argument(
        "--as",
        dest="var",
        default="run",
        help="variable for the run (default run); VAR_training_client and VAR_sample are bound too",
    )
    c = sub.add_parser("attach", help=COMMANDS["attach"])
    c.add_argument("name")
    c.add_argument("--as", dest="var", default="run", help="variable for the run (default run)")
    c = sub.add_parser("status", help=COMMANDS["status"])
    c.add_argument("--once", action="store_true", help="print a plain-text snapshot instead of a live panel")
    c.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes of the live panel (default 1)"
    )
    sub.add_parser("top", help=COMMANDS["top"])
    c = sub.add_parser("timeline", help=COMMANDS["timeline"])
    c.add_argument("--group", default="default")
    c.add_argument("--window", type=float, default=120.0, help="seconds back (default 120)")
    c = sub.add_parser("plot", help=COMMANDS["plot"])
    c.add_argument("name")
    c.add_argument("--metrics", help="comma-separated metric names (default: all logged)")
    c = sub.add_parser("release", help=COMMANDS["release"])
    c.add_argument("name")
    c = sub.add_parser("fork", help=COMMANDS["fork"])
    c.add_argument("name", help="the run to fork")
    c.add_argument("--as", dest="names", required=True, help="comma-separated names of the new runs")
    c.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a variant setting, one value per new run (or one for all): --set learning_rate=3e-4,1e-3",
    )
    c.add_argument("--var", default="forks", help="variable bound to {name: run} of the new runs (default forks)")
    _priority_argument(c)
    sub.add_parser("doctor", help=COMMANDS["doctor"])
    c = sub.add_parser("sandbox", help=COMMANDS["sandbox"])
    c.add_argument(
        "--env", action="store_true", help="set SANDBOX_URL in this kernel's environment (the key rides in it)"
    )
    c = sub.add_parser("compare", help=COMMANDS["compare"])
    c.add_argument("names", help="comma-separated run names")
    c.add_argument("--metrics", default="reward,loss", help="comma-separated metric names (default reward,loss)")
    c = sub.add_parser("phase", help=COMMANDS["phase"])
    c.add_argument("--group", default=None, help="the group (default: the registered state's, else trainer-group)")
    c.add_argument("--kind", default="cell", help="phase kind on the timeline (default cell)")
    c.add_argument("--verbose", action="store_true", help="say how long the cell waited for the group")
    _priority_argument(c)
    c = sub.add_parser("resident", help=COMMANDS["resident"])
    c.add_argument(
        "vars",
        nargs="*",
        metavar="VAR",
        help="variables of this kernel: torch modules, optimizers, "
        "tensors, dicts of tensors (none: show what is registered)",
    )
    c.add_argument("--group", default=None, help="the accelerator group (default trainer-group)")
    c.add_argument(
        "--name",
        default=None,
        help="the job's name, shown as notebook:NAME (default: the notebook's file name, else host-pid)",
    )
    c.add_argument("--weight", type=float, default=None, help="fair-share weight of the job (default 1)")
    c.add_argument("--quota", type=float, default=None, help="accelerator-seconds the job may use")
    _priority_argument(c)
    c.add_argument(
        "--close", action="store_true", help="end the job (its lease is closed; the objects stay as they are)"
    )
    c.add_argument(
        "--as",
        dest="var",
        default=None,
        help="bind the job's ResidentState to this variable (its phase() runs a phase from code, e.g. in a loop)",
    )
    c = sub.add_parser("autophase", help=COMMANDS["autophase"])
    c.add_argument("switch", choices=("on", "off"))
    sub.add_parser("help", help=COMMANDS["help"])
    return p


@magics_class
class OpenRLMagics(Magics):
    shell: InteractiveShell  # Magics allows None; these are always made on (and registered with) a shell

    def __init__(self, shell: InteractiveShell):
        super().__init__(shell)
        self.lab: Lab | None = None
        self.parser = _parser()
        self.status_panel = None  # the live LeasePanel of the last `%openrl status`
        self.resident: ResidentState | None = None  # this kernel's `%openrl resident` state, with its CellHooks
        self.cell_hooks: CellHooks | None = None

    # --- plumbing ---------------------------------------------------------------------------------
    def _lab(self) -> Lab:
        if self.lab is None:
            self.lab = Lab.connect()
            print(f"connected: {self.lab}")
        return self.lab

    def _run(self, run, var: str) -> None:
        if not var.isidentifier():
            raise LabError(f"--as {var!r} is not a Python identifier")
        self.shell.push({var: run, f"{var}_training_client": run.training, f"{var}_sample": run.sample})
        print(f"{run}\nbound: {var}, {var}_training_client, {var}_sample")

    @line_cell_magic
    def openrl(self, line: str, cell: str | None = None):
        try:
            argv = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%openrl: {e}") from None
        if not argv:
            raise UsageError(
                "%openrl: a command is needed: connect, lease, attach, status, top, timeline, plot, release, fork, "
                "compare, resident, autophase, doctor, sandbox (%%openrl phase for a cell); see %openrl --help"
            )
        if argv in (["--help"], ["-h"], ["help"]):
            print(usage())
            return None
        try:
            args = self.parser.parse_args(argv)
        except _HelpShown:
            return None
        if (cell is None) == (args.command == "phase"):
            raise UsageError(
                "%%openrl phase is a cell magic (two %); the other commands are line magics (one %)"
                if cell is None
                else f"%%openrl {args.command}: only `phase` is a cell magic; use %openrl {args.command} on one line"
            )
        try:
            return getattr(self, f"_cmd_{args.command}")(args, cell)
        except LabError as e:
            raise UsageError(f"%openrl {args.command}: {e}") from None
        except Exception as e:  # server-side refusals arrive as the SDK's / gRPC client's exceptions
            from openrl_lab.orchestrator.errors import OrchestratorError

            if isinstance(e, OrchestratorError):
                raise UsageError(f"%openrl {args.command}: {e}") from None
            raise

    openrl.__doc__ = usage()  # what `%openrl?` shows

    # --- commands ---------------------------------------------------------------------------------
    def _cmd_connect(self, args, cell):
        if self.resident is not None:  # its job lives on the current lab's orchestrator client
            raise LabError(
                f"this kernel's resident job {self.resident.name} runs on the current lab: "
                "%openrl resident --close first"
            )
        if self.status_panel is not None:  # it showed the old lab's leases
            self.status_panel.stop()
        if self.lab is not None:
            self.lab.close()
        self.lab = Lab.connect(args.url, api_key=args.key, home=args.home, local=args.local)
        print(f"connected: {self.lab}")
        return

    def _cmd_lease(self, args, cell):
        self._run(
            self._lab().lease(
                args.name,
                group=args.group,
                model=args.model,
                rank=args.rank,
                full=args.full,
                seed=args.seed,
                weight=args.weight,
                quota_s=args.quota,
                priority=args.priority,
                devices=args.devices,
            ),
            args.var,
        )

    def _cmd_attach(self, args, cell):
        run = self._lab().attach(args.name)
        self._run(run, args.var)
        history = run.history()
        print(f"history: {len(history)} steps" + (f" (last {int(history['step'].max())})" if len(history) else ""))

    def _cmd_status(self, args, cell):
        from openrl_lab.lab.widgets.lease_panel import LeasePanel, render_text

        if not args.interval > 0:
            raise UsageError(f"%openrl status: --interval must be > 0, got {args.interval:g}")
        lab = self._lab()
        rows = lab.status()
        if args.once or getattr(self.shell, "kernel", None) is None:  # a snapshot (outside a notebook kernel too)
            print(render_text(rows, "leases"))
            return
        if self.status_panel is not None:  # one live panel at a time: the previous one stays as it was
            self.status_panel.stop()
        self.status_panel = LeasePanel(rows, source=lab.status, interval_s=args.interval)
        display(self.status_panel)

    def _cmd_help(self, args, cell):
        print(usage())

    def _cmd_top(self, args, cell):
        lab = self._lab()
        for status in lab.queues():
            print(status)
            for e in status.queue:  # the orchestrator's sentence and rough wait, as every view shows them
                who = e.job or "another user's job"
                wait = "" if e.expected_wait_s is None else f", ~{e.expected_wait_s:.0f} s"
                print(f"  #{e.position} {who}{f' ({e.kind})' if e.kind else ''}: {e.reason}{wait}")
        kernels = lab.kernels()
        if len(kernels):
            now = time.time()
            print("kernels:")
            for k in kernels.itertuples():
                memory = (k.device_bytes or k.rss_bytes or 0) / 2**20
                print(
                    f"  {k.name} [{k.state}] group {k.group}, {k.device} on {k.host}: "
                    f"{k.jobs} job{'' if k.jobs == 1 else 's'}, "
                    f"{memory:.0f} MiB, heartbeat {now - k.last_heartbeat:.1f} s ago"
                    + (f" ({k.lost_why})" if k.lost_why else "")
                )

    def _cmd_timeline(self, args, cell):
        from openrl_lab.lab.widgets import TimelineView

        display(TimelineView(self._lab().timeline(args.group, since_s=args.window), window_s=args.window))

    def _cmd_plot(self, args, cell):
        lab = self._lab()
        run = lab._leases.get(args.name) or lab.attach(args.name)
        metrics = [m.strip() for m in args.metrics.split(",")] if args.metrics else None
        display(run.plot(metrics, follow=True))

    def _cmd_fork(self, args, cell):
        names = [n.strip() for n in args.names.split(",") if n.strip()]
        settings = {}
        for item in args.settings:
            key, eq, values = item.partition("=")
            if not eq or not key.isidentifier():
                raise LabError(f"--set {item!r}: expected KEY=V1,V2 (one value per new run, or one for all)")
            settings[key] = [_setting(v) for v in values.split(",")]
            if len(settings[key]) == 1:
                settings[key] = settings[key][0]
        if not args.var.isidentifier():
            raise LabError(f"--var {args.var!r} is not a Python identifier")
        forks = self._lab().fork(args.name, names, priority=args.priority, **settings)
        self.shell.push({args.var: {f.name: f for f in forks}})
        for f in forks:
            print(f"{f} {f.variant['settings'] if f.variant else ''}".rstrip())
        print(f"bound: {args.var}")

    def _cmd_compare(self, args, cell):
        names = [n.strip() for n in args.names.split(",") if n.strip()]
        comparison = self._lab().compare(names, [m.strip() for m in args.metrics.split(",") if m.strip()])
        display(comparison.plot)
        print(comparison.summary().to_string())

    def _cmd_doctor(self, args, cell):
        from openrl_lab.lab.doctor import diagnose, render

        lab = self._lab()
        print(render(diagnose(lab.base_url, api_key=lab.connection.api_key)))

    def _cmd_sandbox(self, args, cell):
        from openrl_lab.sandbox.client import status_line

        sandbox = self._lab().sandbox
        print(status_line(sandbox.status()))
        if args.env:
            os.environ.update(sandbox.env())
            print("SANDBOX_URL set in this kernel's environment (SandboxFusion clients read it)")

    def _cmd_release(self, args, cell):
        self._lab().release(args.name)
        print(f"released {args.name}")

    def _cmd_phase(self, args, cell):
        if self.resident is not None and args.group in (None, self.resident.group, self.resident.group_id):
            from openrl_lab.lab.cells import run_cell_as_phase

            report = run_cell_as_phase(self.shell, self.resident, cell, kind=args.kind)
            if args.verbose and report.wait_line() is None:  # a wait is announced anyway
                print(f"phase on {report.group}: waited {report.waited_s * 1000:.1f} ms")
            return
        lab = self._lab()
        group = args.group or "trainer-group"
        lab.orchestrator.lease(group, priority=args.priority)  # this kernel's job on the group, in that class
        with lab.orchestrator.on_accelerators(group, kind=args.kind) as s:
            if args.verbose:
                print(f"phase on {group}: waited {s.waited_s * 1000:.1f} ms")
            self.shell.run_cell(cell)  # the cell's own errors are shown as usual; the slice is released

    def _cmd_resident(self, args, cell):
        from openrl_lab.lab.cells import CellHooks
        from openrl_lab.lab.resident import ResidentState, job_name

        state = self.resident
        if args.close:
            if state is None:
                raise LabError("no resident state to close in this kernel")
            assert self.cell_hooks is not None  # set with self.resident
            self.cell_hooks.uninstall()
            state.close()
            self.resident = self.cell_hooks = None
            print(f"closed {state.name}")
            return
        if not args.vars:
            print(
                state.describe()
                if state is not None
                else "no resident state in this kernel: %openrl resident VAR [VAR ...] --group G registers some"
            )
            return
        missing = [v for v in args.vars if v not in self.shell.user_ns]
        if missing:
            raise LabError(f"no variable named {', '.join(missing)} in this kernel")
        if args.var is not None and not args.var.isidentifier():
            raise LabError(f"--as {args.var!r} is not a Python identifier")
        if state is not None:  # one job per kernel: more variables join it
            if args.group not in (None, state.group, state.group_id):
                raise LabError(
                    f"this kernel's state is job {state.name} on group {state.group!r}; it cannot also "
                    f"be on {args.group!r} (%openrl resident --close first)"
                )
            if args.name is not None and job_name(args.name) != state.name:
                raise LabError(f"this kernel's state is already job {state.name}")
        else:
            state = ResidentState(
                self._lab().orchestrator,
                args.group or "trainer-group",
                args.name,
                weight=args.weight,
                quota_s=args.quota,
                priority=args.priority,
            )
            self.resident, self.cell_hooks = state, CellHooks(self.shell, state)
            self.cell_hooks.install()
        state.register(*(self.shell.user_ns[v] for v in args.vars), names=args.vars)
        if args.var:
            self.shell.push({args.var: state})
        print(state.describe() + (f"\nbound: {args.var}" if args.var else ""))

    def _cmd_autophase(self, args, cell):
        if self.cell_hooks is None:
            raise LabError("nothing is registered: %openrl resident VAR [VAR ...] first")
        assert self.resident is not None  # set with self.cell_hooks
        self.cell_hooks.autophase = args.switch == "on"
        print(
            f"autophase {args.switch}: "
            + (
                f"cells that use {', '.join(self.resident.objects)} run as phases on {self.resident.group}"
                if args.switch == "on"
                else "only %%openrl phase cells are phases"
            )
        )


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(OpenRLMagics)
