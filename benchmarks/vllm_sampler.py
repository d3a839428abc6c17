"""The vLLM sampler against the torch sampler, at the kernel-engine level, on CPU (issue 13).

    make vllm-env
    .venv-vllm/bin/python benchmarks/vllm_sampler.py [--model openrl-lab/tiny-llama-1m] [--reps 3] [--out DIR]

In-process `openrl_lab.kernel.engine.Engine`s in a temporary home, one per sampler backend, each with the same
LoRA job (rank 32, same seed, trained a few steps on the same data, so all hold the same weights):
  torch     Engine(home)                                  the torch sampler (the default)
  merge     Engine(home, sampler="vllm", ...)             vLLM, LoRA snapshots merged into the weights (CPU default)
  adapter   the same with OPENRL_VLLM_LORA=adapter        vLLM's own LoRA kernels (the GPU default; slow on CPU)
  eager     merge, with vLLM's enforce_eager=True         a what-if (--no-eager skips it): vLLM without
                                                          torch.compile, which dominates a vLLM engine's start

1. Throughput: an RL step's batch, `--prompts` (32) prompts x `--samples` (32) samples x `--tokens` (64)
   tokens, stop=[] (every sequence runs to max_tokens), temperature 1, issued as one `Engine.sample` call per
   prompt from as many threads at once (as the gateway issues an RL step's requests; on vLLM they meet in the
   engine's batcher and run as one batch). On (a) a LoRA snapshot of the job and (b) the base model.
   tokens/s = prompts x samples x tokens / wall time of the batch. The weights a batch needs are loaded
   before it is timed (a 1-token call), so the figure is sampling only; the reload is part of (2).
   torch, merge and eager alternate (rotating order), `--reps` times; the ratio is taken within each rep (median
   and range reported).
   adapter runs once per target with `--adapter-prompts` prompts (it is ~15x slower), next to a torch batch
   of the same size for its ratio.
2. Hot-loading a new LoRA version, `--hotload-iters` times: one training step on the job (not timed), then
   `Engine.snapshot_sampler` (timed), then the first sample call on the new snapshot (1 prompt x 8 x 16
   tokens; in merge mode it reloads the engine's weights) and a second identical call (the same without the
   reload). Engines alternate within each iteration.
3. Engine start, as a kernel starts: in a fresh child process (`--start-reps` times, torch and vLLM
   alternating), the import of the engine module, then `Engine(home, sampler="vllm",
   sampler_models=(model,))` + `open_sampler` on the base model (for the torch sampler `Engine(home)` +
   `open_sampler`, which loads the model), and the child's whole wall time. Also, in this process, the wall
   time of each Engine the benchmark makes (the first vLLM engine in a process pays for vLLM's own set-up).
4. Small batch, `--small-iters` times: 1 prompt x 8 samples x 16 tokens, latency of one call, on the
   snapshot and on the base model, engines alternating.

Prints plain-text tables and writes the figures as JSON to --out (default: a temporary directory).
The machine is shared: compare ratios measured in the same run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from tqdm import tqdm

from openrl_lab.kernel.api import AdamSettings, LoraSettings, SamplingParams
from openrl_lab.kernel.engine import Engine

ADAM = AdamSettings(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
LORA = LoraSettings(rank=32, seed=0)
JOB = "job"


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _train_step(engine: Engine, rng_seed: int) -> None:
    """One cross-entropy step on the job: the same data on every engine for the same seed."""
    rng = np.random.default_rng(rng_seed)
    data = []
    for _ in range(4):
        tokens = rng.integers(3, 200, size=24).astype(np.int64)
        data.append((tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(23, np.float32)}))
    engine.forward_backward(JOB, data, "cross_entropy", None, True)
    engine.optim_step(JOB, ADAM)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 200, size=8).tolist() for _ in range(n)]


def _batch(engine: Engine, sampler_id: str, prompts: list[list[int]], samples: int, tokens: int) -> float:
    """The RL step's batch as concurrent calls; its wall time (every sequence checked to be `tokens` long)."""
    params = SamplingParams(max_tokens=tokens, temperature=1.0, stop=[])
    with ThreadPoolExecutor(len(prompts)) as pool:
        t0 = time.perf_counter()
        outs = list(pool.map(lambda p: engine.sample(sampler_id, p, samples, params, False), prompts))
        wall = time.perf_counter() - t0
    lengths = {len(seq.tokens) for out in outs for seq in out.sequences}
    assert lengths == {tokens} and all(len(o.sequences) == samples for o in outs), lengths
    return wall


