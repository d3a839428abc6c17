"""Recipes: SFT and GRPO-style RL loops written only against the four primitives of the `tinker` SDK.

They import nothing from the server side, so they run against any Tinker-compatible server. Each file
reads top to bottom; copy one into a notebook and change it.

    from openrl_lab.recipes import Copy, RLConfig, Task, rl_train, sft_train
"""

from openrl_lab.collapse import CollapseWarning, CollapseWatch
from openrl_lab.recipes.metrics import collapse_onsets, format_summary, plot_metrics, summary_table
from openrl_lab.recipes.rl import (
    EmptyGroupWarning,
    RLConfig,
    RLResult,
    Rollout,
    evaluate,
    group_advantages,
    rl_datum,
    rl_train,
)
from openrl_lab.recipes.sft import sft_datum, sft_train
from openrl_lab.recipes.tasks import (
    SPLITS,
    TASKS,
    Addition,
    Copy,
    Problem,
    Reverse,
    RewardError,
    SortDigits,
    Task,
    default_max_tokens,
    prompt_key,
)

__all__ = [
    "SPLITS",
    "TASKS",
    "Addition",
    "CollapseWarning",
    "CollapseWatch",
    "Copy",
    "EmptyGroupWarning",
    "Problem",
    "RLConfig",
    "RLResult",
    "Reverse",
    "RewardError",
    "Rollout",
    "SortDigits",
    "Task",
    "collapse_onsets",
    "default_max_tokens",
    "evaluate",
    "format_summary",
    "group_advantages",
    "plot_metrics",
    "prompt_key",
    "rl_datum",
    "rl_train",
    "sft_datum",
    "sft_train",
    "summary_table",
]
