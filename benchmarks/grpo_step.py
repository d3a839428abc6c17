"""One GRPO step as `RLConfig()` runs it (16 prompts x 8 samples) through the lab vs the same arithmetic in-process.

    .venv/bin/python benchmarks/grpo_step.py [--steps 6] [--rounds 3] [--baseline-tree DIR]

*lab*: `openrl_lab.recipes.rl_train` through the tinker SDK against `openrl-lab serve` (no flags) on the built-in
model: per step a sampler snapshot, 16 sample requests of 8 samples, rewards, advantages, one importance_sampling
forward_backward and one optim_step (LoRA rank 32). The figures are the recipe's own `sample_s` and `train_s`
(medians over the steps of every round but each round's first).

Both sides start from the same short supervised warm-up (SFT_STEPS of `sft_train`), so that groups have reward
spread and every step trains. *in-process*: what a researcher would write with plain transformers + PEFT in one
process, on the same model, the same LoRA settings (the lab's own `LoraConfig`) and AdamW settings: all 128 rows
sampled in one left-padded `generate` (temperature 1, logprobs from its scores), the same rewards and advantages,
one padded forward and backward of the same loss, one AdamW step. torch's default threads.

`--baseline-tree DIR`: also time the lab from another checkout (e.g. `git worktree add /tmp/before de170dd`, the
last commit before issue 27's batching): its `openrl-lab serve` runs with that tree first on PYTHONPATH, and
this checkout's recipe drives it (the SDK calls are the same).

Rounds alternate the sides; ratios are of medians within the run: efficiency = in-process / lab step time
(goal >= 0.8), speed-up = baseline / lab (goal >= 2.5).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker
from tqdm import tqdm

from openrl_lab.home import DEFAULT_MODEL
from openrl_lab.recipes import RLConfig, rl_train, sft_train
from openrl_lab.recipes.rl import group_advantages, learning_rate_at, step_problems
from openrl_lab.recipes.sft import sft_datum, sft_problems
from openrl_lab.recipes.tasks import TASKS, checked_reward, default_max_tokens
from openrl_lab.server import LabServer
from openrl_lab.train.models import resolve_model_dir

RANK = 32
# A short supervised warm-up on both sides first (the demo's recipe, `sft_train`'s defaults but a fixed step
# count): from the bare base model nearly every group's rewards are equal (all 0), and the recipe then skips
# training, which would time sampling alone.
SFT_STEPS = 20
SFT_LR = 3e-3


class InProcess:
    """The GRPO step written directly on transformers + PEFT (no lab), as a baseline."""

    def __init__(self, home: Path, task, config: RLConfig):
        import torch
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from openrl_lab.train.trainer import ATTN_MODULES, MLP_MODULES, UNEMBED_MODULES, _lora_config

        model_dir = resolve_model_dir(DEFAULT_MODEL, home)
        self.torch, self.task, self.config = torch, task, config
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        torch.manual_seed(config.seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        targets = [*ATTN_MODULES, *MLP_MODULES, *UNEMBED_MODULES]
        self.model = get_peft_model(base, _lora_config(RANK, targets))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=config.learning_rate, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.eos = self.tok.eos_token_id
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos
        for step in range(1, SFT_STEPS + 1):
            self._sft_step(step)

    def _sft_step(self, step: int) -> None:
        """`sft_train`'s step: the same problems and tokens, cross-entropy on the answer tokens, one AdamW step."""
        torch = self.torch
        data = [sft_datum(self.tok, p) for p in sft_problems(self.task, 16, self.config.seed, step)]
        rows = [
            (d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist(), d.loss_fn_inputs["weights"].tolist())
            for d in data
        ]
        length = max(len(r[0]) for r in rows)
        inp = torch.tensor([r[0] + [self.pad] * (length - len(r[0])) for r in rows])
        att = torch.tensor([[1] * len(r[0]) + [0] * (length - len(r[0])) for r in rows])
        tgt = torch.tensor([r[1] + [self.pad] * (length - len(r[1])) for r in rows])
        w = torch.tensor([r[2] + [0.0] * (length - len(r[2])) for r in rows])
        for group in self.opt.param_groups:
            group["lr"] = SFT_LR
        self.model.train()
        logp = self.model(input_ids=inp, attention_mask=att).logits.float().log_softmax(-1)
        (-(logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) * w).sum()).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, step: int) -> tuple[float, float]:
        """(seconds sampling and scoring, seconds training)."""
        torch, cfg = self.torch, self.config
        t0 = time.perf_counter()
        problems = step_problems(self.task, cfg, step)
        prompts = [self.tok.encode(p.prompt, add_special_tokens=False) for p in problems]
        rows = [p for p in prompts for _ in range(cfg.group_size)]
        width = max(len(p) for p in rows)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in rows])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=cfg.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=cfg.max_tokens,
                eos_token_id=self.eos,
                pad_token_id=self.pad,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[:, width:]
        scores = torch.stack(out.scores, dim=1).log_softmax(-1)
        sampled_lp = scores.gather(-1, new.unsqueeze(-1)).squeeze(-1)
        completions = []
        for r in range(len(rows)):
            toks = new[r].tolist()
            n = toks.index(self.eos) + 1 if self.eos in toks else len(toks)
            completions.append((toks[:n], sampled_lp[r, :n].tolist()))
        # rewards and advantages, as the recipe computes them
        data = []
        for i, problem in enumerate(problems):
            group = completions[i * cfg.group_size : (i + 1) * cfg.group_size]
            shaped = [
                checked_reward(
                    self.task, problem, self.tok.decode(t[:-1] if t and t[-1] == self.eos else t), shaped=True
                )
                for t, _ in group
            ]
            adv = group_advantages(shaped, cfg.advantage_eps)
            if any(a != 0.0 for a in adv):
                data += [(prompts[i], t, lp, a) for (t, lp), a in zip(group, adv) if t]
        t_sampled = time.perf_counter()
        if data:
            self.model.train()
            seqs = [p + t for p, t, _, _ in data]
            length = max(len(s) for s in seqs) - 1
            inp = torch.tensor([s[:-1] + [self.pad] * (length - len(s) + 1) for s in seqs])
            att = torch.tensor([[1] * (len(s) - 1) + [0] * (length - len(s) + 1) for s in seqs])
            tgt = torch.tensor([s[1:] + [self.pad] * (length - len(s) + 1) for s in seqs])
            old = torch.zeros(len(seqs), length)
            adv = torch.zeros(len(seqs), length)
            for r, (p, t, lp, a) in enumerate(data):
                old[r, len(p) - 1 : len(p) - 1 + len(t)] = torch.tensor(lp)
                adv[r, len(p) - 1 : len(p) - 1 + len(t)] = a
            for group in self.opt.param_groups:
                group["lr"] = learning_rate_at(cfg, step)
            logits = self.model(input_ids=inp, attention_mask=att).logits.float()
            logp = logits.log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
            loss = (-torch.exp(logp - old) * adv * (adv != 0)).sum()
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return t_sampled - t0, time.perf_counter() - t_sampled


