"""Verifiable tasks written *outside* the recipes, for issue 14's "learning beyond the tuned tasks".

They are in the spirit of the built-in tasks (short digit and letter transformations, exact-match reward,
per-position partial credit for the advantages) but none of them is a built-in, and the recipes' defaults
(`openrl_lab.demo.demo_config`, the SFT warm-up) were never tuned on them: keep them out of any tuning loop,
so that their figures say how the defaults do on a task nobody tuned for.

    successor  "next BCA:" -> "CDB"   each letter of ABCD replaced by the next one (D wraps to A)
    increment  "inc 372:"  -> "483"   each digit plus one (9 wraps to 0)
    sortchars  "order CAB:" -> "ABC"  the letters sorted

and a pool of nine more (`FRESH_POOL`), from which `fresh_tasks(seed)` draws the tasks that check the defaults
once they are frozen; and `UNSEEN_49` (parity, halve, lastfill), written for issue 49 and not run before its
anti-collapse defaults are frozen.

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


# --- the fresh pool: written before the recipes' defaults were frozen, never run while choosing them -------------
# Issue 14's check of the frozen defaults runs on tasks drawn from this pool by a seed chosen after freezing
# (`fresh_tasks`), so that no tuning loop saw them. Each is again a short letter or digit transformation with an
# exact-match reward and per-position partial credit; several need the whole string at every position, as sorting
# does.


class Rotate(_Transform):
    """The letters rotated left by one: "rot ABC:" -> "BCA"."""

    name, verb, alphabet = "rotate", "rot", "ABCD"

    def transform(self, s: str) -> str:
        return s[1:] + s[:1]


class SortDesc(_Transform):
    """The letters sorted, largest first: "desc CAB:" -> "CBA"."""

    name, verb, alphabet = "sortdesc", "desc", "ABCD"

    def transform(self, s: str) -> str:
        return "".join(sorted(s, reverse=True))


class MaxFill(_Transform):
    """Every position holds the largest letter: "max CAB:" -> "CCC"."""

    name, verb, alphabet = "maxfill", "max", "ABCD"

    def transform(self, s: str) -> str:
        return max(s) * len(s)


class FirstFill(_Transform):
    """Every position holds the first letter: "fill BCA:" -> "BBB"."""

    name, verb, alphabet = "firstfill", "fill", "ABCD"

    def transform(self, s: str) -> str:
        return s[0] * len(s)


class Predecessor(_Transform):
    """Each letter replaced by the one before it in ABCD (A wraps to D): "prev BCA:" -> "ABD"."""

    name, verb, alphabet = "predecessor", "prev", "ABCD"

    def transform(self, s: str) -> str:
        return "".join(self.alphabet[(self.alphabet.index(c) - 1) % len(self.alphabet)] for c in s)


class Complement(_Transform):
    """Each digit d becomes 9 - d: "neg 372:" -> "627"."""

    name, verb, alphabet = "complement", "neg", "0123456789"

    def transform(self, s: str) -> str:
        return "".join(str(9 - int(c)) for c in s)


class Double(_Transform):
    """Each digit doubled, mod 10: "dbl 372:" -> "644"."""

    name, verb, alphabet = "double", "dbl", "0123456789"

    def transform(self, s: str) -> str:
        return "".join(str(2 * int(c) % 10) for c in s)


class PrefixSum(_Transform):
    """Running sums of the digits, mod 10: "cum 372:" -> "302"."""

    name, verb, alphabet = "prefixsum", "cum", "0123456789"

    def transform(self, s: str) -> str:
        total, out = 0, []
        for c in s:
            total = (total + int(c)) % 10
            out.append(str(total))
        return "".join(out)


class SwapPairs(_Transform):
    """Four letters, each pair swapped: "swap ABCD:" -> "BADC"."""

    name, verb, alphabet, length = "swappairs", "swap", "ABCD", 4

    def transform(self, s: str) -> str:
        return s[1] + s[0] + s[3] + s[2]


# Issue 49's three, written before any anti-collapse default of RLConfig is frozen and not run until then: the check
# of those defaults on tasks nobody tuned them on (docs/recipes.md). Keep them out of every tuning run.
class Parity(_Transform):
    """Each digit's parity: "par 372:" -> "110"."""

    name, verb, alphabet = "parity", "par", "0123456789"

    def transform(self, s: str) -> str:
        return "".join(str(int(c) % 2) for c in s)


class Halve(_Transform):
    """Each digit halved, rounded down: "half 372:" -> "131"."""

    name, verb, alphabet = "halve", "half", "0123456789"

    def transform(self, s: str) -> str:
        return "".join(str(int(c) // 2) for c in s)


class LastFill(_Transform):
    """Every position holds the last letter: "last BCA:" -> "AAA"."""

    name, verb, alphabet = "lastfill", "last", "ABCD"

    def transform(self, s: str) -> str:
        return s[-1] * len(s)


UNSEEN_49: tuple[type[Task], ...] = (Parity, Halve, LastFill)

FRESH_POOL: tuple[type[Task], ...] = (
    Rotate,
    SortDesc,
    MaxFill,
    FirstFill,
    Predecessor,
    Complement,
    Double,
    PrefixSum,
    SwapPairs,
)


def fresh_tasks(seed: int, k: int = 3) -> list[type[Task]]:
    """k tasks of the fresh pool, drawn by `seed` (chosen after the defaults were frozen)."""
    return random.Random(seed).sample(list(FRESH_POOL), k)


NEW_TASKS: dict[str, type[Task]] = {t.name: t for t in (Successor, Increment, SortChars, *FRESH_POOL, *UNSEEN_49)}
