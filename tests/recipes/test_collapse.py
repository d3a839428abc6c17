"""The collapse detector (openrl_lab/collapse.py) on hand-made runs, and what the summary and the plot say of one:
a converged run is not a collapse, a policy sure of wrong answers is, and every reader of a run agrees."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from openrl_lab.collapse import COLLAPSE_WINDOW, ENTROPY_FLOOR, CollapseWatch
from openrl_lab.recipes import collapse_onsets, format_summary, plot_metrics


def run(rewards: list[float], entropies: list[float]) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "step": range(1, len(rewards) + 1),
            "reward": rewards,
            "reward_std": [0.1] * len(rewards),
            "loss": [0.0] * len(rewards),
            "kl": [0.0] * len(rewards),
            "entropy": entropies,
            "step_s": [0.1] * len(rewards),
            "sample_s": [0.05] * len(rewards),
            "train_s": [0.05] * len(rewards),
        }
    )


# the issue's run: reward peaks ~0.44 by step 29, falls to ~0 by step 56 while the entropy goes 1.06 -> 0.17
RISE = [0.14 + 0.3 * i / 29 for i in range(29)]
FALL = [max(0.44 - 0.44 * i / 27, 0.0) for i in range(1, 28)]
COLLAPSED = run(RISE + FALL + [0.0] * 30, [1.06 - 0.5 * i / 29 for i in range(29)] + [0.17] * 57)


def test_a_policy_sure_of_falling_rewards_is_flagged_at_the_step_it_began():
    onsets = collapse_onsets(COLLAPSED)
    assert len(onsets) == 1
    # flagged while the reward falls (a window mean 0.2 under its best), long before it reaches 0
    assert 40 <= onsets[0] <= 50, onsets
    assert COLLAPSED.loc[COLLAPSED["step"] == onsets[0], "reward"].item() > 0.1


def test_a_converged_run_and_a_run_still_exploring_are_not_collapses():
    converged = run([min(0.1 + i / 50, 1.0) for i in range(100)], [max(1.0 - i / 40, 0.01) for i in range(100)])
    assert collapse_onsets(converged) == []
    # reward at zero but entropy high: no learning yet, not a policy sure of itself
    exploring = run([0.0] * 50, [1.2] * 50)
    assert collapse_onsets(exploring) == []


def test_zero_reward_with_low_entropy_is_a_collapse_and_steps_without_samples_are_passed_over():
    watch = CollapseWatch()
    seen = [watch.update(0.0, 0.1) for _ in range(COLLAPSE_WINDOW - 1)]
    assert not any(seen), "a window is needed first"
    assert watch.update(math.nan, math.nan) is False  # a step with no samples: ignored
    assert watch.update(0.0, 0.1) is True
    assert "stays at 0.00" in watch.reason and f"floor {ENTROPY_FLOOR}" in watch.reason
    # recovery: the reward comes back and the flag goes
    for _ in range(COLLAPSE_WINDOW):
        watch.update(1.0, 0.1)
    assert watch.collapsed is False


def test_the_summary_and_the_plot_mark_the_collapse(tmp_path):
    text = format_summary(COLLAPSED, title="t")
    onset = collapse_onsets(COLLAPSED)[0]
    assert f"COLLAPSE: from step {onset}" in text
    assert "COLLAPSE" not in format_summary(run([0.5] * 20, [1.0] * 20))
    html = plot_metrics(COLLAPSED, tmp_path / "p.html").read_text()
    assert f"collapse at step {onset}" in html and "entropy floor" in html


def test_the_loop_s_own_flags_win_over_a_recomputation():
    m = COLLAPSED.copy()
    m["collapse"] = False
    m.loc[m["step"] == 70, "collapse"] = True
    assert collapse_onsets(m) == [70]


@pytest.mark.parametrize("bad", [{"advantage_norm": "z"}, {"kl_coef": -1.0}, {"resample_rounds": -1}])
def test_rlconfig_refuses_bad_anti_collapse_options(bad):
    from openrl_lab.recipes import RLConfig

    with pytest.raises(ValueError, match=next(iter(bad))):
        RLConfig(**bad)
