"""The recipes' pieces without a server: tasks, reward checks, advantages, datums, empty groups."""

from __future__ import annotations

import ast
import math
import random
from concurrent.futures import Future
from pathlib import Path

import pytest
from tinker import types

from openrl_lab import recipes
from openrl_lab.recipes import (TASKS, Addition, Copy, EmptyGroupWarning, Problem, Reverse, RewardError, RLConfig,
                                Rollout, SortDigits, Task, group_advantages, rl_datum)
from openrl_lab.recipes.rl import collect_group, learning_rate_at
from openrl_lab.recipes.tasks import checked_reward


@pytest.mark.parametrize("task", [Addition(), Copy(), Reverse(), SortDigits()], ids=lambda t: t.name)
def test_builtin_tasks_score_their_reference_answer(task):
    problems = task.problems(20, seed=3)
    assert problems == task.problems(20, seed=3)  # a seed fixes the problems
    assert problems != task.problems(20, seed=4)
    for p in problems:
        assert checked_reward(task, p, p.answer) == 1.0
        assert checked_reward(task, p, " " + p.answer + " ") == 1.0  # surrounding spaces do not matter
        assert checked_reward(task, p, p.answer + "x") == 0.0
        assert 0.0 <= checked_reward(task, p, "junk", shaped=True) < 1.0
    assert set(TASKS) == {"addition", "copy", "reverse", "sort_digits"}


def test_partial_credit_is_only_in_the_shaped_reward():
    task, p = Reverse(length=4), Problem("reverse ABCD:", "DCBA")
    assert task.reward(p, "DCBB") == 0.0
    assert task.shaped_reward(p, "DCBB") == 0.75
    assert task.shaped_reward(p, "DCBAAAAA") == 0.5  # too long: the extra characters count against it
    add = Addition()
    assert add.reward(Problem("3+4=", "7"), "8") == 0.0
    assert add.shaped_reward(Problem("3+4=", "7"), "8") == pytest.approx(0.8)
    assert add.shaped_reward(Problem("3+4=", "7"), "seven") == 0.0


def test_a_user_task_needs_only_make_problem():
    class Double(Task):  # the docstring's example
        name = "double"

        def make_problem(self, rng: random.Random) -> Problem:
            n = rng.randint(0, 9)
            return Problem(prompt=f"2*{n}=", answer=str(2 * n))

    task = Double()
    p = task.problems(1, seed=0)[0]
    assert checked_reward(task, p, p.answer) == 1.0 and checked_reward(task, p, "x") == 0.0
    with pytest.raises(NotImplementedError, match="make_problem"):
        Task().problems(1, seed=0)


class Broken(Task):
    name = "broken"

    def __init__(self, value):
        self.value = value

    def make_problem(self, rng):
        return Problem("copy AB:", "AB")

    def reward(self, problem, completion):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


@pytest.mark.parametrize("value, why", [(ZeroDivisionError("oops"), "raised ZeroDivisionError: oops"),
                                        (math.nan, "returned nan"), (math.inf, "returned inf"),
                                        (1.5, r"must lie in \[0, 1\]"), (-0.1, r"must lie in \[0, 1\]"),
                                        ("yes", "not a number"), (None, "not a number")])
def test_bad_rewards_raise_reward_error_naming_task_and_prompt(value, why):
    task = Broken(value)
    with pytest.raises(RewardError, match=why) as info:
        checked_reward(task, task.make_problem(None), "AB")
    assert "'broken'" in str(info.value) and "copy AB:" in str(info.value) and "'AB'" in str(info.value)


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert adv[0] == pytest.approx(math.sqrt(3), rel=1e-5) and adv[1] == pytest.approx(-1 / math.sqrt(3), rel=1e-5)
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]  # no spread: the group teaches nothing
    assert group_advantages([]) == []


def test_learning_rate_schedules():
    linear = RLConfig(steps=4, learning_rate=1.0, lr_schedule="linear")
    assert [learning_rate_at(linear, s) for s in (1, 2, 3, 4)] == [1.0, 0.75, 0.5, 0.25]
    assert learning_rate_at(RLConfig(learning_rate=0.5, lr_schedule="constant"), 7) == 0.5
    with pytest.raises(ValueError, match="lr_schedule"):
        learning_rate_at(RLConfig(lr_schedule="cosine"), 1)


def test_rl_datum_scores_completion_tokens_only():
    r = Rollout(Problem("p", "a"), prompt_tokens=[5, 6, 7], tokens=[8, 9, 2], logprobs=[-0.1, -0.2, -0.3],
                stopped=True, text="x", reward=1.0, shaped=1.0)
    d = rl_datum(r, 0.5)
    assert d.model_input.to_ints() == [5, 6, 7, 8, 9]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8, 9, 2]
    assert d.loss_fn_inputs["logprobs"].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3])
    assert d.loss_fn_inputs["advantages"].tolist() == [0, 0, 0.5, 0.5, 0.5]


def test_a_group_with_zero_samples_is_skipped_with_a_warning():
    # Stand-in, named as such: the real server never answers a sample request with zero sequences, so a
    # plain Future holds a real (empty) tinker SampleResponse here.
    future = Future()
    future.set_result(types.SampleResponse(sequences=[]))
    with pytest.warns(EmptyGroupWarning, match=r"task 'copy', prompt 'copy AB:'.*no samples"):
        assert collect_group(Copy(), None, Problem("copy AB:", "AB"), [1, 2], future, step=3) == []


def test_recipes_import_nothing_from_the_server_side():
    allowed = {"__future__", "math", "random", "time", "warnings", "dataclasses", "typing", "pathlib", "numpy",
               "pandas", "tinker", "tqdm", "plotly", "openrl_lab.recipes", "collections"}
    root = Path(recipes.__file__).parent
    found = {}
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for n in names:
                top = "openrl_lab.recipes" if n.startswith("openrl_lab.recipes") else n.split(".")[0]
                if top not in allowed:
                    found.setdefault(f.name, []).append(n)
    assert found == {}
