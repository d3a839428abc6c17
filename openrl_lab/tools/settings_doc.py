"""docs/settings.md, rendered from `openrl_lab.settings.Settings`: every OPENRL_* variable, its type, default and
meaning. tests/test_settings.py checks that the committed doc is what this renders. Regenerate it (from the
repository root) with

    python -m openrl_lab.tools.settings_doc
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path

from pydantic_core import PydanticUndefined

from openrl_lab.settings import Settings

DOC = Path("docs/settings.md")
COMMAND = "python -m openrl_lab.tools.settings_doc"
GROUPS = (
    ("lab_", "The lab: control plane and clients"),
    ("cookbook_", None),
    ("sandbox_", "The sandbox service (`/sandbox/run_code`: model-written code run in isolation)"),
    ("kernel_", "Kernels"),
    ("orchestrator_", None),
    ("vllm_", "The vLLM sampler (a kernel started with `--sampler vllm`)"),
)


def _takes(name: str, annotation) -> str:
    """What a variable takes, in words: seconds, a size, a number, text, a path, 1 or 0, or its choices."""
    if name.endswith("_bytes"):
        return "a size"
    if name.endswith("_s"):
        return "seconds"
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = []
    for arg in typing.get_args(annotation) if union else (annotation,):
        bare = typing.get_args(arg)[0] if typing.get_origin(arg) is typing.Annotated else arg
        if bare is type(None):
            continue
        if typing.get_origin(bare) is typing.Literal:
            kinds += [f"`{v}`" for v in typing.get_args(bare)]
        elif typing.get_origin(bare) is dict:
            kinds.append("a JSON object")
        else:
            kinds.append({bool: "1 or 0", int: "an integer", float: "a number", str: "text", Path: "a path"}[bare])
    return " or ".join(kinds)


def _default(name: str, field) -> str:
    value = field.default
    if value is PydanticUndefined or value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{int(value)}`"
    if value == {}:
        return "unset"
    if name.endswith("_bytes") and value % (1 << 30) == 0:
        return f"`{value >> 30}GiB`"
    return f"`{value}`"


def render() -> str:
    lines = [
        "# Settings: the environment variables",
        "",
        f"Generated from `openrl_lab/settings.py` by `{COMMAND}`; do not edit by hand.",
        "",
        "Every `OPENRL_*` variable the lab reads. Each is validated when a program starts (`openrl-lab ...`, a",
        "kernel, the orchestrator): a bad value stops it with one line that names the variable, the value and what",
        "it takes, e.g. `openrl-lab: OPENRL_KERNEL_LOST_AFTER_S='abc': Input should be a valid number ...`. An empty",
        "variable counts as unset. Sizes take bytes or a unit (`512MiB`, `16GiB`); switches take 1/0, true/false.",
    ]
    for prefix, title in GROUPS:
        if title:
            lines += ["", f"## {title}", "", "| variable | takes | default | what it does |", "|---|---|---|---|"]
        for name, field in Settings.model_fields.items():
            if name.startswith(prefix):
                kind = _takes(name, field.annotation)
                meaning = (field.description or "").replace("|", "\\|")
                lines.append(f"| `{field.validation_alias}` | {kind} | {_default(name, field)} | {meaning} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Regenerate docs/settings.md.")
    parser.add_argument("path", nargs="?", type=Path, default=DOC, help=f"where to write it (default: {DOC})")
    args = parser.parse_args(argv)
    args.path.write_text(render())
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
