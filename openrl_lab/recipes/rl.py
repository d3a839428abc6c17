"""GRPO-style RL on a task with verifiable rewards, written only against the tinker SDK.

    service = tinker.ServiceClient(base_url=..., api_key=...)
    trainer = service.create_lora_training_client(base_model="openrl-lab/tiny-llama-1m", rank=32).result()
    sft_train(trainer, Copy(), steps=80, target_loss=0.8)   # a short warm-up teaches the format
    result = rl_train(service, trainer, Copy(), RLConfig())   # 300 steps of 16 prompts x 8 samples
    result.metrics                      # one row per step: reward, loss, KL, entropy, timings (pandas)

One step, top to bottom:
  1. take a fresh sampler snapshot of the current weights (`save_weights_and_get_sampling_client`);
  2. sample `group_size` completions for each of `prompts_per_step` prompts (from the task's "train"
     split: evaluation prompts are never trained on), score each with the task;
  3. advantages within each group: (reward - group mean) / (group std + eps); a group whose rewards are
     all equal teaches nothing and is left out; a step in which no group had reward spread (or no group
     came back) trains nothing: it is *skipped* (`skipped` True in its metrics row, loss and KL missing,
     "loss=skipped" in the progress bar, counted in the summary);
  4. one `forward_backward` with the `importance_sampling` (or `ppo`) loss, fed the sampler's logprobs,
     then one `optim_step`;
  5. every `save_every` steps, `save_state`: if the server restarts and the model is gone, the loop
     reloads the last saved state (with its optimizer) and carries on from that step.

With `overlap=True` the samples for step k+1 are requested before step k's training results are awaited,
from the sampler of step k (one step behind the learner, never more): sampling and training overlap, and
the importance ratio in the loss corrects for the lag.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
import tinker
from tinker import types

from openrl_lab.collapse import COLLAPSE_METRIC, CollapseWarning, CollapseWatch
from openrl_lab.recipes.tasks import Problem, Task, checked_reward, default_max_tokens


class EmptyGroupWarning(UserWarning):
    """A prompt's group came back with no usable samples (sampling failed or returned none); it was skipped."""


@dataclass
class RLConfig:
    """Defaults: what teaches the built-in tiny-llama-1m (LoRA rank 32, after `sft_train`'s warm-up) short
    verifiable tasks it was not tuned on, within 5 minutes on a 2-core CPU (issue 14; docs/benchmarks.md, "RL on
    tasks it was not tuned for"). A low learning rate decaying to 0 keeps the policy from collapsing onto wrong
    answers (entropy stays above ~0.05); many prompts with fewer samples each see more of the task per step.

    The anti-collapse options (issue 49; what each does and what it measured: docs/recipes.md, "Against
    collapse"), all off here: `kl_coef` (a KL penalty to the policy RL started from), `lr_warmup_steps`,
    `advantage_norm` ("std" as GRPO, "mean" as Dr. GRPO), `resample_rounds` (DAPO's dynamic sampling: groups
    without reward spread are replaced by fresh prompts). The KL penalty keeps `make demo`'s faster settings from
    collapsing, but frozen on here (with a warm-up) it cost held-out reward on tasks nobody tuned it on, so it is
    not a default (docs/recipes.md). The loss already sums over tokens (DAPO's token-level normalisation, up to a
    constant that Adam absorbs), and a clip (`loss_fn="ppo"`, DAPO's clip-higher through `loss_fn_config`) only
    engages off-policy (`overlap=True`): on-policy the ratio is 1."""

    steps: int = 300
    prompts_per_step: int = 16
    group_size: int = 8
    max_tokens: int | None = None  # None: default_max_tokens(task), room for the task's longest answer + </s>
    temperature: float = 1.0
    learning_rate: float = 5e-4
    lr_schedule: str = "linear"  # decays to 0 over `steps` (a constant lr collapses the policy); or "constant"
    lr_warmup_steps: int = 0  # the lr rises linearly from lr/N to the schedule's value over the first N steps
    loss_fn: str = "importance_sampling"  # or "ppo" (clipped ratio)
    loss_fn_config: dict | None = None  # e.g. {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2} for ppo
    advantage_eps: float = 1e-6
    advantage_norm: str = "std"  # "std": (r - mean) / (std + eps) per group; "mean": r - mean (Dr. GRPO)
    kl_coef: float = 0.0  # penalty per token on log(policy / reference), reference = the policy at RL's start
    resample_rounds: int = 0  # up to N more sampling rounds a step, replacing groups that had no reward spread
    overlap: bool = False  # sample step k+1 while step k trains (off-policy by one step)
    save_every: int = 10  # save_state every N steps (and before the first); 0 = never (no resume)
    max_resumes: int = 3
    seed: int = 0
    name: str = "rl"  # checkpoint names: f"{name}-step-00010"

    def __post_init__(self) -> None:
        if self.advantage_norm not in ADVANTAGE_NORMS:
            raise ValueError(f"advantage_norm must be one of {', '.join(ADVANTAGE_NORMS)}, not {self.advantage_norm!r}")
        for name in ("lr_warmup_steps", "resample_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, not {self.kl_coef}")


