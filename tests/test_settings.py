"""The environment variables (openrl_lab/settings.py): one module reads them, each documented, and a bad value
anywhere is one line naming the variable, at start, in every entry point."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrl_lab.settings import Settings, SettingsError, settings
from openrl_lab.tools import settings_doc

ROOT = Path(__file__).resolve().parents[1]


def test_the_doc_is_what_the_settings_render():
    committed = (ROOT / settings_doc.DOC).read_text()
    assert committed == settings_doc.render(), f"docs/settings.md is stale: run `{settings_doc.COMMAND}`"
    for field in Settings.model_fields.values():
        assert field.description, f"{field.validation_alias} has no description"
        assert str(field.validation_alias).startswith("OPENRL_")


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """`os.environ.get("OPENRL_...")`, `os.environ["OPENRL_..."]` (read), `os.getenv("OPENRL_...")`."""
    found = []
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = ast.unparse(node.func.value)
            if (owner == "os.environ" and node.func.attr == "get") or (owner == "os" and node.func.attr == "getenv"):
                target = node.args[0]
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Load)
            and ast.unparse(node.value) == "os.environ"
        ):
            target = node.slice
        if isinstance(target, ast.Constant) and str(target.value).startswith("OPENRL_"):
            found.append((node.lineno, target.value))
    return found


def test_no_module_reads_an_openrl_variable_past_the_settings():
    reads = {}
    for path in sorted((ROOT / "openrl_lab").rglob("*.py")):
        if path.name == "settings.py" and path.parent.name == "openrl_lab":
            continue
        found = _environment_reads(ast.parse(path.read_text()))
        if found:
            reads[str(path.relative_to(ROOT))] = found
    assert not reads, f"read these through openrl_lab.settings.settings() instead: {reads}"
    # and the scan itself sees such a read
    assert _environment_reads(ast.parse('import os\nx = os.environ.get("OPENRL_X")\ny = os.environ["OPENRL_Y"]'))


def test_values_are_parsed_and_an_empty_variable_is_unset(monkeypatch):
    monkeypatch.setenv("OPENRL_KERNEL_MEMORY_BYTES", "1.5 GiB")
    monkeypatch.setenv("OPENRL_KERNEL_THREADS", "auto")
    monkeypatch.setenv("OPENRL_LAB_TOKENIZER_PATHS", "0")
    monkeypatch.setenv("OPENRL_KERNEL_LOST_AFTER_S", "")
    s = settings()
    assert s.kernel_memory_bytes == 3 << 29 and s.kernel_threads == "auto" and s.lab_tokenizer_paths is False
    assert s.kernel_lost_after_s == Settings.model_fields["kernel_lost_after_s"].default
    monkeypatch.setenv("OPENRL_KERNEL_THREADS", "3")
    assert settings().kernel_threads == 3
    assert "OPENRL_KERNEL_AUTHKEY" not in repr(Settings(OPENRL_KERNEL_AUTHKEY="secret"))  # keys are not shown
    assert "secret" not in repr(Settings(OPENRL_KERNEL_AUTHKEY="secret"))


@pytest.mark.parametrize(
    "name, value, said",
    [
        ("OPENRL_KERNEL_LOST_AFTER_S", "abc", "OPENRL_KERNEL_LOST_AFTER_S='abc': Input should be a valid number"),
        ("OPENRL_KERNEL_LOST_AFTER_S", "-1", "OPENRL_KERNEL_LOST_AFTER_S='-1': Input should be greater than 0"),
        ("OPENRL_KERNEL_MEMORY_BYTES", "lots", "OPENRL_KERNEL_MEMORY_BYTES='lots': 'lots' is not a size"),
        ("OPENRL_KERNEL_THREADS", "0", "OPENRL_KERNEL_THREADS='0': Input should be greater than or equal to 1"),
        ("OPENRL_VLLM_LORA", "both", "OPENRL_VLLM_LORA='both': Input should be 'adapter' or 'merge'"),
        ("OPENRL_LAB_NO_WARMUP", "maybe", "OPENRL_LAB_NO_WARMUP='maybe': Input should be a valid boolean"),
        ("OPENRL_LAB_MODELS", "acme=/models", "OPENRL_LAB_MODELS: not valid JSON (it takes a JSON object)"),
        ("OPENRL_LAB_MODELS", '{"acme": 3}', "OPENRL_LAB_MODELS=3: Input should be a valid string"),
    ],
)
def test_a_bad_value_is_one_line_that_names_the_variable(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as e:
        settings()
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


@pytest.mark.server  # starts the programs
@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "openrl_lab.cli", "serve", "--home", "{home}"],
        ["-m", "openrl_lab.cli", "keys", "list", "--home", "{home}"],
        ["-m", "openrl_lab.kernel", "--home", "{home}"],
        ["-m", "openrl_lab.kernel", "join", "--control-plane", "127.0.0.1:1"],
        ["-m", "openrl_lab.orchestrator"],
        ["-m", "openrl_lab.cli", "orchestrator"],
    ],
    ids=["serve", "keys", "kernel", "kernel-join", "orchestrator", "cli-orchestrator"],
)
def test_every_entry_point_stops_at_start_with_that_line(tmp_path, argv):
    env = {**os.environ, "OPENRL_KERNEL_LOST_AFTER_S": "abc", "OPENRL_KERNEL_AUTHKEY": "k" * 64}
    argv = [a.format(home=tmp_path / "home") for a in argv]
    out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr  # no traceback
    assert "OPENRL_KERNEL_LOST_AFTER_S='abc': Input should be a valid number" in lines[0]
    assert not (tmp_path / "home").exists()  # it stopped before it made anything
