"""The recipes' pieces without a server: tasks, reward checks, advantages, datums, empty groups."""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import random
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
from tinker import types

from openrl_lab import recipes
from openrl_lab.recipes import (
    TASKS,
    Addition,
    Copy,
    EmptyGroupWarning,
    Problem,
    Reverse,
    RewardError,
    RLConfig,
    Rollout,
    SortDigits,
    Task,
    default_max_tokens,
    group_advantages,
    prompt_key,
    rl_datum,
    sft_train,
)
from openrl_lab.recipes.rl import collect_group, learning_rate_at, step_problems
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


@pytest.mark.parametrize(
    "value, why",
    [
        (ZeroDivisionError("oops"), "raised ZeroDivisionError: oops"),
        (math.nan, "returned nan"),
        (math.inf, "returned inf"),
        (1.5, r"must lie in \[0, 1\]"),
        (-0.1, r"must lie in \[0, 1\]"),
        ("yes", "not a number"),
        (None, "not a number"),
    ],
)
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
    # Dr. GRPO: centred, not scaled, so a group with little spread moves the policy little
    assert group_advantages([1.0, 0.0, 0.0, 0.0], norm="mean") == [0.75, -0.25, -0.25, -0.25]


def test_learning_rate_schedules():
    linear = RLConfig(steps=4, learning_rate=1.0, lr_schedule="linear", lr_warmup_steps=0)
    assert [learning_rate_at(linear, s) for s in (1, 2, 3, 4)] == [1.0, 0.75, 0.5, 0.25]
    assert learning_rate_at(RLConfig(learning_rate=0.5, lr_schedule="constant", lr_warmup_steps=0), 7) == 0.5
    warm = RLConfig(steps=8, learning_rate=1.0, lr_schedule="linear", lr_warmup_steps=4)
    assert [learning_rate_at(warm, s) for s in (1, 2, 4, 5)] == [0.25, 0.5 * 0.875, 0.625, 0.5]
    with pytest.raises(ValueError, match="lr_schedule"):
        learning_rate_at(RLConfig(lr_schedule="cosine"), 1)


def test_rl_datum_scores_completion_tokens_only():
    r = Rollout(
        Problem("p", "a"),
        prompt_tokens=[5, 6, 7],
        tokens=[8, 9, 2],
        logprobs=[-0.1, -0.2, -0.3],
        stopped=True,
        text="x",
        reward=1.0,
        shaped=1.0,
    )
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
    allowed = {
        "__future__",
        "hashlib",
        "math",
        "random",
        "time",
        "warnings",
        "dataclasses",
        "typing",
        "pathlib",
        "numpy",
        "pandas",
        "tinker",
        "tqdm",
        "plotly",
        "openrl_lab.recipes",
        "openrl_lab.collapse",  # the collapse rule: standard library only, shared with the notebook layer
        "collections",
    }
    root = Path(recipes.__file__).parent
    found = {}
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            for n in names:
                top = next(
                    (a for a in ("openrl_lab.recipes", "openrl_lab.collapse") if n.startswith(a)), n.split(".")[0]
                )
                if top not in allowed:
                    found.setdefault(f.name, []).append(n)
    assert found == {}


# ------------------------------------------------------------------------------ the held-out split

BUILTIN_VARIANTS = [
    Addition(),
    Copy(),
    Reverse(),
    SortDigits(),
    Addition(99),
    Copy(5, "AB"),
    Reverse(2, "XYZ"),
    SortDigits(2),
    Copy(1, "AB"),
]


class Double(Task):  # the tasks module docstring's example: a user task, nothing but make_problem
    name = "double"

    def make_problem(self, rng: random.Random) -> Problem:
        n = rng.randint(0, 9)
        return Problem(prompt=f"2*{n}=", answer=str(2 * n))


class Pair(Task):  # a user task whose whole space is two prompts
    name = "pair"

    def make_problem(self, rng):
        return Problem(f"copy {rng.choice('AB')}:", "A")


def _prompts(task, split, draws=400, seeds=range(5)):
    return {p.prompt for s in seeds for p in task.problems(draws, seed=s, split=split)}


@pytest.mark.parametrize("task", [*BUILTIN_VARIANTS, Double(), Pair()], ids=repr)
def test_eval_prompts_are_never_training_prompts(task):
    train, held_out = _prompts(task, "train"), _prompts(task, "eval")
    assert train and held_out and not train & held_out
    assert all(task.split_of(p) == "train" for p in train) and all(task.split_of(p) == "eval" for p in held_out)
    sizes = task.split_sizes()
    assert sizes["train"] >= 1 and sizes["eval"] >= 1 and sizes["train"] + sizes["eval"] == sizes["probed"]
    if sizes["probed"] >= 8:  # about eval_fraction of the prompts are held out
        assert 0.15 < sizes["eval"] / sizes["probed"] < 0.35, sizes
    # what the recipes draw: RL steps and the SFT warm-up take only "train" prompts
    config = RLConfig(prompts_per_step=8, seed=3)
    rl_prompts = {p.prompt for step in range(1, 151) for p in step_problems(task, config, step)}
    assert not rl_prompts & held_out and all(task.split_of(p) == "train" for p in rl_prompts)
    # the whole space (split=None) still has both
    everything = _prompts(task, None)
    assert {task.split_of(p) for p in everything} == {"train", "eval"}


