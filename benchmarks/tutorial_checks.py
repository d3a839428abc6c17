"""The tutorials' checks over seeds and kernel thread counts: how often each holds, and by what margin.

    .venv/bin/python benchmarks/tutorial_checks.py [--tutorials 02,03,01,04,05,06] [--seeds 10] [--threads 1,2]
                                                   [--markdown FILE] [--json FILE]

Running every notebook 20 times is too slow on a small machine, so this reproduces each tutorial's checked
cells with the same calls (the lab helpers, the tinker SDK) against a real control plane
(`openrl_lab.server.LabServer`, a child process, in a temporary home), one lab per thread setting
(`$OPENRL_KERNEL_THREADS` in the kernel, see `openrl_lab/kernel/process.py`). Same task, steps, learning
rates and batch as the notebook; the seed is the one a reader changes (`%openrl lease ... --seed N`, or
`seed=` of the SDK call); seed 0 is the notebook as stored.

For each tutorial and thread count it prints passes/N and the checked statistic's min / median / max, and
with --markdown writes that table (the one in docs/benchmarks.md, "Tutorial checks"); --json keeps every
run's figures (e.g. tutorial 02's per-step rewards) to judge other statistics without rerunning.

Tutorial 06 runs plain PyTorch in the notebook's own process: here with torch's threads set to the setting
instead of the kernel's. Tutorial 07 needs the cookbook's environment and is not measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
from tinker import types

from openrl_lab.lab import Lab
from openrl_lab.recipes import Copy, evaluate, group_advantages, sft_train
from openrl_lab.server import LabServer

# ---------------------------------------------------------------------------------------------- 01


def tutorial_01(lab: Lab, seed: int) -> dict:
    """01-quickstart: 30 supervised steps on two sentences, the last loss below half the first (LoRA rank 8);
    5 full fine-tuning steps, the last below the first."""
    run = lab.lease(f"quickstart-{seed}", group="trainer-group", rank=8, seed=seed)
    tokenizer = run.tokenizer()

    def datum(text: str) -> types.Datum:
        tokens = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )

    texts = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs."]
    batch = [datum(t) for t in texts]
    n_tokens = sum(d.model_input.length for d in batch)
    losses = []
    for _ in range(30):
        fb = run.training.forward_backward(batch, "cross_entropy")
        opt = run.training.optim_step(types.AdamParams(learning_rate=3e-3))
        losses.append(fb.result().metrics["loss:sum"] / n_tokens)
        opt.result()
    lab.release(run.name)
    full = lab.lease(f"quickstart-full-{seed}", group="trainer-group", full=True)
    full_losses = []
    for _ in range(5):
        fb = full.training.forward_backward(batch, "cross_entropy")
        full.training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        full_losses.append(fb.result().metrics["loss:sum"] / n_tokens)
    lab.release(full.name)
    ratio, full_ratio = losses[-1] / losses[0], full_losses[-1] / full_losses[0]
    return {
        "stat": ratio,
        "ok": ratio < 0.5 and full_ratio < 1.0,
        "full_ratio": full_ratio,
        "losses": losses,
        "full_losses": full_losses,
    }


# ---------------------------------------------------------------------------------------------- 02

# The notebook's RL settings; the variables try others (docs/benchmarks.md compares 4 prompts x 32, the old ones)
PROMPTS = int(os.environ.get("TUTORIAL_02_PROMPTS", "8"))
GROUP = int(os.environ.get("TUTORIAL_02_GROUP", "16"))
STEPS = int(os.environ.get("TUTORIAL_02_STEPS", "30"))
LR_02 = float(os.environ.get("TUTORIAL_02_LR", "1.5e-3"))
EVAL_PROBLEMS, EVAL_SEED = 32, 12345  # the tutorial's fixed evaluation prompts (held out from training)


def evaluate_02(run, task, problems) -> dict:
    """The held-out reward as the notebook measures it (`openrl_lab.recipes.evaluate`, fixed seeds, so the same
    draws before and after RL): greedy (one completion per problem), and sampled (8 at temperature 1)."""
    sampler = run.training.save_weights_and_get_sampling_client().result()
    tokenizer = run.tokenizer()
    return {
        "greedy": evaluate(sampler, tokenizer, task, problems, samples_per_problem=1, temperature=0.0),
        "sampled": evaluate(sampler, tokenizer, task, problems, samples_per_problem=8, temperature=1.0),
    }


def tutorial_02(lab: Lab, seed: int) -> dict:
    """02-grpo-live-plots: SFT warm-up, then 30 GRPO steps (8 prompts x 16, lr 1.5e-3) as the notebook's
    `rl_step`; the held-out evaluation before and after RL; the per-step rewards."""
    run = lab.lease(f"grpo-{seed}", group="trainer-group", rank=32, seed=seed)
    task = Copy(length=3, alphabet="ABCD")
    warmup = sft_train(run.training, task, steps=80, batch_size=16, learning_rate=3e-3, target_loss=0.8, progress=False)
    held_out = task.problems(EVAL_PROBLEMS, seed=EVAL_SEED, split="eval")
    before = evaluate_02(run, task, held_out)
    tokenizer = run.tokenizer()

    def rl_step(step: int) -> dict:
        sampler = run.training.save_weights_and_get_sampling_client().result()
        requests = []
        for i, problem in enumerate(task.problems(PROMPTS, seed=step)):
            prompt = tokenizer.encode(problem.prompt, add_special_tokens=False)
            params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=1000 * step + i)
            requests.append((problem, prompt, sampler.sample(types.ModelInput.from_ints(prompt), GROUP, params)))
        data, rewards, shaped_all, completion_tokens = [], [], [], 0
        for problem, prompt, future in requests:
            seqs = future.result().sequences
            texts = [tokenizer.decode(s.tokens[:-1] if s.stop_reason == "stop" else s.tokens) for s in seqs]
            rewards += [task.reward(problem, t) for t in texts]
            shaped = [task.shaped_reward(problem, t) for t in texts]
            shaped_all += shaped
            for seq, advantage in zip(seqs, group_advantages(shaped)):
                if advantage == 0.0:
                    continue
                n = len(prompt) - 1
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": prompt[1:] + seq.tokens,
                            "logprobs": [0.0] * n + list(seq.logprobs),
                            "advantages": [0.0] * n + [advantage] * len(seq.tokens),
                        },
                    )
                )
                completion_tokens += len(seq.tokens)
        loss = float("nan")
        if data:
            fb = run.training.forward_backward(data, "importance_sampling")
            opt = run.training.optim_step(types.AdamParams(learning_rate=LR_02))
            loss = fb.result().metrics["loss:sum"] / completion_tokens
            opt.result()
        return {"reward": float(np.mean(rewards)), "shaped": float(np.mean(shaped_all)), "loss": loss}

    t0 = time.perf_counter()
    rows = [rl_step(step) for step in range(STEPS)]
    rl_s = time.perf_counter() - t0
    after = evaluate_02(run, task, held_out)
    lab.release(run.name)
    reward = [r["reward"] for r in rows]
    first, last = float(np.mean(reward[:10])), float(np.mean(reward[-10:]))
    gain = after["sampled"] - before["sampled"]
    return {
        "stat": gain,
        "ok": gain > CHECK_02_MIN_GAIN,
        "old_stat": last - first,
        "old_ok": last > first,
        "first10": first,
        "last10": last,
        "before": before,
        "after": after,
        "warmup_steps": len(warmup),
        "rl_s": rl_s,
        "reward": reward,
        "shaped": [r["shaped"] for r in rows],
        "loss": [r["loss"] for r in rows],
    }


CHECK_02_MIN_GAIN = 0.0  # the notebook's check: held-out sampled reward after RL > before + this

# ---------------------------------------------------------------------------------------------- 03


def tutorial_03(lab: Lab, seed: int) -> dict:
    """03-time-slicing: two leases (seeds seed, seed + 1), 8 steps each from two threads; the device changed
    hands at least 3 times among their forward_backward / optim_step slices."""
    a = lab.lease(f"slice-a-{seed}", group="trainer-group", rank=8, seed=seed)
    b = lab.lease(f"slice-b-{seed}", group="trainer-group", rank=8, seed=seed + 1)
    tokenizer = a.tokenizer()
    tokens = tokenizer.encode("Time slicing shares one accelerator between jobs.", add_special_tokens=False)
    batch = [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    ]

    def train(run, steps: int, losses: list) -> None:
        for step in range(steps):
            fb = run.training.forward_backward(batch, "cross_entropy")
            opt = run.training.optim_step(types.AdamParams(learning_rate=3e-3))
            losses.append(fb.result().metrics["loss:sum"] / batch[0].model_input.length)
            opt.result()
            run.log(step, loss=losses[-1])

    started = time.time()
    losses = {a.name: [], b.name: []}
    threads = [threading.Thread(target=train, args=(run, 8, losses[run.name])) for run in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a.flush()
    b.flush()
    slices = lab.timeline("default", since_s=300)
    ours = slices[(slices["requested_at"] >= started) & slices["kind"].isin(["forward_backward", "optim_step"])]
    ours = ours.sort_values("granted_at")
    jobs = ours["lease_ref"].tolist()
    switches = sum(1 for x, y in itertools.pairwise(jobs) if x != y)
    lab.release(a.name)
    lab.release(b.name)
    ok = ours["lease_ref"].nunique() == 2 and len(ours) >= 32 and switches >= 3
    return {"stat": switches, "ok": bool(ok), "slices": len(ours), "steps": [len(v) for v in losses.values()]}


# ---------------------------------------------------------------------------------------------- 04


def tutorial_04(lab: Lab, seed: int) -> dict:
    """04-tinker-sdk: the plain SDK, LoRA rank 8, 25 steps on four prompt -> completion pairs (lr 5e-3); the
    last loss below three quarters of the first."""
    training = lab.service.create_lora_training_client(
        base_model="openrl-lab/tiny-llama-1m", rank=8, seed=seed
    ).result()
    tokenizer = training.get_tokenizer()
    pairs = [("2+2=", "4"), ("3+4=", "7"), ("5+1=", "6"), ("1+1=", "2")]

    def datum(prompt: str, completion: str) -> types.Datum:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        c = [*tokenizer.encode(completion, add_special_tokens=False), tokenizer.eos_token_id]
        tokens = p + c
        weights = [0.0] * (len(p) - 1) + [1.0] * len(c)
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
        )

    batch = [datum(p, c) for p, c in pairs]
    n_completion = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
    losses = []
    for _ in range(25):
        fb = training.forward_backward(batch, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"] / n_completion)
        opt.result()
    ratio = losses[-1] / losses[0]
    return {"stat": ratio, "ok": ratio < 0.75, "losses": losses}


# ---------------------------------------------------------------------------------------------- 05


def tutorial_05(lab: Lab, seed: int) -> dict:
    """05-checkpoints-and-resume: 10 steps, save, attach from a fresh connection, 10 more; the first loss after
    the attach and the loss of the weights restored from the checkpoint equal the loss at the save (relative
    1e-4), and the last loss is below the first. The statistic: the larger of the two relative differences."""
    name = f"resume-demo-{seed}"
    run = lab.lease(name, group="trainer-group", rank=8, seed=seed)
    tokenizer = run.tokenizer()
    tokens = tokenizer.encode("Checkpoints make long runs safe to interrupt.", add_special_tokens=False)
    batch = [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    ]
    n_tokens = len(tokens) - 1

    def train(run, first_step: int, steps: int) -> list[float]:
        losses = []
        for step in range(first_step, first_step + steps):
            fb = run.training.forward_backward(batch, "cross_entropy")
            opt = run.training.optim_step(types.AdamParams(learning_rate=3e-3))
            losses.append(fb.result().metrics["loss:sum"] / n_tokens)
            opt.result()
            run.log(step, loss=losses[-1])
        return losses

    before = train(run, 0, 10)
    path = run.save("after-10-steps")
    loss_at_save = run.training.forward(batch, "cross_entropy").result().metrics["loss:sum"] / n_tokens
    run.flush()
    other = Lab.connect(lab.base_url, api_key=lab.connection.api_key)  # the "restarted" notebook's connection
    run = other.attach(name)
    history = run.history()
    history_ok = list(history["step"]) == list(range(10)) and abs(history["loss"].iloc[-1] - before[-1]) < 1e-9
    after = train(run, 10, 10)
    restored = other.service.create_training_client_from_state_with_optimizer(path).result()
    loss_restored = restored.forward(batch, "cross_entropy").result().metrics["loss:sum"] / n_tokens
    scale = max(1.0, loss_at_save)
    dev = max(abs(after[0] - loss_at_save), abs(loss_restored - loss_at_save)) / scale
    other.release(name)
    other.close()
    ok = history_ok and run.checkpoint == path and dev < 1e-4 and after[-1] < before[0]
    return {"stat": dev, "ok": bool(ok), "after_last_over_first": after[-1] / before[0]}


# ---------------------------------------------------------------------------------------------- 06


def tutorial_06(lab: Lab, seed: int) -> dict:
    """06-own-model-code: the notebook's own torch model trained in phases while another job's phases evict and
    restore it; its losses equal a solo run's exactly. Here in this process, torch threads as the setting."""
    import torch

    from openrl_lab.lab.resident import ResidentState

    def make_model(s):
        torch.manual_seed(s)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 16, generator=g)
        return x, x[:, :4].sin()

    def train_step(model, optimizer, step):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    model, optimizer = make_model(seed)
    mine = ResidentState(lab.orchestrator, "trainer-group", f"tutorial-06-{seed}", announce=None)
    mine.register(model, optimizer, names=["model", "optimizer"])
    other = ResidentState(lab.orchestrator, "trainer-group", f"other-notebook-{seed}", announce=None)
    other_model, other_optimizer = make_model(seed + 1)
    other.register(other_model, other_optimizer, names=["model", "optimizer"])

    def other_notebook(phases=4):
        for i in range(phases):
            with other.phase():
                train_step(other_model, other_optimizer, 100 + i)
                time.sleep(0.4)
            time.sleep(0.2)

    losses = []
    for step in range(2):
        with mine.phase():
            losses.append(train_step(model, optimizer, step))
    t = threading.Thread(target=other_notebook, daemon=True)
    t.start()
    time.sleep(0.2)
    for step in range(2, 5):
        with mine.phase():
            losses.append(train_step(model, optimizer, step))
    t.join()
    evictions = len(mine.evictions)
    mine.close()
    other.close()
    solo_model, solo_optimizer = make_model(seed)
    solo = [train_step(solo_model, solo_optimizer, i) for i in range(len(losses))]
    diff = max(abs(x - y) for x, y in zip(losses, solo))
    return {"stat": diff, "ok": losses == solo, "evictions": evictions}


