"""The demo's experiment over many seeds: how often RL learns, and how far, with one set of settings.

    .venv/bin/python benchmarks/rl_seeds.py [--seeds 0-9] [--workers 2] [--task copy] [--config demo|defaults]
                                            [--set FIELD=VALUE ...] [--out results.jsonl]

Each seed runs `openrl_lab.demo.sft_then_rl` (SFT warm-up, held-out reward before, RL, held-out reward after)
exactly as `make demo` does. `--workers N` runs N seeds at a time, each worker with a lab of its own and one
thread (OMP_NUM_THREADS=1), the seeds spread over them; rewards are seeded and do not depend on the load or on
which worker runs a seed. `--set` overrides one `RLConfig` field of the chosen config (`--set kl_coef=0.05`,
repeatable): a lever to measure, not a new default.

Prints one line per seed as it ends, then the spread: every seed's held-out sampled reward before and after RL,
greedy before and after, RL seconds, skipped steps, the first step the collapse detector fired (`collapse`,
`openrl_lab.recipes.metrics.collapse_onsets`), and the summary figures issue 49 asks for: seeds that improved,
median and worst sampled reward after RL, seeds whose greedy reward ended below its start, slowest RL. Each seed's
figures are appended to `--out` (JSON lines) as they come.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from pathlib import Path


def parse_seeds(text: str) -> list[int]:
    """'0-9' or '0,3,5' or '0-4,9'."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


def parse_sets(items: list[str]) -> dict:
    """FIELD=VALUE pairs, each value read as JSON when it parses (numbers, true/false) and as text otherwise."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def run_seeds(worker: int, seeds: list[int], args: dict, queue) -> None:
    """One worker: a lab of its own, its seeds one after another; each result goes to the queue as it ends."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the lab below stops too
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import tinker

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from rl_tasks import NEW_TASKS

    from openrl_lab.demo import demo_config, demo_task, sft_then_rl
    from openrl_lab.recipes import RLConfig
    from openrl_lab.recipes.metrics import collapse_onsets, skipped_steps
    from openrl_lab.server import LabServer

    home = Path(tempfile.mkdtemp(prefix=f"openrl-lab-seeds-{worker}-"))
    with LabServer(home) as lab:
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        for seed in seeds:
            task = demo_task() if args["task"] == "copy" else NEW_TASKS[args["task"]]()
            config = demo_config(seed=seed) if args["config"] == "demo" else RLConfig(seed=seed)
            config = dataclasses.replace(config, **args["sets"], **({"steps": args["steps"]} if args["steps"] else {}))
            t0 = time.perf_counter()
            run = sft_then_rl(service, task, config, seed=seed, progress=False)
            m = run.rl.metrics
            onsets = collapse_onsets(m)
            queue.put(
                {
                    "task": task.name,
                    "seed": seed,
                    "sets": args["sets"],
                    "config": args["config"],
                    "sft_steps": len(run.sft),
                    "before": run.before,
                    "after": run.after,
                    "rl_s": run.seconds["rl"],
                    "total_s": time.perf_counter() - t0,
                    "steps": len(m),
                    "skipped": int(skipped_steps(m).sum()),
                    "collapse_at": onsets[0] if onsets else None,
                    "entropy_first_last": [float(m["entropy"].head(10).mean()), float(m["entropy"].tail(10).mean())],
                }
            )
    queue.put(None)


def spread(rows: list[dict]) -> dict:
    """The figures issue 49 asks of a setting over seeds."""
    import numpy as np

    after = [r["after"]["sampled"] for r in rows]
    return {
        "seeds": len(rows),
        "improved": sum(r["after"]["sampled"] > r["before"]["sampled"] for r in rows),
        "median_after": float(np.median(after)),
        "worst_after": float(min(after)),
        "greedy_below_start": sum(r["after"]["greedy"] < r["before"]["greedy"] for r in rows),
        "collapsed": sum(r["collapse_at"] is not None for r in rows),
        "rl_s_max": float(max(r["rl_s"] for r in rows)),
        "rl_s_median": float(np.median([r["rl_s"] for r in rows])),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--task", default="copy", help="copy (the demo's) or a task of benchmarks/rl_tasks.py")
    ap.add_argument("--config", choices=("demo", "defaults"), default="demo")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--out", type=Path, default=None, help="append each seed's figures here (JSON lines)")
    args = ap.parse_args()
    seeds = parse_seeds(args.seeds)
    job = {"task": args.task, "config": args.config, "steps": args.steps, "sets": parse_sets(args.sets)}
    workers = max(1, min(args.workers, len(seeds)))
    if workers > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # each worker's lab (and its kernel) gets one of the cores
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    # daemonic: a worker (and the lab it stops on its way out) never outlives this process, even on SIGTERM
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs = [
        ctx.Process(target=run_seeds, args=(w, seeds[w::workers], job, queue), daemon=True) for w in range(workers)
    ]
    for p in procs:
        p.start()
    rows, running = [], workers
    print(f"{args.task}, config {args.config} {job['sets'] or ''}, seeds {seeds}, {workers} at a time", flush=True)
    while running:
        row = queue.get()
        if row is None:
            running -= 1
            continue
        rows.append(row)
        b, a = row["before"], row["after"]
        print(
            f"seed {row['seed']:>3}: sampled {b['sampled']:.3f} -> {a['sampled']:.3f}   greedy {b['greedy']:.3f} -> "
            f"{a['greedy']:.3f}   RL {row['rl_s']:.0f} s   skipped {row['skipped']}   collapse at "
            f"{row['collapse_at']}   entropy {row['entropy_first_last'][0]:.2f} -> {row['entropy_first_last'][1]:.2f}",
            flush=True,
        )
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    for p in procs:
        p.join()
    if len(rows) < len(seeds):
        print(f"only {len(rows)} of {len(seeds)} seeds finished", file=sys.stderr)
        return 1
    print(json.dumps(spread(sorted(rows, key=lambda r: r["seed"]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
