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
    task.problems(3, seed=0)                # for training: [Problem(prompt='2*6=', answer='12'), ...]
    task.problems(3, seed=0, split="eval")  # held out (never drawn for training): '2*0=' or '2*1='

`reward` is the verifiable score that is reported. `shaped_reward` (default: the same) is what the RL
recipe turns into advantages; partial credit there helps a small model find the answer sooner, while the
reported curve stays the honest task reward.

`completion` is the decoded text the model produced before its end-of-sequence token (or everything it
produced, when it never stopped: such a completion is marked `stopped=False` in the rollout).

Held-out split. Every task splits its problem space into "train" and "eval" by the prompt alone, so that
evaluation prompts are never seen in training:

    task.problems(32, seed=0)                 # split="train" (the default): what SFT and RL draw from
    task.problems(32, seed=0, split="eval")   # only prompts training never sees
    task.split_of("copy CAB:")                # "train" or "eval"
    task.split_sizes()                        # {"train": 48, "eval": 16, "probed": 64} for Copy(3, "ABCD")

The rule: a prompt's key is a stable hash of its text (the first 8 bytes of its SHA-256, as a number in
[0, 1); not Python's `hash()`, which is salted per process). A prompt is "eval" when its key is below the
task's threshold. The threshold puts `eval_fraction` (default 0.25) of the task's prompts on the eval side:
the task draws `split_probe` (2048) problems from a fixed seed, takes the distinct prompts (m of them), and
sets the threshold between the k-th and (k+1)-th smallest key, k = round(eval_fraction * m) clamped to
[1, m - 1]. So a tiny space still splits (2 prompts: 1 and 1), a large one splits about 1 : 3, and the
split is the same in every process and on every machine, as long as `make_problem` draws only from the
`rng` it is given. A task with a single prompt has no eval split; `eval_fraction = 0` turns the split off
(everything is "train"). `split=None` draws from the whole space. A subclass gets all of this for free.

Tokens (the built-in models). The built-in tokenizer makes every digit one token (`'14'` is `'1'`, `'4'`;
a space before a digit is its own token) and every upper-case letter one token, so a built-in task's
answer is as many tokens as characters, and a completion needs one token more for `</s>`:

    task                     longest answer              max_tokens it needs (answer + </s>)
    Addition(max_operand=9)  "18": 2 tokens              3      (Addition(99): 4, in general digits + 1)
    Copy(length=3)           3 letters                   4      (length + 1)
    Reverse(length=3)        3 letters                   4      (length + 1)
    SortDigits(length=4)     4 digits                    5      (length + 1)

`task.max_answer_tokens` says it (for any other task: the UTF-8 bytes of the longest answer the split's
probe finds, an upper bound). `RLConfig.max_tokens` and `evaluate(max_tokens=...)` default to
`default_max_tokens(task)` = `max(8, task.max_answer_tokens + 1)`, which covers every answer of every
built-in task at any length. Set `max_tokens` smaller only on purpose: an answer cut before `</s>` scores 0.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

SPLITS = ("train", "eval")


class RewardError(ValueError):
    """A task's reward function raised, or returned something that is not a finite number in [0, 1]."""


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # the reference answer: the SFT target, and what the reward checks against


def prompt_key(prompt: str) -> float:
    """A prompt's place in [0, 1) for the train/eval split: the first 8 bytes of its SHA-256 (stable across
    processes and machines, unlike Python's salted `hash()`)."""
    return int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big") / 2.0**64


