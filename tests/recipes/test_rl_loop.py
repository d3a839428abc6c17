"""The SFT and RL recipes against a real server through the tinker SDK: RL raises the task reward; bad
rewards and failed groups are reported clearly; overlap keeps the sampler one step behind."""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import numpy as np
import pytest

from openrl_lab.recipes import (
    CollapseWarning,
    Copy,
    EmptyGroupWarning,
    Problem,
    RewardError,
    RLConfig,
    Task,
    collapse_onsets,
    format_summary,
    rl_train,
    sft_train,
)

from .helpers import Spread

MODEL = "openrl-lab/tiny-llama-1m"


def new_trainer(service, seed=0, rank=32):
    return service.create_lora_training_client(base_model=MODEL, rank=rank, seed=seed).result()


# The short run's settings: tutorial 02's (8 prompts x 16, lr 1.5e-3 constant, 30 steps) in `make demo`'s experiment.
SHORT = {
    "prompts_per_step": 8,
    "group_size": 16,
    "learning_rate": 1.5e-3,
    "lr_schedule": "constant",
    "lr_warmup_steps": 0,
    "kl_coef": 0.0,
    "save_every": 0,
    "resample_rounds": 0,
    "advantage_norm": "std",
}
# Measured over seeds 0-9 on one kernel thread (as the suite runs kernels; docs/benchmarks.md, "make demo over ten
# seeds", the short run): held-out sampled gains 0.050 (seed 8) to 0.633, median 0.36; seed 0 +0.293. The check asks
# for half the smallest, so that it holds whatever trajectory another CPU takes; seed 0 passes it 11-fold.
MIN_GAIN = 0.025


def test_short_rl_run_raises_the_task_reward(service):
    """`make demo`'s experiment cut to 30 steps: the SFT warm-up, the held-out reward (eval-split prompts, never
    trained on) before and after RL. Seed 0, with a margin measured over ten seeds."""
    from openrl_lab.demo import demo_config, sft_then_rl

    config = replace(demo_config(30, seed=0), **SHORT)
    run = sft_then_rl(service, config=config, seed=0, progress=False)
    assert run.sft["loss"].iloc[-1] < run.sft["loss"].iloc[0] / 4
    assert run.after["sampled"] > run.before["sampled"] + MIN_GAIN, (run.before, run.after)
    m = run.rl.metrics
    assert list(m["step"]) == list(range(1, 31))
    # the metrics a user reads: on-policy, so the sampler and the learner agree (KL ~ 0)
    assert m["kl"].abs().max() < 1e-3
    assert (m["entropy"] > 0).all() and (m["tokens_per_s"] > 0).all()
    assert (m["sample_s"] > 0).all() and (m["train_s"] > 0).all()
    assert set(m.columns) >= {"reward", "reward_std", "loss", "kl", "entropy", "tokens_per_s", "sample_s", "train_s"}


def test_overlap_samples_one_step_behind(service):
    task = Spread()
    trainer = new_trainer(service, seed=1)
    config = RLConfig(
        steps=3, prompts_per_step=2, group_size=8, max_tokens=4, learning_rate=1e-2, overlap=True, save_every=0, seed=1
    )
    m = rl_train(service, trainer, task, config, progress=False).metrics
    assert list(m["step"]) == [1, 2, 3]
    assert (m["trained_samples"] > 0).all()
    # step 1 samples from the current weights; later steps from the weights before the previous update
    assert abs(m["kl"].iloc[0]) < 1e-3
    assert (m["kl"].iloc[1:].abs() > 1e-3).all(), m.to_string()
    # the server's own measure says the same: ~0 at step 1, the stale sampler's distance after
    assert m["sampler_kl"].iloc[0] < 1e-6 and (m["sampler_kl"].iloc[1:] > 1e-5).all(), m.to_string()
    assert (m["logprob_diff_max"].iloc[1:] > m["logprob_diff_max"].iloc[0]).all()


def test_stop_ends_the_run_at_the_next_step_boundary(service):
    trainer = new_trainer(service, seed=4)
    config = RLConfig(steps=50, prompts_per_step=1, group_size=4, max_tokens=3, save_every=0, seed=4)
    seen = []
    m = rl_train(
        service,
        trainer,
        Spread(),
        config,
        progress=False,
        on_step=lambda step, row: seen.append(step),
        stop=lambda: len(seen) >= 2,
    ).metrics
    assert list(m["step"]) == [1, 2] and seen == [1, 2]


