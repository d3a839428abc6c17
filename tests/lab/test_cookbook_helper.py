"""openrl_lab.lab.cookbook's pieces that need no cookbook: how a recipe is found and started, and how its
metrics file is read while the recipe writes it. (The recipes themselves run in tests/cookbook, in the cookbook's
environment, and in notebooks/07-tinker-cookbook.ipynb.)"""

from __future__ import annotations

import json
import sys

import pytest

from openrl_lab.lab import cookbook
from openrl_lab.lab.cookbook import CookbookError, find_python, read_metrics, recipe_command, recipe_env, recipe_module


def test_recipe_command_is_what_a_cookbook_user_types():
    cmd = recipe_command(
        "/py",
        "math_rl",
        "http://127.0.0.1:8000",
        "/logs/rl",
        "extra=1",
        group_size=8,
        compute_post_kl=True,
        model="openrl-lab/tiny-llama-10m",
    )
    assert cmd == [
        "/py",
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        "base_url=http://127.0.0.1:8000",
        "model_name=openrl-lab/tiny-llama-10m",
        "renderer_name=role_colon",
        "log_path=/logs/rl",
        "extra=1",
        "group_size=8",
        "compute_post_kl=true",
    ]
    assert recipe_module("my_pkg.recipes.train") == "my_pkg.recipes.train"
    assert recipe_module("sl_basic") == "tinker_cookbook.recipes.sl_basic"  # a one-file recipe


def test_a_hub_named_model_gets_the_cookbooks_own_renderer():
    """A model served under a name the cookbook knows gets no renderer_name (the cookbook picks its own, as on
    hosted Tinker); the lab's own models get role_colon; an explicit choice, or None for none, is kept."""
    qwen = recipe_command("/py", "chat_sl", "http://h", "/l", model="Qwen/Qwen3-8B")
    assert not any(a.startswith("renderer_name=") for a in qwen) and "model_name=Qwen/Qwen3-8B" in qwen
    assert "renderer_name=qwen3_disable_thinking" in recipe_command(
        "/py", "chat_sl", "http://h", "/l", model="Qwen/Qwen3-8B", renderer="qwen3_disable_thinking"
    )
    ours = recipe_command("/py", "chat_sl", "http://h", "/l", renderer=None)
    assert not any(a.startswith("renderer_name=") for a in ours)


def test_recipe_env_points_the_hub_at_the_lab(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = recipe_env("http://127.0.0.1:9", "key-1", "/tmp/hf")
    assert env["HF_ENDPOINT"] == "http://127.0.0.1:9/hf" and env["HF_TOKEN"] == env["TINKER_API_KEY"] == "key-1"
    assert "HF_HUB_OFFLINE" not in env and env["HF_HOME"] == "/tmp/hf" and env["WANDB_MODE"] == "disabled"


def test_read_metrics_leaves_a_half_written_line_for_later(tmp_path):
    assert read_metrics(tmp_path) == []  # before the recipe's first write
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "loss": 2.0}) + "\n" + '{"step": 1, "lo')
    assert read_metrics(tmp_path) == [{"step": 0, "loss": 2.0}]
    path.write_text(path.read_text() + 'ss": 1.5}\n')
    assert read_metrics(tmp_path, skip=1) == [{"step": 1, "loss": 1.5}]


def test_find_python_says_how_to_get_the_cookbook(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cookbook.PYTHON_ENV_VAR, raising=False)
    monkeypatch.setattr(cookbook, "CHECKOUT", tmp_path / "elsewhere")
    monkeypatch.setitem(sys.modules, "tinker_cookbook", None)  # as in the lab's environment: not importable
    with pytest.raises(CookbookError, match="make cookbook-env"):
        find_python()
    with pytest.raises(CookbookError, match="no Python at /nowhere/python"):
        find_python("/nowhere/python")
    venv = tmp_path / "project" / ".venv-cookbook" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").touch()
    monkeypatch.chdir(tmp_path / "project")
    assert find_python() == str(venv / "python")  # found from the working directory (a notebook's folder)
    monkeypatch.setenv(cookbook.PYTHON_ENV_VAR, sys.executable)
    assert find_python() == sys.executable  # the variable wins
