"""RL that learns: task reward before and after GRPO-style RL on the built-in model, and how long it takes.

    .venv/bin/python benchmarks/rl_reward.py [--task copy] [--steps 250] [--seed 0] [--out DIR] [--sampler torch|vllm]

Starts a lab (control plane + kernel, CPU) in a temporary home, then runs `openrl_lab.demo.sft_then_rl`:
a LoRA run on `openrl-lab/tiny-llama-1m`, a supervised warm-up on the copy task until the loss per answer
token is <= 0.8 (format learned, sampled reward still low), and RL through the tinker SDK
(`openrl_lab.recipes.rl_train`). The reward figures are the held-out task reward: 32 fixed problems from
the task's "eval" split (16 of the 64 copy strings, chosen by a stable hash of the prompt; the SFT warm-up
and RL draw only from the other 48, and the run checks that no evaluated prompt was trained on), 8 samples
each at temperature 1, as in RL; greedy decoding reported beside it.

Criteria (issue 3): reward <= 0.3 before RL, >= 0.9 after, within 3 minutes of wall time (lab start to
final evaluation). Prints the curve as a table, writes an interactive plot (plotly HTML), the metrics CSV,
a static SVG of the reward curve (the picture in docs/benchmarks.md) and a JSON of the figures into --out
(default: `results/` in the lab's temporary home); exits 1 if a criterion is missed.

`--task NAME` runs the same experiment (same SFT warm-up, same `demo_config`) on another task: `copy` (the
demo's, the default) or one of the tasks in `benchmarks/rl_tasks.py` that the defaults were not tuned for
(`successor`, `increment`, `sortchars`; issue 14).

`--loss-fn`, `--learning-rate`, `--lr-schedule`, `--prompts-per-step`, `--group-size`, `--temperature` override
the same fields of `demo_config`'s RLConfig for one run (levers to measure, not new defaults); `--model`,
`--sft-target-loss` and `--sft-steps` do the same for the model and the warm-up.

`--sampler vllm` starts the lab with `openrl-lab serve --sampler vllm` (the kernel samples with vLLM; run it
with the vLLM environment's Python, `make vllm-env`: `.venv-vllm/bin/python benchmarks/rl_reward.py ...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker

from openrl_lab.demo import LORA_RANK, SFT_SETTINGS, demo_config, demo_task, report, sft_then_rl
from openrl_lab.home import DEFAULT_MODEL
from openrl_lab.recipes import RLConfig
from openrl_lab.recipes.metrics import skipped_steps
from openrl_lab.server import LabServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rl_tasks import NEW_TASKS  # benchmarks/ is not a package: import it from beside this file

BEFORE_MAX, AFTER_MIN, WALL_MAX_S = 0.3, 0.9, 180.0


def write_svg(metrics, path: Path, before: float, after: float, title: str) -> Path:
    """A static picture of the reward curve for the docs (no plotting library needed): train reward per
    step (mean and ±std band), and the held-out reward before and after RL as dotted lines."""
    w, h, left, right, top, bottom = 720, 320, 56, 16, 36, 44
    sampled = metrics[metrics["reward"].notna()]  # a step with no samples has no reward: a gap, not a point
    steps, mean, std = list(sampled["step"]), list(sampled["reward"]), list(sampled["reward_std"])
    n = max(int(metrics["step"].iloc[-1]), 1)

    def xy(step, r):
        return left + (w - left - right) * step / n, top + (h - top - bottom) * (1 - min(max(r, 0.0), 1.0))

    def poly(points):
        return " ".join(f"{x:.1f},{y:.1f}" for x, y in points)

    band = [xy(s, m + d) for s, m, d in zip(steps, mean, std)] + [
        xy(s, m - d) for s, m, d in reversed(list(zip(steps, mean, std)))
    ]
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
    ]
    for r in (0.0, 0.25, 0.5, 0.75, 1.0):
        _, y = xy(0, r)
        out += [
            f'<line x1="{left}" y1="{y:.1f}" x2="{w - right}" y2="{y:.1f}" stroke="#ddd"/>',
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{r:.2f}</text>',
        ]
    for s in range(0, n + 1, max(10, (n // 10) // 10 * 10 or 10)):
        x, y0 = xy(s, 0.0)
        out.append(f'<text x="{x:.1f}" y="{y0 + 16:.1f}" text-anchor="middle">{s}</text>')
    out += [
        f'<text x="{(left + w - right) / 2}" y="{h - 8}" text-anchor="middle">RL step</text>',
        (
            f'<text x="14" y="{(top + h - bottom) / 2}" text-anchor="middle" '
            f'transform="rotate(-90 14 {(top + h - bottom) / 2})">task reward</text>'
        ),
        f'<polygon points="{poly(band)}" fill="rgba(31,119,180,0.15)" stroke="none"/>',
        (
            f'<polyline points="{poly([xy(s, m) for s, m in zip(steps, mean)])}" fill="none" stroke="#1f77b4" '
            'stroke-width="2"/>'
        ),
    ]
    for label, value, color in (
        (f"held-out before RL: {before:.2f}", before, "#d62728"),
        (f"held-out after RL: {after:.2f}", after, "#2ca02c"),
    ):
        _, y = xy(0, value)
        out += [
            f'<line x1="{left}" y1="{y:.1f}" x2="{w - right}" y2="{y:.1f}" stroke="{color}" stroke-dasharray="4 4"/>',
            f'<text x="{w - right - 4}" y="{y - 4:.1f}" text-anchor="end" fill="{color}">{label}</text>',
        ]
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--task",
        choices=("copy", *NEW_TASKS),
        default="copy",
        help="copy (the demo's task) or a task of benchmarks/rl_tasks.py the defaults were not tuned for",
    )
    ap.add_argument(
        "--config",
        choices=("demo", "defaults"),
        default="demo",
        help="demo: `make demo`'s RLConfig (demo_config, 250 steps, tuned on copy); defaults: rl_train's "
        "own defaults, RLConfig(seed=...), as a user who passes no config gets them",
    )
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="base model (e.g. openrl-lab/tiny-llama-10m); a lever to measure, not the default",
    )
    ap.add_argument(
        "--sft-target-loss",
        type=float,
        default=None,
        help=f"stop the warm-up at this loss per answer token (default {SFT_SETTINGS['target_loss']})",
    )
    ap.add_argument(
        "--sft-steps", type=int, default=None, help=f"at most this many warm-up steps (default {SFT_SETTINGS['steps']})"
    )
    # RL levers (issue 14): each overrides one field of demo_config's RLConfig for this run; defaults unchanged
    ap.add_argument(
        "--loss-fn",
        choices=("importance_sampling", "ppo"),
        default=None,
        help="RLConfig.loss_fn (default importance_sampling)",
    )
    ap.add_argument("--learning-rate", type=float, default=None, help="RLConfig.learning_rate")
    ap.add_argument(
        "--lr-schedule", choices=("linear", "constant"), default=None, help="RLConfig.lr_schedule (default linear)"
    )
    ap.add_argument("--prompts-per-step", type=int, default=None, help="RLConfig.prompts_per_step")
    ap.add_argument("--group-size", type=int, default=None, help="RLConfig.group_size")
    ap.add_argument("--temperature", type=float, default=None, help="RLConfig.temperature (default 1.0)")
    ap.add_argument(
        "--out", type=Path, default=None, help="where the plot, CSV and figures go (default <home>/results)"
    )
    ap.add_argument("--home", type=Path, default=None, help="lab home (default: a fresh temporary directory)")
    ap.add_argument(
        "--sampler",
        choices=("torch", "vllm"),
        default="torch",
        help="the kernel's sampler backend (`openrl-lab serve --sampler`; vllm needs the vLLM env)",
    )
    args = ap.parse_args()

    home = args.home or Path(tempfile.mkdtemp(prefix="openrl-lab-rl-bench-"))
    args.out = args.out or home / "results"
    t0 = time.perf_counter()
    with LabServer(home, args=("--sampler", args.sampler)) as lab:
        t_up = time.perf_counter() - t0
        service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
        task = demo_task() if args.task == "copy" else NEW_TASKS[args.task]()
        if args.config == "demo":
            config = demo_config(args.steps or 250, args.seed)
        else:
            config = RLConfig(seed=args.seed, **({"steps": args.steps} if args.steps else {}))
        rl_over = {
            k: v
            for k, v in (
                ("loss_fn", args.loss_fn),
                ("learning_rate", args.learning_rate),
                ("lr_schedule", args.lr_schedule),
                ("prompts_per_step", args.prompts_per_step),
                ("group_size", args.group_size),
                ("temperature", args.temperature),
            )
            if v is not None
        }
        config = dataclasses.replace(config, **rl_over)
        sft_over = {
            k: v for k, v in (("target_loss", args.sft_target_loss), ("steps", args.sft_steps)) if v is not None
        }
        run = sft_then_rl(service, task, config, model=args.model, seed=args.seed, sft_settings=sft_over)
        service.close("success").result()
    wall = time.perf_counter() - t0

    title = f"GRPO on {task.name} ({args.model}, LoRA rank {LORA_RANK}, seed {args.seed}, {args.sampler} sampler)"
    plot, summary, text = report(run, args.out, title)
    m = run.rl.metrics
    rolling = m["reward"].rolling(5).mean()
    reached = m.loc[rolling >= AFTER_MIN, "step"]
    reached8 = m.loc[rolling >= 0.8, "step"]
    figures = {
        "task": task.name,
        "config": args.config,
        "model": args.model,
        "lora_rank": LORA_RANK,
        "seed": args.seed,
        "sampler": args.sampler,
        "sft": {**SFT_SETTINGS, **sft_over, "steps_run": len(run.sft)},
        "rl": {
            k: getattr(config, k)
            for k in (
                "steps",
                "prompts_per_step",
                "group_size",
                "max_tokens",
                "temperature",
                "learning_rate",
                "lr_schedule",
                "loss_fn",
                "overlap",
            )
        },
        "rl_overrides": rl_over,
        "held_out_split": run.split,
        "reward_before": run.before,
        "reward_after": run.after,
        "first_step_rolling5_train_reward_ge_0.9": int(reached.iloc[0]) if len(reached) else None,
        "first_step_rolling5_train_reward_ge_0.8": int(reached8.iloc[0]) if len(reached8) else None,
        "seconds": {"lab_start": t_up, **run.seconds, "wall_total": wall},
        "rl_skipped_steps": int(skipped_steps(m).sum()),  # no group had reward spread: nothing trained
        "rl_step_s_median": float(m["step_s"].median()),
        "rl_sample_s_mean": float(m["sample_s"].mean()),
        "rl_train_s_mean": float(m["train_s"].mean()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}",
    }
    svg = write_svg(
        m,
        args.out / "rl-reward.svg",
        run.before["sampled"],
        run.after["sampled"],
        f"tiny-llama-1m learns the {task.name} task by RL (train reward per step, mean ± std; {args.sampler} sampler)",
    )
    (args.out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")

    checks = {
        f"reward before RL <= {BEFORE_MAX}": run.before["sampled"] <= BEFORE_MAX,
        f"reward after RL >= {AFTER_MIN}": run.after["sampled"] >= AFTER_MIN,
        f"wall time <= {WALL_MAX_S:.0f} s": wall <= WALL_MAX_S,
    }
    print(text)
    print(
        f"wall time: {wall:.1f} s total (lab start {t_up:.1f} s, SFT {run.seconds['sft']:.1f} s, "
        f"RL {run.seconds['rl']:.1f} s for {len(m)} steps, evaluation {run.seconds['eval']:.1f} s)"
    )
    reached_at = figures["first_step_rolling5_train_reward_ge_0.9"]
    print(f"train reward (rolling mean of 5 steps) first >= {AFTER_MIN} at step {reached_at}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    print(f"interactive plot: {plot}\nstatic picture: {svg}\nsummary: {summary}\nfigures: {args.out / 'figures.json'}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