TUTORIALS = {
    "01": ("01-quickstart: loss halves in 30 steps (ratio last/first)", tutorial_01),
    "02": ("02-grpo-live-plots: held-out sampled reward, after minus before RL", tutorial_02),
    "03": ("03-time-slicing: hand-offs among 32 slices", tutorial_03),
    "04": ("04-tinker-sdk: last loss < 3/4 of the first, 25 steps (ratio)", tutorial_04),
    "05": ("05-checkpoints-and-resume: relative difference at resume", tutorial_05),
    "06": ("06-own-model-code: max |loss - solo loss|", tutorial_06),
}


def fmt(x) -> str:
    if isinstance(x, int):
        return str(x)
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"


def spread(stats: list) -> str:
    """min / median / max, each as fmt writes it."""
    return f"{fmt(min(stats))} / {fmt(statistics.median(stats))} / {fmt(max(stats))}"


def table(results: dict, threads: list[int]) -> str:
    lines = [
        "| tutorial: statistic | "
        + " | ".join(f"{t} thread{'s' if t > 1 else ''}: passes, min / median / max" for t in threads)
        + " |",
        "|---|" + "---|" * len(threads),
    ]
    for key, (title, _) in TUTORIALS.items():
        if key not in results:
            continue
        cells = []
        for t in threads:
            runs = results[key].get(str(t), [])
            if not runs:
                cells.append("-")
                continue
            stats = [r["stat"] for r in runs]
            passes = sum(r["ok"] for r in runs)
            cells.append(f"{passes}/{len(runs)}, {spread(stats)}")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    if "02" in results:  # the old check beside the new one
        cells = []
        for t in threads:
            runs = results["02"].get(str(t), [])
            stats = [r["old_stat"] for r in runs]
            cells.append(f"{sum(r['old_ok'] for r in runs)}/{len(runs)}, {spread(stats)}" if runs else "-")
        old = "*02, the old check: last-10 minus first-10 mean train reward > 0*"
        lines.append(f"| {old} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tutorials", default="02,03,01,04,05,06")
    p.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--threads", default="1,2", help="kernel torch threads ($OPENRL_KERNEL_THREADS), comma-separated")
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    keys = [k.strip() for k in args.tutorials.split(",") if k.strip()]
    threads = [int(t) for t in args.threads.split(",")]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    results: dict = {k: {} for k in keys}
    started = time.perf_counter()
    total, done = len(keys) * len(threads) * len(seeds), 0
    for t in threads:
        import torch

        torch.set_num_threads(t)  # tutorial 06 trains in this process
        with tempfile.TemporaryDirectory(prefix="openrl-tutorial-checks-") as tmp:
            os.environ.setdefault("HF_HOME", str(Path(tmp) / "hf"))
            server = LabServer(Path(tmp) / "lab", env={"OPENRL_KERNEL_THREADS": str(t)}).start()
            try:
                lab = Lab.connect(server.base_url, api_key=server.api_key)
                for key in keys:
                    fn = TUTORIALS[key][1]
                    runs = results[key].setdefault(str(t), [])
                    for seed in seeds:
                        t0 = time.perf_counter()
                        r = fn(lab, seed)
                        r.update(seed=seed, threads=t, seconds=time.perf_counter() - t0)
                        runs.append(r)
                        done += 1
                        extra = ""
                        if key == "02":
                            extra = (
                                f" greedy {r['before']['greedy']:.3f}->{r['after']['greedy']:.3f}"
                                f" sampled {r['before']['sampled']:.3f}->{r['after']['sampled']:.3f}"
                                f" train first10 {r['first10']:.3f} last10 {r['last10']:.3f} (RL {r['rl_s']:.0f} s)"
                            )
                        print(
                            f"[{done}/{total} {time.perf_counter() - started:.0f}s] {key} threads={t} seed={seed}: "
                            f"{'pass' if r['ok'] else 'FAIL'} stat={fmt(r['stat'])}{extra} ({r['seconds']:.0f} s)",
                            flush=True,
                        )
                        if args.json:
                            args.json.write_text(json.dumps(results, indent=1) + "\n")
                lab.close()
                logs = sorted((Path(tmp) / "lab" / "logs").glob("kernel-*.log"))
                said = {line.strip() for f in logs for line in f.read_text().splitlines() if "torch thread" in line}
                print(f"kernel threads (from its log): {', '.join(sorted(said)) or '?'}", flush=True)
            finally:
                server.stop()
    out = table(results, threads)
    print(out)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.markdown:
        args.markdown.write_text(out + "\n")
    return 0 if all(r["ok"] for k in results.values() for runs in k.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
