"""The collapse detector of an RL run: a policy that grows sure of itself while its reward falls.

`CollapseWatch` sees a run step by step. Over the last COLLAPSE_WINDOW steps, a step is *in a collapse* when the
entropy estimate (-mean logprob of the sampled tokens, nats per token) is below ENTROPY_FLOOR while the task reward
is COLLAPSE_DROP below its best such mean so far, or stays at zero (below ZERO_REWARD). A run that converged
(entropy low, reward at its best) is not a collapse; a policy sure of wrong answers is. The training loop
(`openrl_lab.recipes.rl_train`), a run's log and `LivePlot` (`openrl_lab.lab`), the summary and the doctor all use
this one rule, so they agree; docs/recipes.md ("A collapse, seen while it happens") says why these numbers.

Pure Python, no imports beyond the standard library: the notebook layer loads it without the recipes' tinker.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

ENTROPY_FLOOR = 0.3  # nats per sampled token
COLLAPSE_WINDOW = 10  # steps
COLLAPSE_DROP = 0.2  # task reward, below the best mean of COLLAPSE_WINDOW steps
ZERO_REWARD = 0.05
COLLAPSE_METRIC = "collapse"  # the metrics column (and logged metric) that flags a step in a collapse


class CollapseWarning(UserWarning):
    """The run's policy is collapsing: its entropy fell below the floor while its reward fell or stayed at zero."""


@dataclass
class CollapseWatch:
    """Watches an RL run step by step for a collapse (see ENTROPY_FLOOR); `update` says whether the step is in one.
    The same object serves the training loop, the notebook's LivePlot and the summary, so all three agree."""

    entropy_floor: float = ENTROPY_FLOOR
    window: int = COLLAPSE_WINDOW
    drop: float = COLLAPSE_DROP
    _rewards: deque = field(default_factory=deque, repr=False)
    _entropies: deque = field(default_factory=deque, repr=False)
    best: float = -math.inf  # the best mean reward of a full window so far
    collapsed: bool = False  # the last step was in a collapse
    reason: str = ""  # why, for the last step in a collapse

    def update(self, reward: float | None, entropy: float | None) -> bool:
        """Feed one step's mean reward and entropy estimate (None or NaN: a step without samples, ignored)."""
        if reward is None or entropy is None or math.isnan(reward) or math.isnan(entropy):
            return self.collapsed
        for q, v in ((self._rewards, reward), (self._entropies, entropy)):
            q.append(v)
            if len(q) > self.window:
                q.popleft()
        if len(self._rewards) < self.window:
            return False
        mean_r, mean_h = sum(self._rewards) / self.window, sum(self._entropies) / self.window
        self.best = max(self.best, mean_r)
        fell = mean_r <= self.best - self.drop
        self.collapsed = mean_h < self.entropy_floor and (fell or mean_r < ZERO_REWARD)
        if self.collapsed:
            how = f"fell from {self.best:.2f} to {mean_r:.2f}" if fell else f"stays at {mean_r:.2f}"
            self.reason = (
                f"entropy {mean_h:.2f} nats/token (floor {self.entropy_floor}) while the reward {how} "
                f"(means of the last {self.window} steps)"
            )
        return self.collapsed