def _call(engine: Engine, sampler_id: str, prompt: list[int], samples: int = 8, tokens: int = 16) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=1.0, stop=[])
    return _timed(lambda: engine.sample(sampler_id, prompt, samples, params, False))[0]


_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from openrl_lab.kernel.engine import Engine
t1 = time.perf_counter()
home, kind, model, device = sys.argv[1:]
from pathlib import Path
if kind == "vllm-eager":
    import vllm
    init = vllm.LLM.__init__
    vllm.LLM.__init__ = lambda self, *a, **k: init(self, *a, **(k | {"enforce_eager": True}))
sampler = "torch" if kind == "torch" else "vllm"
e = Engine(Path(home), device=device, sampler=sampler, sampler_models=(model,) if sampler == "vllm" else ())
e.open_sampler("base", model, None)
t2 = time.perf_counter()
print("CHILD " + json.dumps({"import_s": t1 - t0, "engine_s": t2 - t1}))
"""


def _child_start(kind: str, model: str, home: Path, device: str = "cpu") -> dict:
    """A kernel's start in a fresh process: imports, then the Engine and a sampler on the base model."""
    import subprocess

    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(home), kind, model, device],
        capture_output=True,
        text=True,
        check=False,
        env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    wall = time.perf_counter() - t0
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("CHILD ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"engine start ({kind}) failed: {out.stderr[-2000:]}")
    return json.loads(line.removeprefix("CHILD ")) | {"process_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        default="openrl-lab/tiny-llama-1m",
        help="openrl-lab/tiny-llama-1m (default) or openrl-lab/tiny-llama-10m",
    )
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="throughput repetitions (torch and merge alternate)")
    ap.add_argument(
        "--adapter-prompts",
        type=int,
        default=8,
        help="prompts in the adapter-mode batch (it is ~15x slower on CPU); 0: skip adapter mode",
    )
    ap.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also a merge-mode engine with enforce_eager=True (vLLM without torch.compile; a what-if)",
    )
    ap.add_argument("--train-steps", type=int, default=5, help="training steps before the snapshot")
    ap.add_argument("--hotload-iters", type=int, default=20)
    ap.add_argument("--small-iters", type=int, default=20)
    ap.add_argument("--start-reps", type=int, default=3, help="engine starts in child processes, per sampler")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N: where every engine runs")
    ap.add_argument("--out", type=Path, default=None, help="where figures.json goes (default: a temp directory)")
    args = ap.parse_args()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="openrl-lab-vllm-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="openrl-lab-vllm-bench-home-"))
    model = args.model

    def save() -> None:  # after each part: a later failure keeps what was measured
        (args.out / "figures.json").write_text(json.dumps(fig, indent=2) + "\n")

    fig: dict = {
        "model": model,
        "lora": LORA,
        "train_steps": args.train_steps,
        "start_reps": args.start_reps,
        "batch": {
            "prompts": args.prompts,
            "samples": args.samples,
            "tokens": args.tokens,
            "temperature": 1.0,
            "stop": [],
        },
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs, python {platform.python_version()}",
    }

    # --- 3. engine start ---------------------------------------------------------------------------------
    from openrl_lab.train.models import resolve_model_dir

    resolve_model_dir(model, home)  # the built-in model is built once, before anything is timed
    children: dict[str, list[dict]] = {k: [] for k in ("torch", "vllm", "vllm-eager")[: 3 if args.eager else 2]}
    kinds = list(children)
    with tqdm(total=len(kinds) * args.start_reps, desc="engine start (child processes)", unit="start") as bar:
        for i in range(args.start_reps):
            for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                children[kind].append(_child_start(kind, model, home, args.device))
                bar.update()
    fig["engine_start_child"] = {
        k: {f: _stats([r[f] for r in rows]) for f in rows[0]} for k, rows in children.items() if rows
    }
    t_import, vllm = _timed(lambda: __import__("vllm"))
    import torch

    fig["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
    engines: dict[str, Engine] = {}
    start: dict[str, float] = {"import_vllm_s": t_import}
    t, engines["torch"] = _timed(lambda: Engine(home, device=args.device))
    start["torch_engine_s"] = t
    start["torch_first_open_sampler_s"] = _timed(lambda: engines["torch"].open_sampler("base", model, None))[0]
    os.environ["OPENRL_VLLM_LORA"] = "merge"  # the CPU default; on a GPU the default is adapter
    try:
        t, engines["merge"] = _timed(lambda: Engine(home, device=args.device, sampler="vllm", sampler_models=(model,)))
    finally:
        del os.environ["OPENRL_VLLM_LORA"]
    start["vllm_merge_engine_s"] = t
    if args.eager:  # what-if: vLLM without torch.compile (enforce_eager), not a setting of openrl_lab today
        import vllm as _v

        init = _v.LLM.__init__
        _v.LLM.__init__ = lambda self, *a, **k: init(self, *a, **(k | {"enforce_eager": True}))
        try:
            os.environ["OPENRL_VLLM_LORA"] = "merge"
            t, engines["eager"] = _timed(
                lambda: Engine(home, device=args.device, sampler="vllm", sampler_models=(model,))
            )
        finally:
            _v.LLM.__init__ = init
            os.environ.pop("OPENRL_VLLM_LORA", None)
        start["vllm_merge_eager_engine_s"] = t
    if args.adapter_prompts:
        os.environ["OPENRL_VLLM_LORA"] = "adapter"  # read when the engine's VllmSampler is made
        try:
            t, engines["adapter"] = _timed(
                lambda: Engine(home, device=args.device, sampler="vllm", sampler_models=(model,))
            )
        finally:
            del os.environ["OPENRL_VLLM_LORA"]
        start["vllm_adapter_engine_s"] = t
    fig["engine_start"] = start
    for name, e in engines.items():
        if name != "torch":
            e.open_sampler("base", model, None)
        e.create_job(JOB, model, LORA, seed=0)
        for i in range(args.train_steps):
            _train_step(e, i)
        e.snapshot_sampler(JOB, "snap")
    modes = {n: e._samplers["snap"].handle.engine.lora_mode for n, e in engines.items() if n != "torch"}
    assert modes["merge"] == modes.get("eager", "merge") == "merge" and modes.get("adapter", "adapter") == "adapter", (
        modes
    )
    fig["lora_modes"] = modes
    save()
    # The engines sample the same model: prompt logprobs of the snapshot and of the base agree with torch's.
    check = _prompts(1, seed=5)[0] * 3
    agree = {}
    for sid in ("snap", "base"):
        ref = np.array(engines["torch"].sample(sid, check, 1, SamplingParams(max_tokens=1), True).prompt_logprobs[1:])
        for name in (n for n in engines if n != "torch"):
            got = np.array(engines[name].sample(sid, check, 1, SamplingParams(max_tokens=1), True).prompt_logprobs[1:])
            agree[f"{name}/{sid}"] = float(np.abs(got - ref).max())
    fig["prompt_logprobs_max_abs_diff_vs_torch"] = agree
    assert max(agree.values()) < 1e-3, agree

    # --- 1. throughput -----------------------------------------------------------------------------------
    prompts = _prompts(args.prompts)
    n_tok = args.prompts * args.samples * args.tokens
    warm = _prompts(1, seed=99)[0]
    targets = {"lora": "snap", "base": "base"}
    main_names = [n for n in engines if n != "adapter"]
    for name in main_names:  # first calls (vLLM's warm-up, the torch sampler's first decode)
        for sid in targets.values():
            _call(engines[name], sid, warm)
    thr: dict[str, dict[str, list[float]]] = {t: {n: [] for n in main_names} for t in targets}
    with tqdm(total=args.reps * len(main_names) * len(targets), desc="throughput", unit="batch") as bar:
        for rep in range(args.reps):
            order = main_names[rep % len(main_names) :] + main_names[: rep % len(main_names)]
            for target, sid in targets.items():
                for name in order:
                    _call(engines[name], sid, warm, samples=1, tokens=1)  # its weights loaded (merge mode)
                    thr[target][name].append(n_tok / _batch(engines[name], sid, prompts, args.samples, args.tokens))
                    bar.update()
    fig["throughput_tok_s"] = {
        t: {n: _stats(v) for n, v in rows.items()}
        | {
            f"ratio_{n}_vs_torch": _stats([m / tt for m, tt in zip(rows[n], rows["torch"])])
            for n in main_names
            if n != "torch"
        }
        for t, rows in thr.items()
    }
    if args.adapter_prompts:
        small = prompts[: args.adapter_prompts]
        n_small = len(small) * args.samples * args.tokens
        ad: dict = {"prompts": len(small)}
        for target, sid in tqdm(targets.items(), desc="adapter mode (once per target)", unit="target"):
            _call(engines["adapter"], sid, warm)
            _call(engines["torch"], sid, warm, samples=1, tokens=1)
            t_torch = n_small / _batch(engines["torch"], sid, small, args.samples, args.tokens)
            t_ad = n_small / _batch(engines["adapter"], sid, small, args.samples, args.tokens)
            ad[target] = {"torch": t_torch, "adapter": t_ad, "ratio_adapter_vs_torch": t_ad / t_torch}
        fig["adapter_throughput_tok_s"] = ad
    save()

    # --- 2. hot-loading a new LoRA version -----------------------------------------------------------
    hot_names = list(engines)
    hot = {n: {"snapshot_s": [], "first_call_s": [], "second_call_s": []} for n in hot_names}
    probe = _prompts(1, seed=7)[0]
    for i in tqdm(range(args.hotload_iters), desc="hot-load", unit="iter"):
        for name in hot_names if i % 2 == 0 else hot_names[::-1]:
            e = engines[name]
            _train_step(e, 1000 + i)
            sid = f"hot-{i}"
            hot[name]["snapshot_s"].append(_timed(lambda e=e, sid=sid: e.snapshot_sampler(JOB, sid))[0])
            hot[name]["first_call_s"].append(_call(e, sid, probe))
            hot[name]["second_call_s"].append(_call(e, sid, probe))
    if args.hotload_iters:
        fig["hot_load"] = {n: {k: _stats(v) for k, v in rows.items()} for n, rows in hot.items()}
        # only the job's last SNAPSHOTS_PER_JOB snapshots are kept: the newest one is the LoRA target from here
        targets["lora"] = f"hot-{args.hotload_iters - 1}"
    save()

    # --- 4. small batch --------------------------------------------------------------------------------
    small_lat = {t: {n: [] for n in engines} for t in targets} if args.small_iters else {}
    for i in tqdm(range(args.small_iters), desc="small batch", unit="iter"):
        for target, sid in targets.items():
            for name in hot_names if i % 2 == 0 else hot_names[::-1]:
                _call(engines[name], sid, probe, samples=1, tokens=1)  # weights loaded, not timed
                small_lat[target][name].append(_call(engines[name], sid, probe))
    fig["small_batch_s"] = (
        {}
        if not small_lat
        else {
            t: {n: _stats(v) for n, v in rows.items()}
            | {
                f"ratio_{n}_vs_torch": _stats([a / b for a, b in zip(rows[n], rows["torch"])])
                for n in rows
                if n != "torch"
            }
            for t, rows in small_lat.items()
        }
    )

    save()
    print(report(fig))
    print(f"figures: {args.out / 'figures.json'}")
    thr = fig["throughput_tok_s"]
    summary = {
        f"{t} {k.removeprefix('ratio_')}": round(v["median"], 2)
        for t in thr
        for k, v in thr[t].items()
        if k.startswith("ratio_")
    }
    summary["torch lora tok/s"] = round(thr["lora"]["torch"]["median"])
    summary["logprob diff"] = f"{max(fig['prompt_logprobs_max_abs_diff_vs_torch'].values()):.1e}"
    # the machine-readable last line (benchmarks/gpu_check.py reads it)
    print(json.dumps({"benchmark": "vllm_sampler", "device": args.device, "ok": True, "summary": summary}))
    return 0


def _r(s: dict, fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"


def report(fig: dict) -> str:
    b = fig["batch"]
    lines = [
        (
            f"vLLM sampler vs torch sampler, {fig['model']}, LoRA rank {fig['lora']['rank']}, "
            f"vllm {fig['versions']['vllm']}, torch {fig['versions']['torch']}, {fig['machine']}"
        ),
        "",
        (
            f"Throughput, {b['prompts']} concurrent calls x {b['samples']} samples x {b['tokens']} tokens "
            f"(tokens/s, median (min-max) of {fig['throughput_tok_s']['lora']['torch']['n']} reps):"
        ),
        f"  {'target':<8} {'engine':<7} {'tokens/s':>22} {'ratio to torch':>22}",
    ]
    for t, row in fig["throughput_tok_s"].items():
        for n in (k for k in row if not k.startswith("ratio")):
            ratio = _r(row[f"ratio_{n}_vs_torch"], "{:.2f}x") if n != "torch" else ""
            lines.append(f"  {t:<8} {n:<7} {_r(row[n]):>22} {ratio:>22}")
    if "adapter_throughput_tok_s" in fig:
        ad = fig["adapter_throughput_tok_s"]
        lines += [
            "",
            (
                f"vLLM adapter mode (OPENRL_VLLM_LORA=adapter), once, {ad['prompts']} prompts x "
                f"{b['samples']} x {b['tokens']} (tokens/s):"
            ),
            f"  {'target':<8} {'torch':>10} {'adapter':>10} {'adapter / torch':>16}",
        ]
        for t in ("lora", "base"):
            lines.append(
                f"  {t:<8} {ad[t]['torch']:>10,.0f} {ad[t]['adapter']:>10,.0f} "
                f"{ad[t]['ratio_adapter_vs_torch']:>15.2f}x"
            )
    lines += [
        "",
        "prompt logprobs, max |vLLM - torch|: "
        + ", ".join(f"{k} {v:.1e}" for k, v in fig["prompt_logprobs_max_abs_diff_vs_torch"].items()),
    ]
    ms = "{:.1f}"
    lines += (
        []
        if "hot_load" not in fig
        else [
            "",
            (
                f"Hot-loading a new LoRA version (ms, median (min-max) of "
                f"{next(iter(fig['hot_load'].values()))['snapshot_s']['n']}; calls: 1 prompt x 8 x 16 tokens):"
            ),
            f"  {'engine':<8} {'snapshot_sampler':>22} {'first call':>22} {'second call':>22}",
        ]
    )
    for n, row in fig.get("hot_load", {}).items():
        lines.append(
            f"  {n:<8} "
            + " ".join(
                f"{_r({k: v * 1e3 if k != 'n' else v for k, v in row[c].items()}, ms):>22}"
                for c in ("snapshot_s", "first_call_s", "second_call_s")
            )
        )
    lines += (
        []
        if not fig["start_reps"]
        else [
            "",
            f"Engine start in a fresh process (s, median (min-max) of {fig['start_reps']}):",
            f"  {'sampler':<8} {'import':>20} {'Engine + open_sampler':>22} {'process':>20}",
        ]
    )
    for k, row in fig["engine_start_child"].items():
        lines.append(
            f"  {k:<8} {_r(row['import_s'], '{:.2f}'):>20} {_r(row['engine_s'], '{:.2f}'):>22} "
            f"{_r(row['process_s'], '{:.2f}'):>20}"
        )
    s = fig["engine_start"]
    lines += ["  in this process (s): " + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in s.items())]
    lines += (
        []
        if not fig["small_batch_s"]
        else [
            "",
            (
                f"Small batch, 1 prompt x 8 samples x 16 tokens (ms per call, median (min-max) of "
                f"{fig['small_batch_s']['lora']['torch']['n']}):"
            ),
        ]
    )
    for t, row in fig["small_batch_s"].items():
        cells = [
            f"{n} {_r({k: v * 1e3 if k != 'n' else v for k, v in row[n].items()}, ms)}"
            for n in row
            if not n.startswith("ratio")
        ]
        ratios = [f"{k.removeprefix('ratio_')} {_r(v, '{:.2f}x')}" for k, v in row.items() if k.startswith("ratio")]
        lines.append(f"  {t:<5} " + "; ".join(cells) + "; latency " + "; ".join(ratios))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
