from __future__ import annotations

from openrl_lab.recipes import Problem, Task


class Spread(Task):
    """A task whose shaped reward differs between almost any two samples (the completion's length), so even
    a random-init model's groups have spread and every step trains."""

    name = "spread"

    def make_problem(self, rng):
        return Problem(f"copy {rng.choice('AB')}{rng.choice('AB')}:", "AB")

    def shaped_reward(self, problem, completion):
        return min(len(completion), 20) / 20