def lab_steps(lab: LabServer, task, config: RLConfig) -> list[tuple[float, float]]:
    service = tinker.ServiceClient(base_url=lab.base_url, api_key=lab.api_key)
    try:
        trainer = service.create_lora_training_client(base_model=DEFAULT_MODEL, rank=RANK, seed=config.seed).result()
        sft_train(trainer, task, steps=SFT_STEPS, learning_rate=SFT_LR, seed=config.seed, progress=False)
        result = rl_train(service, trainer, task, config, progress=False)
        return list(zip(result.metrics["sample_s"], result.metrics["train_s"]))
    finally:
        service.close("success").result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="steps per round (the first of each is not counted)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--task", default="copy")
    ap.add_argument("--baseline-tree", type=Path, default=None)
    args = ap.parse_args()
    task = TASKS[args.task]()
    config = RLConfig(steps=args.steps, save_every=0)
    config = replace(config, max_tokens=default_max_tokens(task))
    home = Path(tempfile.mkdtemp(prefix="openrl-grpo-"))
    labs = {"lab": LabServer(home)}
    if args.baseline_tree is not None:
        tree = args.baseline_tree.resolve()
        labs["baseline"] = LabServer(
            Path(tempfile.mkdtemp(prefix="openrl-grpo-base-")),
            # PYTHONSAFEPATH: `python -m` would otherwise put the working directory (this checkout) first
            env={"PYTHONPATH": str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONSAFEPATH": "1"},
        )
    print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; task {task.name}, "
        f"{config.prompts_per_step} prompts x {config.group_size} samples, max_tokens {config.max_tokens}"
    )
    times: dict[str, list[tuple[float, float]]] = {"in-process": [], **{name: [] for name in labs}}
    try:
        for lab in labs.values():
            lab.start()
        local = InProcess(home, task, config)
        local.step(1)  # warm-up
        for _ in tqdm(range(args.rounds), desc="rounds", unit="round"):
            times["in-process"] += [local.step(s) for s in range(2, args.steps + 1)]
            for name, lab in labs.items():
                times[name] += lab_steps(lab, task, config)[1:]
    finally:
        for lab in labs.values():
            lab.stop()
    m = {
        k: [statistics.median(part) for part in zip(*v)] + [statistics.median(a + b for a, b in v)]
        for k, v in times.items()
    }
    print(f"load average at the end: {os.getloadavg()[0]:.2f}\n")
    print("| side | s per GRPO step (median) | sampling + scoring s | training s | in-process / side |")
    print("|---|---|---|---|---|")
    for name, (sample_s, train_s, step_s) in m.items():
        print(f"| {name} | {step_s:.3f} | {sample_s:.3f} | {train_s:.3f} | {m['in-process'][2] / step_s:.2f} |")
    if "baseline" in m:
        print(f"\nspeed-up of this lab over the baseline tree: {m['baseline'][2] / m['lab'][2]:.2f}x")
    print(f"samples per step: {config.prompts_per_step * config.group_size}; steps timed per side: {len(times['lab'])}")


if __name__ == "__main__":
    main()