def test_ppo_loss_and_periodic_save_state(service):
    trainer = new_trainer(service, seed=2)
    config = RLConfig(
        steps=4,
        prompts_per_step=2,
        group_size=8,
        max_tokens=4,
        loss_fn="ppo",
        loss_fn_config={"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        save_every=2,
        seed=2,
    )
    result = rl_train(service, trainer, Spread(), config, progress=False)
    assert np.isfinite(result.metrics["loss"]).all() and (result.metrics["trained_samples"] > 0).all()
    assert not result.metrics["skipped"].any()
    assert [p.rsplit("/", 1)[-1] for p in result.checkpoints] == ["rl-step-00000", "rl-step-00002", "rl-step-00004"]
    assert result.resumes == []


class Raising(Task):
    name = "raising"

    def make_problem(self, rng):
        return Problem(f"copy {rng.choice('AB')}:", "A")

    def reward(self, problem, completion):
        raise KeyError("no such key")


class NaNReward(Raising):
    name = "nan-reward"

    def reward(self, problem, completion):
        return float("nan")


@pytest.mark.parametrize(
    "task, why", [(Raising(), "raised KeyError"), (NaNReward(), "returned nan")], ids=["raises", "nan"]
)
def test_a_bad_reward_function_stops_the_run_with_reward_error(service, task, why):
    trainer = new_trainer(service)
    config = RLConfig(steps=2, prompts_per_step=2, group_size=2, max_tokens=3, save_every=0)
    with pytest.raises(RewardError, match=why) as info:
        rl_train(service, trainer, task, config, progress=False)
    assert repr(task.name) in str(info.value) and "prompt='copy " in str(info.value)


class SomeTooLong(Spread):
    """Every other prompt is longer than the model's context, so its sample request fails (a 4xx)."""

    name = "some-too-long"
    eval_fraction = 0.0  # two prompts, both needed for training: no held-out split

    def make_problem(self, rng):
        if rng.random() < 0.5:
            return Problem("copy " + "AB" * 400 + ":", "AB")
        return Problem("copy AB:", "AB")


def test_groups_that_fail_are_skipped_with_a_warning(service):
    task = SomeTooLong()
    trainer = new_trainer(service)
    config = RLConfig(steps=2, prompts_per_step=4, group_size=4, max_tokens=3, save_every=0, seed=2)
    problems = [task.problems(4, seed=config.seed * 100_003 + s) for s in (1, 2)]
    n_bad = [sum(len(p.prompt) > 100 for p in ps) for ps in problems]
    assert all(0 < n < 4 for n in n_bad)  # the seed gives each step good and bad prompts
    with pytest.warns(EmptyGroupWarning, match="some-too-long.*sampling failed.*group skipped"):
        m = rl_train(service, trainer, task, config, progress=False).metrics
    assert list(m["empty_groups"]) == n_bad
    assert list(m["samples"]) == [4 * (4 - n) for n in n_bad]
    assert (m["trained_samples"] > 0).all() and np.isfinite(m["loss"]).all()


def test_a_step_whose_groups_all_fail_is_skipped_not_a_crash(service):
    class AllTooLong(SomeTooLong):
        name = "all-too-long"

        def make_problem(self, rng):
            return Problem("copy " + "AB" * 400 + ":", "AB")

    trainer = new_trainer(service)
    config = RLConfig(steps=2, prompts_per_step=2, group_size=2, max_tokens=3, save_every=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = rl_train(service, trainer, AllTooLong(), config, progress=False).metrics
    assert sum(issubclass(w.category, EmptyGroupWarning) for w in caught) == 4
    assert list(m["step"]) == [1, 2] and list(m["samples"]) == [0, 0] and list(m["trained_samples"]) == [0, 0]
    assert m["reward"].isna().all() and m["loss"].isna().all() and m["skipped"].all()
    text = format_summary(m)
    assert "2 skipped: 0 with no reward spread in any group, 2 with no samples" in text and "nan" not in text.lower()


class Constant(Task):
    """Every completion gets the same reward (and shaped reward): no group ever has reward spread."""

    name = "constant"

    def make_problem(self, rng):
        return Problem(f"copy {rng.choice('AB')}{rng.choice('AB')}:", "AB")

    def reward(self, problem, completion):
        return 0.0


def test_a_step_with_no_reward_spread_is_shown_as_skipped_not_nan(service, capsys):
    trainer = new_trainer(service, seed=5)
    config = RLConfig(steps=3, prompts_per_step=2, group_size=4, max_tokens=3, save_every=0, seed=5)
    rows = []
    m = rl_train(
        service, trainer, Constant(), config, progress=True, on_step=lambda step, row: rows.append(row)
    ).metrics
    progress = capsys.readouterr().err
    # the progress bar says so, and never shows a nan loss
    assert "loss=skipped" in progress and "loss=nan" not in progress, progress
    # the metrics: each step marked skipped, nothing trained, loss and KL missing (not a number to average)
    assert list(m["step"]) == [1, 2, 3] and m["skipped"].all() and (m["trained_samples"] == 0).all()
    assert (m["samples"] == 8).all() and (m["reward"] == 0.0).all()
    assert m["loss"].isna().all() and m["kl"].isna().all()
    assert [r["skipped"] for r in rows] == [True, True, True]
    # the summary shows "skipped" where the loss goes and counts the skipped steps; no nan anywhere
    text = format_summary(m, title="constant")
    assert "3 skipped: no group had reward spread" in text, text
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["step", "reward", "reward_std", "loss"]
    assert all(line.split()[3] == "skipped" for line in lines[2:5]), text
    assert "nan" not in text.lower(), text


class HalfFlat(Spread):
    """Prompts with an A first have spread (Spread's length reward); those with a B first give every completion
    the same reward, so their groups teach nothing and dynamic sampling replaces them."""

    name = "half-flat"

    def shaped_reward(self, problem, completion):
        return 0.5 if problem.prompt.startswith("copy B") else super().shaped_reward(problem, completion)


def test_kl_penalty_dynamic_sampling_and_warmup_through_the_sdk(service):
    trainer = new_trainer(service, seed=3)
    config = RLConfig(
        steps=6,
        prompts_per_step=2,
        group_size=8,
        max_tokens=4,
        learning_rate=2e-2,
        lr_schedule="constant",
        lr_warmup_steps=3,
        kl_coef=0.5,
        resample_rounds=4,
        save_every=0,
        seed=3,
    )
    m = rl_train(service, trainer, HalfFlat(), config, progress=False).metrics
    assert list(m["lr"]) == pytest.approx([2e-2 / 3, 2 * 2e-2 / 3, 2e-2, 2e-2, 2e-2, 2e-2])
    # the first round's flat groups were replaced by fresh prompts with spread: every step trains two groups
    firsts = [config.seed * 100_003 + s for s in range(1, 7)]
    flat = [sum(p.prompt.startswith("copy B") for p in HalfFlat().problems(2, seed=s)) for s in firsts]
    assert any(flat), "the seed gives some step a flat group to replace"
    assert all((m["resample_rounds"] > 0) == (np.asarray(flat) > 0))
    assert (m["trained_samples"] == 2 * 8).all(), m.to_string()
    # the reference is the policy RL started from: no distance at step 1, a growing one as the policy moves
    assert abs(m["ref_kl"].iloc[0]) < 1e-4 and m["ref_kl"].iloc[-1] > 1e-3, m["ref_kl"].tolist()


def test_a_run_made_to_collapse_is_flagged_while_it_happens(service):
    task = Copy(length=3, alphabet="ABCD")
    trainer = new_trainer(service, seed=0)
    sft_train(trainer, task, steps=80, learning_rate=3e-3, target_loss=0.8, seed=0, progress=False)
    # a learning rate 7x the demo's: the policy grows sure of wrong answers within ~30 steps (onset at steps 22-29
    # for seeds 0-4 here, docs/recipes.md); far higher (5e-2) it can diverge instead (entropy ~6, not a collapse).
    # No KL penalty, no warm-up (as `RLConfig()`): with `kl_coef=0.1` and a 10-step warm-up this run, seed 0, did not
    # collapse in 40 steps.
    config = RLConfig(
        steps=40,  # the latest onset seen is 29
        prompts_per_step=4,
        group_size=16,
        max_tokens=6,
        learning_rate=1e-2,
        lr_schedule="constant",
        lr_warmup_steps=0,
        kl_coef=0.0,
        save_every=0,
        seed=0,
    )
    with pytest.warns(CollapseWarning, match=r"step (\d+): the policy is collapsing: entropy .* \(floor 0.3\)") as w:
        m = rl_train(service, trainer, task, config, progress=False).metrics
    onset = int(re.search(r"step (\d+)", str(w[0].message)).group(1))
    assert m["collapse"].any() and collapse_onsets(m)[0] == onset
    # and it stays collapsed for a while (at this constant lr it can climb out again ~20 steps later)
    assert m.loc[m["step"].between(onset, onset + 9), "entropy"].mean() < 0.3
    assert f"COLLAPSE: from step {onset}" in format_summary(m)