ADVANTAGE_NORMS = ("std", "mean")


@dataclass
class Rollout:
    problem: Problem
    prompt_tokens: list[int]
    tokens: list[int]  # the completion, with its end-of-sequence token when it stopped
    logprobs: list[float]  # the sampler's logprob of each completion token
    stopped: bool
    text: str  # the completion decoded, without the end-of-sequence token
    reward: float  # the task's verifiable reward, in [0, 1]
    shaped: float  # what the advantages are computed from (partial credit)


@dataclass
class RLResult:
    training_client: tinker.TrainingClient  # the live one (a new one after a resume)
    metrics: pd.DataFrame
    checkpoints: list[str] = field(default_factory=list)  # save_state paths, oldest first
    resumes: list[dict] = field(default_factory=list)  # {"at_step", "from_step", "path"} per resume


class _ModelGone(Exception):
    """The server no longer holds our model or sampler (it restarted): resume from the last save_state."""


# --------------------------------------------------------------------------------------------- pieces


def group_advantages(rewards: list[float], eps: float = 1e-6, norm: str = "std") -> list[float]:
    """Mean-centred within one group and, with norm="std" (GRPO), divided by (std + eps); norm="mean" (Dr. GRPO)
    keeps the scale of the rewards, so a group with little spread moves the policy little. All zeros when the
    rewards are all equal."""
    r = np.asarray(rewards, dtype=np.float64)
    if len(r) == 0 or np.allclose(r, r[0]):
        return [0.0] * len(r)
    centred = r - r.mean()
    return (centred / (r.std() + eps) if norm == "std" else centred).tolist()


def rl_datum(rollout: Rollout, advantage: float | list[float]) -> types.Datum:
    """Prompt + completion; the loss sees the sampler's logprobs and the advantage on completion tokens only
    (one advantage for every token, or one per completion token)."""
    p, c = rollout.prompt_tokens, rollout.tokens
    per_token = [advantage] * len(c) if isinstance(advantage, float | int) else list(advantage)
    tokens = p + c
    n_prompt = len(p) - 1  # position i scores token i + 1, so the first completion token sits at len(p) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt + list(rollout.logprobs),
            "advantages": [0.0] * n_prompt + per_token,
        },
    )


def _is_gone(exc: BaseException) -> bool:
    """The server answers 404 for a model (or a sampler snapshot) created in a kernel that has since restarted."""
    return isinstance(exc, (_ModelGone, tinker.NotFoundError))


def submit_rollouts(
    sampling_client, tokenizer, problems: list[Problem], config: RLConfig, step: int, first: int = 0
) -> list:
    """Ask for `group_size` samples per problem; returns (problem, prompt tokens, future) per problem. `first`
    numbers the problems on from there (a resampling round's), so that no two groups of a step share a seed."""
    pending = []
    for i, problem in enumerate(problems, start=first):
        prompt = tokenizer.encode(problem.prompt, add_special_tokens=False)
        params = types.SamplingParams(
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            seed=config.seed * 1_000_003 + step * 1_009 + i,
        )
        future = sampling_client.sample(
            types.ModelInput.from_ints(prompt), num_samples=config.group_size, sampling_params=params
        )
        pending.append((problem, prompt, future))
    return pending


def collect_group(task: Task, tokenizer, problem: Problem, prompt: list[int], future, step: int) -> list[Rollout]:
    """Await one group and score it; a group that failed or came back empty is skipped with a warning."""
    try:
        response = future.result()
    except Exception as exc:
        if _is_gone(exc):
            raise _ModelGone(str(exc)) from exc
        warnings.warn(
            EmptyGroupWarning(
                f"step {step}: task {task.name!r}, prompt {problem.prompt!r}: sampling failed "
                f"({type(exc).__name__}: {exc}); group skipped"
            ),
            stacklevel=2,
        )
        return []
    group = []
    for seq in response.sequences:
        tokens = list(seq.tokens)
        if not tokens:
            continue
        if seq.logprobs is None or len(seq.logprobs) != len(tokens):
            raise ValueError(
                f"step {step}: the server returned no logprobs (or the wrong number) for the sampled "
                "tokens; the RL losses need the sampler's logprob of every sampled token"
            )
        stopped = seq.stop_reason == "stop"
        text = tokenizer.decode(tokens[:-1] if stopped else tokens)
        group.append(
            Rollout(
                problem,
                prompt,
                tokens,
                list(seq.logprobs),
                stopped,
                text,
                reward=checked_reward(task, problem, text),
                shaped=checked_reward(task, problem, text, shaped=True),
            )
        )
    if not group:
        warnings.warn(
            EmptyGroupWarning(
                f"step {step}: task {task.name!r}, prompt {problem.prompt!r}: the sampler returned no samples; "
                "group skipped"
            ),
            stacklevel=2,
        )
    return group


