"""Every CUDA-only test and benchmark in one command, within 8 minutes on one GPU, with one summary table.

    make gpu-check                                   # = PYTHONPATH=. python3 benchmarks/gpu_check.py
    python3 benchmarks/gpu_check.py --dry-run        # the plan: each step, its command, its time budget
    python3 benchmarks/gpu_check.py --only gpu_swap  # some steps only (names from the plan)
    python3 benchmarks/gpu_check.py --out DIR        # where the results go (default: $OUT, else ./gpu_check_results)

Runs under whatever python has CUDA torch (the device machine's `python3`), installing nothing. Each step is a
subprocess in a process group of its own, with its own time budget: past it the group is killed (SIGTERM, then
SIGKILL 3 s later) and the next step still runs. A step whose requirements are missing (a package this python
cannot import, say vLLM) is skipped with the reason in the table; so is a step that fails with
`ModuleNotFoundError` for a package outside this checkout. Benchmarks end their output with one line of JSON;
its "summary" is the table's key figures and the whole line goes into gpu_check.json.

Without a CUDA device (or without torch) it prints one line, `no CUDA device: ...`, and exits with status 2;
--dry-run needs neither.

Results: gpu_check.json (every step: status, seconds, figures, the reason for a skip or a failure),
gpu_check.md (the table, then the benchmarks' own tables) and gpu_check.log (each step's output), three files,
so that the device tool brings all of them back from $OUT (it brings at most 8).

pytest on a machine that has only pytest: tests/conftest.py loads pytest-jupyter's plugin, which needs
jupyter_server; where pytest_jupyter is not importable, the pytest steps put benchmarks/gpu_stubs first on
PYTHONPATH, where an empty `pytest_jupyter.jupyter_server` stands in (no CUDA test uses its fixtures).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "benchmarks" / "gpu_stubs"
TOTAL_S = 480.0  # the whole plan: 8 minutes
EXIT_NO_CUDA = 2
# a failing step whose output says a package is missing is a skip (what must travel), unless the package is ours
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")
_OURS = {"openrl_lab", "tests", "benchmarks"}
# a test module with CUDA tests: `@pytest.mark.cuda`, `pytestmark = ... pytest.mark.cuda ...` or an alias of it
_MARKS_CUDA = re.compile(
    r"^\s*(@pytest\.mark\.cuda\b|pytestmark\s*=.*\bpytest\.mark\.cuda\b|\w+\s*=\s*pytest\.mark\.cuda\b)", re.M
)


@dataclasses.dataclass
class Step:
    name: str
    what: str
    cmd: list[str]  # "{py}" is this python, "{out}" the step's own scratch folder
    budget_s: float
    requires: tuple[str, ...] = ()  # modules this python must import, else the step is skipped
    kind: str = "bench"  # "pytest": figures from its JUnit XML; "bench": from its last line of JSON; "probe"
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # a module that, when missing, changes the command rather than skipping the step: {module: extra args}
    without: dict[str, list[str]] = dataclasses.field(default_factory=dict)


def cuda_test_files(root: Path = ROOT) -> list[str]:
    """The test modules that mark tests `cuda` (pytest.mark.cuda on a test, an alias or `pytestmark`)."""
    out = []
    for p in sorted((root / "tests").rglob("test_*.py")):
        if _MARKS_CUDA.search(p.read_text(errors="replace")):
            out.append(str(p.relative_to(root)))
    return out


# pytest's budget per file: collection imports torch (and transformers for some) before any test runs
_PYTEST_BUDGET = {"tests/swap/test_swapset.py": 45, "tests/kernel/test_engine_cuda.py": 90}


def probe() -> int:
    """The first step (`gpu_check.py --probe`, in its own process): torch sees the GPU and a kernel runs on it."""
    import torch

    ok = torch.cuda.is_available()
    d = {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": torch.cuda.device_count() if ok else 0}
    if ok:
        p = torch.cuda.get_device_properties(0)
        d |= {"device": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count}
        d["capability"] = f"{p.major}.{p.minor}"
        x = torch.ones(1 << 20, device="cuda")
        ok = int(x.sum().item()) == 1 << 20
    print(json.dumps({"ok": ok, "summary": d}))
    return 0 if ok else 1


def plan(root: Path = ROOT) -> list[Step]:
    """The steps, in order; their budgets add up to TOTAL_S."""
    probe_cmd = ["{py}", "benchmarks/gpu_check.py", "--probe"]
    steps = [Step("probe", "torch sees the GPU; a kernel runs on it", probe_cmd, 20, ("torch",), "probe")]
    for f in cuda_test_files(root):
        name = "pytest " + f.removeprefix("tests/")
        cmd = ["{py}", "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rs"]
        cmd += ["--junitxml", "{out}/junit.xml", "-o", "junit_family=xunit2", f]
        steps.append(Step(name, f"pytest -m cuda {f}", cmd, _PYTEST_BUDGET.get(f, 50), ("torch", "pytest"), "pytest"))
    bench = [
        Step(
            "gpu_swap",
            "SwapSet evict/restore/switch on the GPU: GB/s and efficiency against a plain pinned copy",
            ["{py}", "benchmarks/gpu_swap.py"],
            130,
            ("torch",),
            env={"OUT": "{out}"},
        ),
        Step(
            "resident_phase",
            "ResidentState on CUDA: phase overhead, evict/restore of 1 GB registered state vs a pinned copy",
            ["{py}", "benchmarks/resident_phase.py", "--device", "cuda", "--mb", "1000", "--phases", "200"],
            45,
            ("torch", "grpc", "google.protobuf"),
            without={"IPython": ["--no-cells"]},
        ),
        Step(
            "vllm_sampler",
            "the vLLM sampler against the torch sampler on the GPU (tokens/s, hot-load, engine start)",
            [
                "{py}",
                "benchmarks/vllm_sampler.py",
                "--device",
                "cuda",
                "--reps",
                "2",
                "--hotload-iters",
                "5",
                "--small-iters",
                "5",
                "--start-reps",
                "1",
                "--no-eager",
                "--out",
                "{out}",
            ],
            60,
            ("torch", "vllm"),
        ),
    ]
    steps += bench
    spent = sum(s.budget_s for s in steps)
    if spent > TOTAL_S:  # more test files than budgeted for: every budget shrinks alike
        for s in steps:
            s.budget_s = int(s.budget_s * TOTAL_S / spent)
    return steps


def missing_modules(mods) -> list[str]:
    out = []
    for m in mods:
        try:
            if importlib.util.find_spec(m) is None:
                out.append(m)
        except (ImportError, ValueError):  # a parent package missing
            out.append(m)
    return out


def _fill(s: str, py: str, out: Path) -> str:
    return s.replace("{py}", py).replace("{out}", str(out))


def command_of(step: Step, py: str = "python3", out: str | Path = "$STEP_OUT") -> list[str]:
    cmd = [_fill(c, py, Path(out)) for c in step.cmd]
    for mod, extra in step.without.items():
        if missing_modules([mod]):
            cmd += extra
    return cmd


def print_plan(steps: list[Step], file=sys.stdout) -> None:
    total = sum(s.budget_s for s in steps)
    print(f"gpu-check plan: {len(steps)} steps, {total:.0f} s of budgets (limit {TOTAL_S:.0f} s)", file=file)
    for i, s in enumerate(steps, 1):
        env = " ".join(f"{k}={_fill(v, '$GPU_PY', Path('$STEP_OUT'))}" for k, v in s.env.items())
        cmd = " ".join(c if c.startswith("$") else shlex.quote(c) for c in command_of(s, "$GPU_PY"))
        miss = missing_modules(s.requires)
        note = f"  [here: would skip, {', '.join(miss)} not installed]" if miss else ""
        print(f"{i:2d}. {s.name:<34s} budget {s.budget_s:5.0f} s  {s.what}{note}", file=file)
        print(f"      {env + ' ' if env else ''}{cmd}", file=file)
        if s.requires:
            print(f"      needs: {', '.join(s.requires)}", file=file)


def _last_json(text: str) -> dict | None:
    for raw in reversed(text.strip().splitlines()[-50:]):
        line = raw.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def _junit(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    fig = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in fig:
            fig[k] += int(s.get(k, 0))
    fig["passed"] = fig["tests"] - fig["failures"] - fig["errors"] - fig["skipped"]
    failed, skipped = [], []
    for case in root.iter("testcase"):
        name = case.get("name", "?")
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or tag).splitlines() or [tag]
                failed.append(f"{name}: {msg[0][:200]}")
        el = case.find("skipped")
        if el is not None:
            skipped.append(f"{name}: {(el.get('message') or '')[:200]}")
    fig["failed_tests"], fig["skipped_tests"] = failed, skipped
    return fig


def _kill(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _env(step: Step, out: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if step.kind == "pytest" and (missing_modules(["pytest_jupyter"]) or env.get("GPU_CHECK_STUBS") == "1"):
        paths.insert(0, str(STUBS))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update({k: _fill(v, sys.executable, out) for k, v in step.env.items()})
    return env


def run_step(step: Step, scratch: Path, budget_s: float, py: str = sys.executable) -> dict:
    """Runs one step; returns its row: name, status (pass / fail / skipped / timeout), seconds, figures, note."""
    row = {"step": step.name, "what": step.what, "budget_s": step.budget_s, "seconds": 0.0, "figures": {}}
    miss = missing_modules(step.requires)
    if miss:
        return row | {"status": "skipped", "note": f"skipped: {', '.join(miss)} not installed", "command": ""}
    out = scratch / re.sub(r"[^\w.-]+", "_", step.name)
    out.mkdir(parents=True, exist_ok=True)
    cmd = command_of(step, py, out)
    row["command"] = shlex.join(cmd)
    if budget_s <= 0:
        return row | {"status": "skipped", "note": "skipped: no time left of the total budget"}
    log = out / "output.log"
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=_env(step, out), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(budget_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc, timed_out = proc.returncode, True
    row["seconds"] = round(time.monotonic() - t0, 1)
    row["rc"] = rc
    text = log.read_text(errors="replace")
    row["output"] = text
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [""]
    if step.kind == "pytest":
        fig = _junit(out / "junit.xml")
        if fig is not None:
            row["figures"] = fig
            row["summary"] = {k: fig[k] for k in ("passed", "failures", "errors", "skipped")}
    else:
        last = _last_json(text)
        if last is not None:
            row["figures"] = last
            row["summary"] = last.get("summary", {})
    if timed_out:
        return row | {"status": "timeout", "note": f"killed past its budget of {budget_s:.0f} s; last: {tail[0][:160]}"}
    m = _MISSING.search(text)
    if rc != 0 and m and m.group(1).split(".")[0] not in _OURS:
        return row | {"status": "skipped", "note": f"skipped: {m.group(1).split('.')[0]} not installed"}
    if step.kind == "pytest":
        fig = row["figures"]
        if rc == 5 or (fig and fig["tests"] == 0):
            return row | {"status": "fail", "note": "no test ran"}
        if rc == 0 and fig and fig["passed"] == 0:  # all skipped: say why
            return row | {"status": "skipped", "note": "; ".join(fig["skipped_tests"])[:300]}
        if rc != 0:
            why = "; ".join(fig["failed_tests"])[:300] if fig and fig["failed_tests"] else tail[0][:200]
            return row | {"status": "fail", "note": why}
        return row | {"status": "pass", "note": f"{len(fig['skipped_tests'])} skipped" if fig["skipped"] else ""}
    if rc != 0:
        return row | {"status": "fail", "note": f"exit {rc}: {tail[0][:200]}"}
    if row["figures"].get("ok") is False:
        return row | {"status": "fail", "note": row["figures"].get("why", "the benchmark's own check failed")}
    if not row["figures"]:
        return row | {"status": "fail", "note": "no JSON summary line at the end of its output"}
    return row | {"status": "pass", "note": ""}


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def figures_text(row: dict) -> str:
    return ", ".join(f"{k} {_fmt(v)}" for k, v in (row.get("summary") or {}).items())


def table(rows: list[dict]) -> str:
    lines = ["| step | status | seconds | budget s | key figures | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        note = (r.get("note") or "").replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {r['step']} | {r['status']} | {r['seconds']:.1f} | {r['budget_s']:.0f} | "
            f"{figures_text(r).replace('|', '/')} | {note} |"
        )
    return "\n".join(lines)


def write_results(rows: list[dict], out_dir: Path, header: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "timeout", "skipped")}
    doc = header | {"counts": counts, "steps": [{k: v for k, v in r.items() if k != "output"} for r in rows]}
    (out_dir / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = [f"# gpu-check: {header.get('device', '?')}", ""]
    md += [f"{header.get('when', '')}, torch {header.get('torch', '?')}, {header.get('seconds', 0):.0f} s in all.", ""]
    md += [table(rows), ""]
    for r in rows:
        detail = (r.get("figures") or {}).get("markdown")
        if detail:
            md += [f"## {r['step']}", "", detail, ""]
    (out_dir / "gpu_check.md").write_text("\n".join(md))
    with open(out_dir / "gpu_check.log", "w") as f:
        for r in rows:
            f.write(f"===== {r['step']}: {r['status']} in {r['seconds']:.1f} s: {r.get('command', '')}\n")
            text = r.get("output", "")
            if len(text) > 400_000:  # the log stays well under what comes back (16 MiB a file)
                text = "[... cut ...]\n" + text[-400_000:]
            f.write(text + "\n")


def run_plan(steps: list[Step], out_dir: Path, total_s: float = TOTAL_S, header: dict | None = None) -> list[dict]:
    """Runs the steps in order, each within min(its budget, what is left of total_s); prints and writes the table."""
    start = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        for s in steps:
            left = total_s - (time.monotonic() - start)
            print(f"--- {s.name} (budget {min(s.budget_s, max(left, 0)):.0f} s)", flush=True)
            row = run_step(s, Path(scratch), min(s.budget_s, left))
            print(f"    {row['status']} in {row['seconds']:.1f} s {row.get('note', '')}", flush=True)
            rows.append(row)
    header = (header or {}) | {"seconds": round(time.monotonic() - start, 1)}
    write_results(rows, out_dir, header)
    print()
    print(table(rows))
    print(f"\nwritten to {out_dir}/gpu_check.json, gpu_check.md and gpu_check.log")
    return rows


def probe_cuda(py: str = sys.executable, timeout: float = 60.0) -> tuple[bool, str, str]:
    """(True, device name, torch version) where `py`'s torch sees a CUDA device, else (False, why, version): in a
    child, so that this process holds no CUDA context while the steps run."""
    code = "import torch; print(torch.__version__); print(torch.cuda.is_available() and torch.cuda.get_device_name(0))"
    try:
        p = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        return False, f"{py} took over {timeout:.0f} s to ask torch for one", "?"
    if p.returncode != 0:
        err = (p.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"{py} cannot import torch ({err[:160]})", "?"
    lines = [*p.stdout.strip().splitlines(), "?", "False"]
    version, name = lines[0], lines[1]
    if name == "False":
        why = f"torch {version} under {py} sees none (torch.cuda.is_available() is False: a CPU build, or no GPU here)"
        return False, why, version
    return True, name, version


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", "--list", action="store_true", dest="dry_run", help="print the plan; run nothing")
    ap.add_argument("--only", help="comma-separated step names (or prefixes) from the plan")
    ap.add_argument("--out", type=Path, help="results folder (default: $OUT, else ./gpu_check_results)")
    ap.add_argument("--probe", action="store_true", help="the first step alone: torch, the GPU, one kernel (JSON)")
    ap.add_argument("--total", type=float, default=TOTAL_S, help=f"seconds for the whole plan (default {TOTAL_S:.0f})")
    args = ap.parse_args(argv)
    if args.probe:
        return probe()
    steps = plan()
    if args.only:
        want = [w.strip() for w in args.only.split(",") if w.strip()]
        steps = [s for s in steps if any(s.name == w or s.name.startswith(w) for w in want)]
        if not steps:
            ap.error(f"--only {args.only}: no such step (see --dry-run)")
    if args.dry_run:
        print_plan(steps)
        return 0
    ok, device, version = probe_cuda()
    if not ok:
        print(f"no CUDA device: {device}; nothing was run (--dry-run prints the plan)", file=sys.stderr)
        return EXIT_NO_CUDA
    out_dir = args.out or Path(os.environ.get("OUT") or "gpu_check_results")
    header = {"device": device, "torch": version, "python": sys.executable, "when": time.strftime("%Y-%m-%d %H:%M %Z")}
    rows = run_plan(steps, out_dir, args.total, header)
    return 0 if all(r["status"] in ("pass", "skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
