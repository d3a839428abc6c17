"""Tasks with verifiable rewards, small enough for the built-in tiny model to learn on a laptop CPU.

A task makes problems (a prompt and its reference answer) and scores a completion with a reward in
[0, 1]. That is all the recipes need from it. Add your own in a notebook cell:

    import random
    from openrl_lab.recipes import Problem, Task

    class Double(Task):
        name = "double"

        def make_problem(self, rng: random.Random) -> Problem:
            n = rng.randint(0, 9)
            return Problem(prompt=f"2*{n}=", answer=str(2 * n))

        # reward() defaults to an exact match of the stripped completion with problem.answer;
        # override it (and optionally shaped_reward() for partial credit) for anything else.

    task = Double()
    task.problems(3, seed=0)   # [Problem(prompt='2*6=', answer='12'), ...]

`reward` is the verifiable score that is reported. `shaped_reward` (default: the same) is what the RL
recipe turns into advantages; partial credit there helps a small model find the answer sooner, while the
reported curve stays the honest task reward.

`completion` is the decoded text the model produced before its end-of-sequence token (or everything it
produced, when it never stopped: such a completion is marked `stopped=False` in the rollout).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


class RewardError(ValueError):
    """A task's reward function raised, or returned something that is not a finite number in [0, 1]."""


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # the reference answer: the SFT target, and what the reward checks against


class Task:
    """Base class (and protocol) of a task: override `make_problem`; `reward` if not an exact match."""

    name: str = "task"

    def make_problem(self, rng: random.Random) -> Problem:
        raise NotImplementedError(f"{type(self).__name__} must implement make_problem(rng)")

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)

    def shaped_reward(self, problem: Problem, completion: str) -> float:
        return self.reward(problem, completion)

    def problems(self, n: int, seed: int) -> list[Problem]:
        """n problems from a fixed seed (the same seed always gives the same problems)."""
        rng = random.Random(seed)
        return [self.make_problem(rng) for _ in range(n)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def checked_reward(task: Task, problem: Problem, completion: str, shaped: bool = False) -> float:
    """Call the task's (shaped) reward; anything but a finite number (in [0, 1] for the task reward)
    becomes a RewardError naming the task, the prompt and the completion."""
    fn = task.shaped_reward if shaped else task.reward
    what = f"{task.name}.{fn.__name__}(prompt={problem.prompt!r}, completion={completion!r})"
    try:
        value = fn(problem, completion)
    except Exception as exc:
        raise RewardError(f"task {task.name!r}: {what} raised {type(exc).__name__}: {exc}") from exc
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"task {task.name!r}: {what} returned {value!r}, not a number") from None
    if not math.isfinite(value):
        raise RewardError(f"task {task.name!r}: {what} returned {value}; rewards must be finite numbers")
    if not shaped and not 0.0 <= value <= 1.0:
        raise RewardError(f"task {task.name!r}: {what} returned {value}; task rewards must lie in [0, 1]")
    return value


def _char_credit(answer: str, completion: str) -> float:
    """Partial credit: the share of positions that hold the right character (length mismatches count)."""
    completion = completion.strip()
    hits = sum(a == b for a, b in zip(answer, completion))
    return hits / max(len(answer), len(completion), 1)


# ------------------------------------------------------------------------------------------ built-ins

class Addition(Task):
    """Sums of small numbers: "3+4=" -> "7". Partial credit for a number close to the answer."""

    name = "addition"

    def __init__(self, max_operand: int = 9):
        self.max_operand = max_operand

    def make_problem(self, rng: random.Random) -> Problem:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    def shaped_reward(self, problem: Problem, completion: str) -> float:
        try:
            got = int(completion.strip())
        except ValueError:
            return 0.0
        return max(0.0, 1.0 - abs(got - int(problem.answer)) / 5)


class _StringTask(Task):
    """Strings over a small alphabet (upper-case letters are single tokens for the built-in tokenizer)."""

    verb = ""

    def __init__(self, length: int = 3, alphabet: str = "ABCD"):
        self.length, self.alphabet = length, alphabet

    def transform(self, s: str) -> str:
        raise NotImplementedError

    def make_problem(self, rng: random.Random) -> Problem:
        s = "".join(rng.choice(self.alphabet) for _ in range(self.length))
        return Problem(prompt=f"{self.verb} {s}:", answer=self.transform(s))

    def shaped_reward(self, problem: Problem, completion: str) -> float:
        return _char_credit(problem.answer, completion)


class Copy(_StringTask):
    """Repeat the string: "copy CAB:" -> "CAB"."""

    name, verb = "copy", "copy"

    def transform(self, s: str) -> str:
        return s


class Reverse(_StringTask):
    """Reverse the string: "reverse CAB:" -> "BAC"."""

    name, verb = "reverse", "reverse"

    def transform(self, s: str) -> str:
        return s[::-1]


class SortDigits(Task):
    """Sort digits ascending: "sort 3142:" -> "1234". Partial credit per position."""

    name = "sort_digits"

    def __init__(self, length: int = 4):
        self.length = length

    def make_problem(self, rng: random.Random) -> Problem:
        digits = "".join(str(rng.randint(0, 9)) for _ in range(self.length))
        return Problem(prompt=f"sort {digits}:", answer="".join(sorted(digits)))

    def shaped_reward(self, problem: Problem, completion: str) -> float:
        return _char_credit(problem.answer, completion)


TASKS: dict[str, type[Task]] = {t.name: t for t in (Addition, Copy, Reverse, SortDigits)}
