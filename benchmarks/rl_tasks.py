"""Verifiable tasks written *outside* the recipes, for issue 14's "learning beyond the tuned tasks".

They are in the spirit of the built-in tasks (short digit and letter transformations, exact-match reward,
per-position partial credit for the advantages) but none of them is a built-in, and the recipes' defaults
(`openrl_lab.demo.demo_config`, the SFT warm-up) were never tuned on them: keep them out of any tuning loop,
so that their figures say how the defaults do on a task nobody tuned for.

    successor  "next BCA:" -> "CDB"   each letter of ABCD replaced by the next one (D wraps to A)
    increment  "inc 372:"  -> "483"   each digit plus one (9 wraps to 0)
    sortchars  "order CAB:" -> "ABC"  the letters sorted

Written only against the public Task API, as a user would in a notebook.
"""

from __future__ import annotations

import random

from openrl_lab.recipes import Problem, Task


def char_credit(answer: str, completion: str) -> float:
    """Partial credit: the share of positions that hold the right character (a length mismatch counts)."""
    completion = completion.strip()
    return sum(a == b for a, b in zip(answer, completion)) / max(len(answer), len(completion), 1)


class _Transform(Task):
    verb, alphabet, length = "", "", 3

    def transform(self, s: str) -> str:
        raise NotImplementedError

    def make_problem(self, rng: random.Random) -> Problem:
        s = "".join(rng.choice(self.alphabet) for _ in range(self.length))
        return Problem(prompt=f"{self.verb} {s}:", answer=self.transform(s))

    @property
    def max_answer_tokens(self) -> int:
        return self.length  # upper-case letters and digits are one token each for the built-in tokenizer

    def shaped_reward(self, problem: Problem, completion: str) -> float:
        return char_credit(problem.answer, completion)


class Successor(_Transform):
    """Each letter replaced by the next one in ABCD (D wraps to A): "next BCA:" -> "CDB"."""

    name, verb, alphabet = "successor", "next", "ABCD"

    def transform(self, s: str) -> str:
        return "".join(self.alphabet[(self.alphabet.index(c) + 1) % len(self.alphabet)] for c in s)


class Increment(_Transform):
    """Each digit plus one (9 wraps to 0): "inc 372:" -> "483"."""

    name, verb, alphabet = "increment", "inc", "0123456789"

    def transform(self, s: str) -> str:
        return "".join(str((int(c) + 1) % 10) for c in s)


class SortChars(_Transform):
    """The letters sorted: "order CAB:" -> "ABC"."""

    name, verb, alphabet = "sortchars", "order", "ABCD"

    def transform(self, s: str) -> str:
        return "".join(sorted(s))


NEW_TASKS: dict[str, type[Task]] = {t.name: t for t in (Successor, Increment, SortChars)}