class Task:
    """Base class (and protocol) of a task: override `make_problem`; `reward` if not an exact match."""

    name: str = "task"
    eval_fraction: float = 0.25  # the share of the task's prompts held out for evaluation (see the module doc)
    split_probe: int = 2048  # problems drawn (fixed seed) to find the threshold that gives that share

    def make_problem(self, rng: random.Random) -> Problem:
        raise NotImplementedError(f"{type(self).__name__} must implement make_problem(rng)")

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion.strip() == problem.answer)

    def shaped_reward(self, problem: Problem, completion: str) -> float:
        return self.reward(problem, completion)

    def problems(self, n: int, seed: int, split: str | None = "train") -> list[Problem]:
        """n problems from a fixed seed (the same seed always gives the same problems), all from `split`:
        "train" (the default; what the SFT and RL recipes draw), "eval" (prompts training never sees), or
        None (the whole space). Problems are drawn as before and those of the other split are passed over."""
        rng = random.Random(seed)
        if split is None:
            return [self.make_problem(rng) for _ in range(n)]
        if split not in SPLITS:
            raise ValueError(f"split must be 'train', 'eval' or None, not {split!r}")
        threshold = self._split_threshold()
        if split == "eval" and threshold <= 0.0:
            raise ValueError(
                f"task {self.name!r} has no eval split (eval_fraction={self.eval_fraction}, "
                f"{self.split_sizes()['probed']} distinct prompt(s)): nothing can be held out"
            )
        out, budget = [], 1000 + 100 * n
        while len(out) < n:
            if budget == 0:
                raise ValueError(
                    f"task {self.name!r}: drew {1000 + 100 * n} problems and found only {len(out)} "
                    f"of the {split!r} split (does make_problem draw only from its rng?)"
                )
            budget -= 1
            problem = self.make_problem(rng)
            if (prompt_key(problem.prompt) < threshold) == (split == "eval"):
                out.append(problem)
        return out

    def split_of(self, problem: Problem | str) -> str:
        """ "eval" or "train": which side of the held-out split a problem (or a prompt) is on."""
        prompt = problem.prompt if isinstance(problem, Problem) else problem
        return "eval" if prompt_key(prompt) < self._split_threshold() else "train"

    def split_sizes(self) -> dict[str, int]:
        """How the probe's distinct prompts divide: {"train": ..., "eval": ..., "probed": ...}. For a task
        whose whole space the probe sees (the built-ins), these are the sizes of the two splits."""
        threshold, keys = self._split_threshold(), self._probe_keys()
        n_eval = sum(k < threshold for k in keys)
        return {"train": len(keys) - n_eval, "eval": n_eval, "probed": len(keys)}

    @property
    def max_answer_tokens(self) -> int:
        """Tokens in the longest answer: exact for the built-in tasks with the built-in tokenizer; for any other
        task, the most UTF-8 bytes of an answer in the probe (a byte-level BPE never needs more tokens)."""
        return max(len(a.encode("utf-8")) for a in self._probe()[1])

    def _probe(self) -> tuple[list[float], list[str]]:
        """The sorted distinct prompt keys and the answers of `split_probe` problems drawn from a fixed seed.
        Cached per task, keyed by its settings (change an attribute and it is probed again)."""
        attrs = getattr(self, "__dict__", None)  # None: a class with __slots__, probed every time
        state = (
            self.eval_fraction,
            self.split_probe,
            tuple(sorted((k, repr(v)) for k, v in (attrs or {}).items() if not k.startswith("_split"))),
        )
        cached = attrs.get("_split_cache") if attrs is not None else None
        if cached is not None and cached[0] == state:
            return cached[1]
        rng = random.Random(0x5EED5)  # fixed: the same probe in every process
        problems = [self.make_problem(rng) for _ in range(self.split_probe)]
        probe = sorted({prompt_key(p.prompt) for p in problems}), sorted({p.answer for p in problems})
        if attrs is not None:
            attrs["_split_cache"] = (state, probe)
        return probe

    def _probe_keys(self) -> list[float]:
        return self._probe()[0]

    def _split_threshold(self) -> float:
        """Prompts whose key is below this are "eval" (0: there is no eval split)."""
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"task {self.name!r}: eval_fraction must lie in [0, 1), not {self.eval_fraction}")
        if self.eval_fraction == 0.0:
            return 0.0
        keys = self._probe_keys()
        m = len(keys)
        if m < 2:
            return 0.0
        k = min(max(round(self.eval_fraction * m), 1), m - 1)
        return (keys[k - 1] + keys[k]) / 2

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def default_max_tokens(task: Task) -> int:
    """The recipes' `max_tokens` when none is given: room for the task's longest answer and `</s>`, and never
    less than 8 (a wrong answer may run a little longer than the right one)."""
    return max(8, task.max_answer_tokens + 1)


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

    @property
    def max_answer_tokens(self) -> int:
        return len(str(2 * self.max_operand))  # one token per digit

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

    @property
    def max_answer_tokens(self) -> int:
        # one token per upper-case letter or digit; at most one per character for any ASCII alphabet
        return self.length if self.alphabet.isascii() else super().max_answer_tokens

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

    @property
    def max_answer_tokens(self) -> int:
        return self.length  # one token per digit

    def shaped_reward(self, problem: Problem, completion: str) -> float:
        return _char_credit(problem.answer, completion)


TASKS: dict[str, type[Task]] = {t.name: t for t in (Addition, Copy, Reverse, SortDigits)}
