"""One readable line from a pydantic `ValidationError`, for the configuration files the lab reads (the orchestrator's
groups, the Kubernetes launcher's launcher.json): each problem as `where: what`, an unknown key with the keys known
there, a missing one said so. (Environment variables have their own line in `settings.py`, which is below this.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

# pydantic's own words for a failed constraint, as "<field> must ..." (its `msg` is kept for every other type).
_MUST = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than_equal": "must be <= {le}",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "string_too_short": "must not be empty",
    "too_short": "must have at least {min_length}",
}


def one_line(e: ValidationError, root: Any, where: Callable[[tuple], str] | None = None) -> str:
    """`root`: the model (a pydantic model or dataclass) validated, whose fields an unknown key is checked against;
    `where(loc)`: how a problem's location reads (default: its keys joined by dots)."""
    place = where or (lambda loc: ".".join(str(p) for p in loc) or "(top level)")
    problems = []
    for err in e.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):  # a model's, a dataclass's
            known = known_keys(root, loc[:-1])
            what = "unknown key" + (f" (known: {', '.join(known)})" if known else "")
        elif err["type"] == "missing":
            what = "missing"
        elif err["type"] in _MUST:
            what = f"{_MUST[err['type']].format(**err.get('ctx', {}))}, got {err['input']!r}"
        else:
            what = err["msg"].removeprefix("Value error, ")
        at = place(loc)
        problems.append(f"{at}: {what}" if at else what)
    return "; ".join(problems)


def known_keys(root: Any, loc: tuple) -> list[str]:
    """The keys allowed in the object at `loc` (the path from `root` to it)."""
    model: Any = root
    for part in loc:
        if isinstance(part, str):
            field = _fields(model).get(part)
            model = _model_in(field) if field is not None else None
            if model is None:
                return []
    return sorted(_fields(model))


def _fields(model: Any) -> dict[str, Any]:
    """A model's field names and their annotations."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        return {n: f.annotation for n, f in model.model_fields.items()}
    return {n: f.annotation for n, f in model.__pydantic_fields__.items()}  # a pydantic dataclass


def _model_in(annotation: Any) -> Any:
    """The model inside an annotation such as `Claim | None` or `tuple[Group, ...]`."""
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