def learning_rate_at(config: RLConfig, step: int) -> float:
    """The schedule's lr at a step (1-based), times the warm-up's ramp (step / lr_warmup_steps) while it lasts."""
    warmup = min(1.0, step / config.lr_warmup_steps) if config.lr_warmup_steps else 1.0
    if config.lr_schedule == "linear":
        return warmup * config.learning_rate * (1 - (step - 1) / config.steps)
    if config.lr_schedule != "constant":
        raise ValueError(f"lr_schedule must be 'constant' or 'linear', not {config.lr_schedule!r}")
    return warmup * config.learning_rate


def step_problems(task: Task, config: RLConfig, step: int, round: int = 0) -> list[Problem]:
    """The prompts of one step, from the task's "train" split only (fixed by seed and step, so a resumed step
    sees the same prompts); round r > 0 draws the prompts of the step's r-th resampling round."""
    seed = config.seed * 100_003 + step + round * 7_919_993
    return task.problems(config.prompts_per_step, seed=seed, split="train")


def evaluate(
    sampling_client,
    tokenizer,
    task: Task,
    problems: list[Problem],
    samples_per_problem: int = 4,
    temperature: float = 1.0,
    max_tokens: int | None = None,
    seed: int = 12345,
) -> float:
    """Mean task reward of `sampling_client` over `problems` (`samples_per_problem` samples each). For a
    held-out figure, pass problems of the task's eval split: `task.problems(n, seed, split="eval")`."""
    config = RLConfig(
        group_size=samples_per_problem,
        temperature=temperature,
        max_tokens=max_tokens or default_max_tokens(task),
        seed=seed,
    )
    pending = submit_rollouts(sampling_client, tokenizer, problems, config, step=0)
    rewards = [r.reward for p, t, f in pending for r in collect_group(task, tokenizer, p, t, f, step=0)]
    return float(np.mean(rewards)) if rewards else float("nan")


# ------------------------------------------------------------------------------------------- the loop