def test_builtin_split_sizes():
    assert Copy(3, "ABCD").split_sizes() == {"train": 48, "eval": 16, "probed": 64}
    assert Reverse(3, "ABCD").split_sizes() == {"train": 48, "eval": 16, "probed": 64}
    assert Addition(9).split_sizes() == {"train": 75, "eval": 25, "probed": 100}
    assert Pair().split_sizes() == {"train": 1, "eval": 1, "probed": 2}  # a tiny space still splits


def test_sft_trains_only_on_the_train_split():
    """Stand-in trainer, named as such: it records what sft_train sends (a character tokenizer), nothing more."""
    task = Copy(3, "ABCD")

    class CharTokenizer:
        eos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    class Done:
        def __init__(self, value):
            self.value = value

        def result(self):
            return self.value

    class RecordingTrainer:
        def __init__(self):
            self.prompts = set()

        def get_tokenizer(self):
            return CharTokenizer()

        def forward_backward(self, batch, loss_fn):
            for d in batch:
                text = "".join(chr(t) for t in d.model_input.to_ints())
                self.prompts.add(text[: text.index(":") + 1])
            return Done(
                types.ForwardBackwardOutput(loss_fn_output_type="x", loss_fn_outputs=[], metrics={"loss:sum": 1.0})
            )

        def optim_step(self, adam):
            return Done(None)

    trainer = RecordingTrainer()
    history = sft_train(trainer, task, steps=40, batch_size=16, seed=0, progress=False)
    assert len(history) == 40
    assert len(trainer.prompts) == 48  # every training prompt, and no other
    assert all(task.split_of(p) == "train" for p in trainer.prompts)


@pytest.mark.server  # another Python process
def test_the_split_is_the_same_in_another_process():
    code = (
        "import json\n"
        "from openrl_lab.recipes import Addition, Copy, Reverse, SortDigits\n"
        "tasks = [Addition(), Copy(), Reverse(), SortDigits()]\n"
        "print(json.dumps([sorted({p.prompt for p in t.problems(300, seed=1, split='eval')}) for t in tasks]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(Path(recipes.__file__).parents[2]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    here = [
        sorted({p.prompt for p in t.problems(300, seed=1, split="eval")})
        for t in (Addition(), Copy(), Reverse(), SortDigits())
    ]
    assert json.loads(out.stdout) == here
    assert prompt_key("copy CAB:") == int(hashlib.sha256(b"copy CAB:").hexdigest()[:16], 16) / 2**64


def test_no_eval_split_when_turned_off_or_a_single_prompt():
    class One(Task):
        name = "one"

        def make_problem(self, rng):
            return Problem("copy A:", "A")

    class NoSplit(Double):
        eval_fraction = 0.0

    for task in (One(), NoSplit()):
        assert {p.prompt for p in task.problems(50, seed=0)} == {p.prompt for p in task.problems(50, 0, split=None)}
        with pytest.raises(ValueError, match="no eval split"):
            task.problems(1, seed=0, split="eval")
    with pytest.raises(ValueError, match="split must be"):
        Copy().problems(1, seed=0, split="test")


def test_the_split_follows_the_task_settings():
    task = Copy(3, "ABCD")
    assert task.split_sizes()["probed"] == 64
    task.length = 2
    assert task.split_sizes() == {"train": 12, "eval": 4, "probed": 16}
    assert all(len(p.answer) == 2 for p in task.problems(10, seed=0, split="eval"))


# ------------------------------------------------------------------------------ tokens per answer


@pytest.fixture(scope="module")
def builtin_tokenizer():
    from openrl_lab.train.models import build_tokenizer

    return build_tokenizer()


@pytest.mark.parametrize("task", [*BUILTIN_VARIANTS, Addition(999), SortDigits(12), Copy(10, "ABCDEFGH")], ids=repr)
def test_no_builtin_answer_is_cut_at_the_default_max_tokens(task, builtin_tokenizer):
    answers = {p.answer for p in task.problems(3000, seed=0, split=None)}
    lengths = [len(builtin_tokenizer.encode(a, add_special_tokens=False)) for a in answers]
    assert max(lengths) == task.max_answer_tokens  # exact for the built-ins: one token per digit or letter
    assert all(n == len(a) for n, a in zip(lengths, answers))
    assert RLConfig().max_tokens is None  # rl_train and evaluate resolve it per task
    assert default_max_tokens(task) >= max(lengths) + 1  # the answer and </s>
    assert default_max_tokens(task) >= 8


def test_default_max_tokens_of_a_user_task():
    class Long(Task):
        name = "long"

        def make_problem(self, rng):
            return Problem("spell:", "abcdefghijklmnop"[: rng.randint(1, 16)])

    assert Long().max_answer_tokens == 16 and default_max_tokens(Long()) == 17
    assert default_max_tokens(Double()) == 8


def test_the_demo_evaluates_only_prompts_it_never_trains_on():
    from openrl_lab.demo import EVAL_PROBLEMS, demo_config, demo_task, held_out_split

    task = demo_task()
    for seed in (0, 1, 2, 3):
        held_out = task.problems(EVAL_PROBLEMS, seed=10_000 + seed, split="eval")
        split = held_out_split(task, demo_config(seed=seed), 80, seed, held_out)
        assert split["overlap"] == 0 and split["eval_problems"] == EVAL_PROBLEMS
        assert (split["train_prompts"], split["eval_prompts"]) == (48, 16)
        assert 8 <= split["eval_prompts_used"] <= 16 and split["trained_prompts_used"] == 48