def rl_train(
    service_client: tinker.ServiceClient,
    training_client: tinker.TrainingClient,
    task: Task,
    config: RLConfig | None = None,
    on_step: Callable[[int, dict], None] | None = None,
    progress: bool = True,
    stop: Callable[[], bool] | None = None,
) -> RLResult:
    """Run `config.steps` RL steps on `task`; `on_step(step, metrics_row)` is called after each step, and
    the run ends early at a step boundary once `stop()` is true (e.g. a notebook `StopButton().should_stop`)."""
    from tqdm.auto import tqdm

    config = config or RLConfig()
    if config.max_tokens is None:
        config = replace(config, max_tokens=default_max_tokens(task))
    tokenizer = training_client.get_tokenizer()
    learning_rate_at(config, 1)  # a bad schedule name fails now, not after the first step
    rows: list[dict] = []
    checkpoints: list[tuple[int, str]] = []
    resumes: list[dict] = []
    t_start = time.perf_counter()

    def save(step: int) -> None:
        path = training_client.save_state(f"{config.name}-step-{step:05d}").result().path
        checkpoints.append((step, path))

    watch, onset = CollapseWatch(), 0  # onset: the step the collapse in progress began at
    reference_path = _reference_state(training_client, config)
    reference = _reference_client(service_client, reference_path)
    if config.save_every:
        save(0)
    step, pending = 1, None
    with tqdm(total=config.steps, desc=f"rl {task.name}", unit="step", disable=not progress) as bar:
        while step <= config.steps:
            try:
                t0 = time.perf_counter()
                # 1. a sampler snapshot of the current weights; this step's samples (unless asked for earlier)
                sampler = training_client.save_weights_and_get_sampling_client().result()
                if pending is None:
                    pending = submit_rollouts(sampler, tokenizer, step_problems(task, config, step), config, step)
                # 2. await the samples and score them
                groups = [collect_group(task, tokenizer, p, prompt, f, step) for p, prompt, f in pending]
                rollouts = [r for g in groups for r in g]  # the step's reward: its first round's samples
                # 3. advantages within each group; groups with no spread are left out and, with resample_rounds,
                #    replaced by groups of fresh prompts (dynamic sampling), up to prompts_per_step groups in all
                taught = _groups_with_spread(groups, config)
                rounds = 0
                while len(taught) < config.prompts_per_step and rounds < config.resample_rounds:
                    rounds += 1
                    extra = step_problems(task, config, step, rounds)[: config.prompts_per_step - len(taught)]
                    more = submit_rollouts(
                        sampler, tokenizer, extra, config, step, first=rounds * config.prompts_per_step
                    )
                    taught += _groups_with_spread(
                        [collect_group(task, tokenizer, p, prompt, f, step) for p, prompt, f in more], config
                    )
                taught = taught[: config.prompts_per_step]
                used = [r for g, _ in taught for r in g]
                advantages = [a for _, adv in taught for a in adv]
                ref_kl = float("nan")
                if used and config.kl_coef:
                    advantages, ref_kl = _kl_penalised(reference, used, advantages, config.kl_coef)
                data = [rl_datum(r, a) for r, a in zip(used, advantages)]
                t_sampled = time.perf_counter()
                # 4. train on them; with overlap, first ask for the next step's samples from this step's
                #    (pre-update) sampler: they will be one step behind the learner, never more
                fb = opt = None
                if data:
                    fb = training_client.forward_backward(data, config.loss_fn, config.loss_fn_config)
                    adam = types.AdamParams(learning_rate=learning_rate_at(config, step))
                    opt = training_client.optim_step(adam)
                pending = None
                if config.overlap and step < config.steps:
                    next_problems = step_problems(task, config, step + 1)
                    pending = submit_rollouts(sampler, tokenizer, next_problems, config, step + 1)
                loss = kl = mismatch_kl = mismatch_max = float("nan")
                if fb is not None:
                    out = fb.result()
                    assert opt is not None  # asked with fb
                    opt.result()
                    loss = out.metrics["loss:sum"] / sum(len(r.tokens) for r in used)
                    kl = _sampler_learner_kl(used, out)
                    # this lab's own measure on the tokens trained (other Tinker servers may not send it)
                    mismatch_kl = out.metrics.get("sampler_kl:mean", float("nan"))
                    mismatch_max = out.metrics.get("sampler_logprob_diff:max", float("nan"))
                # 5. save now and then
                if config.save_every and step % config.save_every == 0:
                    save(step)
            except Exception as exc:
                if not _is_gone(exc):
                    raise
                training_client, step = _resume(service_client, config, step, checkpoints, resumes, exc)
                reference = _reference_client(service_client, reference_path)  # a new server lost the old one
                rows, pending = [r for r in rows if r["step"] < step], None
                watch = CollapseWatch()
                for r in rows:  # the watch as it was at the step resumed from
                    was = watch.collapsed
                    if watch.update(r["reward"], r["entropy"]) and not was:
                        onset = r["step"]
                bar.n = step - 1
                bar.refresh()
                continue
            t_end = time.perf_counter()
            rewards = [r.reward for r in rollouts]
            all_lp = [x for r in rollouts for x in r.logprobs]
            row = {
                "step": step,
                "reward": float(np.mean(rewards)) if rewards else float("nan"),
                "reward_std": float(np.std(rewards)) if rewards else float("nan"),
                "shaped_reward": float(np.mean([r.shaped for r in rollouts])) if rollouts else float("nan"),
                "loss": loss,  # NaN (missing) when the step was skipped: nothing was trained
                "kl": kl,
                "sampler_kl": mismatch_kl,  # KL(sampler || learner), k3, per trained token: ~0 without overlap
                "ref_kl": ref_kl,  # mean log(policy / reference) per trained token (measured only with kl_coef)
                "resample_rounds": rounds,
                "logprob_diff_max": mismatch_max,
                "skipped": not used,  # no group had reward spread (or none came back): no update this step
                "entropy": -float(np.mean(all_lp)) if all_lp else float("nan"),
                "samples": len(rollouts),
                "trained_samples": len(used),
                "lr": learning_rate_at(config, step),
                "empty_groups": sum(1 for g in groups if not g),
                "completion_len": float(np.mean([len(r.tokens) for r in rollouts])) if rollouts else float("nan"),
                "sample_s": t_sampled - t0,
                "train_s": t_end - t_sampled,
                "step_s": t_end - t0,
                "tokens_per_s": sum(len(r.prompt_tokens) + len(r.tokens) for r in rollouts) / (t_end - t0),
                "elapsed_s": t_end - t_start,
            }
            was_collapsed = watch.collapsed
            row[COLLAPSE_METRIC] = watch.update(row["reward"], row["entropy"])
            if row[COLLAPSE_METRIC] and not was_collapsed:
                onset = step
                warnings.warn(CollapseWarning(f"step {step}: the policy is collapsing: {watch.reason}"), stacklevel=2)
            rows.append(row)
            bar.update(1)
            bar.set_postfix(
                reward=f"{row['reward']:.2f}" if rewards else "none",
                loss="skipped" if row["skipped"] else f"{loss:.3f}",
                **({"COLLAPSE": f"since step {onset}"} if row[COLLAPSE_METRIC] else {}),
            )
            if on_step is not None:
                on_step(step, row)
            step += 1
            if stop is not None and stop():
                break
    return RLResult(training_client, pd.DataFrame(rows), [p for _, p in checkpoints], resumes)


def _groups_with_spread(groups: list[list[Rollout]], config: RLConfig) -> list[tuple[list[Rollout], list[float]]]:
    """(group, advantages) for each group whose shaped rewards differ; the others teach nothing."""
    out = []
    for g in groups:
        advantages = group_advantages([r.shaped for r in g], config.advantage_eps, config.advantage_norm)
        if any(a != 0.0 for a in advantages):
            out.append((g, advantages))
    return out


def _reference_state(training_client, config: RLConfig) -> str | None:
    """With a KL penalty, the weights RL starts from, saved (`save_state`: a file, so that a resume after a server
    restart finds them again): their path. None without a penalty."""
    if not config.kl_coef:
        return None
    return training_client.save_state(f"{config.name}-reference").result().path


def _reference_client(service_client, path: str | None):
    """A training client on the reference weights, only ever asked for `forward` (one batched call a step)."""
    return service_client.create_training_client_from_state(path).result() if path else None


def _kl_penalised(reference, used: list[Rollout], advantages: list[float], coef: float) -> tuple[list, float]:
    """Per-token advantages with a KL penalty to the reference policy folded in, as tinker-cookbook does:
    A_t - coef * (d_t - mean d), d_t = log p_sampler(t) - log p_reference(t) over the trained tokens (centred, so
    the penalty moves probability between tokens without shifting the batch's mean advantage). Returns them and
    the mean d, an estimate of KL(policy || reference) per token. The reference's logprobs come from one `forward`
    of the batch (cross-entropy: it returns every target token's logprob)."""
    batch = [
        types.Datum(
            model_input=types.ModelInput.from_ints((r.prompt_tokens + r.tokens)[:-1]),
            loss_fn_inputs={"target_tokens": (r.prompt_tokens + r.tokens)[1:]},
        )
        for r in used
    ]
    out = reference.forward(batch, "cross_entropy").result()
    diffs = []
    for r, o in zip(used, out.loss_fn_outputs):
        ref = np.asarray(o["logprobs"].tolist(), dtype=np.float64)[len(r.prompt_tokens) - 1 :]
        diffs.append(np.asarray(r.logprobs, dtype=np.float64) - ref)
    mean = float(np.concatenate(diffs).mean())
    return [(a - coef * (d - mean)).tolist() for a, d in zip(advantages, diffs)], mean


def _sampler_learner_kl(used: list[Rollout], out: types.ForwardBackwardOutput) -> float:
    """Mean over completion tokens of (sampler logprob - learner logprob): ~0 on-policy."""
    diffs = []
    for r, o in zip(used, out.loss_fn_outputs):
        learner = np.asarray(o["logprobs"].tolist(), dtype=np.float64)[len(r.prompt_tokens) - 1 :]
        diffs.append(np.asarray(r.logprobs, dtype=np.float64) - learner)
    return float(np.concatenate(diffs).mean())


def _resume(service_client, config, step, checkpoints, resumes, exc):
    """The server lost our model (it restarted): reload the last saved state and redo the steps after it."""
    if not checkpoints:
        raise RuntimeError(
            f"the server no longer holds the model at step {step} and there is no save_state to "
            "resume from (set RLConfig.save_every)"
        ) from exc
    if len(resumes) >= config.max_resumes:
        raise RuntimeError(f"gave up after {len(resumes)} resumes (RLConfig.max_resumes)") from exc
    saved_step, path = checkpoints[-1]
    warnings.warn(
        f"step {step}: the server no longer holds the model ({exc}); resuming from {path} (step {saved_step})",
        stacklevel=3,
    )
    training_client = service_client.create_training_client_from_state_with_optimizer(path).result()
    resumes.append({"at_step": step, "from_step": saved_step, "path": path})
    return training_client, saved_step + 1
