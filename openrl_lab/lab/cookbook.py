"""tinker-cookbook recipes against the lab, from a notebook: run one unchanged, watch its metrics live.

    from openrl_lab.lab import Lab
    from openrl_lab.lab.cookbook import CookbookRun

    run = CookbookRun.start(Lab.connect(), "math_rl", "/tmp/cookbook/math_rl", env="arithmetic", group_size=8,
                            groups_per_batch=8, lora_rank=8, max_tokens=4, max_steps=20)
    display(run.plot(["env/all/reward/total"]))   # follows the recipe's metrics.jsonl as it grows
    run.wait()                                    # raises CookbookError with the log's tail if the recipe failed
    run.metrics()                                 # one row per logged step (pandas)

The cookbook (0.5.8, the newest that installs beside tinker 0.38.0) pins a transformers below the lab's band, so it
lives in an environment of its own (`make cookbook-env` makes `.venv-cookbook`) and its recipes run there as child
processes, exactly as a user runs them: `python -m tinker_cookbook.recipes.<recipe>.train key=value ...`. What
makes them work against the lab (docs/tinker-compatibility.md, "tinker-cookbook"):
- `base_url` and the key (`TINKER_API_KEY`) of this lab;
- for the lab's built-in models, `renderer_name=role_colon`: the cookbook picks a renderer from its own table of
  hub names otherwise, and those are not in it ("Unknown model: openrl-lab/tiny-llama-1m"); a model served under
  a hub name the cookbook knows (`Qwen/Qwen3-8B`) gets the cookbook's own renderer for it, as on hosted Tinker;
- the tokenizer from the lab's Hugging Face mirror (`HF_ENDPOINT=<base_url>/hf`, `HF_TOKEN=<key>`): the cookbook
  loads `AutoTokenizer.from_pretrained(model_name)` itself.
Datasets: recipes that read hub datasets need a local file instead (chat_sl's `dataset=<file>.jsonl`); math_rl's
`env=arithmetic` makes its own problems.

Standard library only at import time: the cookbook's own environment imports this module too (its tests build
their command lines here), and it holds openrl-lab without its dependencies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openrl_lab.home import DEFAULT_MODEL
from openrl_lab.sandbox.client import sandbox_url
from openrl_lab.settings import settings

RENDERER = "role_colon"  # for the lab's own models, which the cookbook's model table does not know
AUTO = "auto"  # role_colon for the lab's own models, else the cookbook's recommended renderer for the name
# Recipes that are one module (`recipes/sl_basic.py`), not a package with a train module.
SINGLE_FILE_RECIPES = frozenset({"sl_basic", "rl_basic", "sl_loop", "rl_loop"})
PYTHON_ENV_VAR = "OPENRL_COOKBOOK_PYTHON"
CHECKOUT = Path(__file__).resolve().parents[2]  # where `make cookbook-env` puts .venv-cookbook (an editable install)
FOLLOW_POLL_S = 0.5


class CookbookError(RuntimeError):
    """The cookbook's environment is missing, or a recipe failed (the message ends with its log's last lines)."""


def find_python(python: str | os.PathLike | None = None) -> str:
    """The Python of the cookbook's environment: `python`, else $OPENRL_COOKBOOK_PYTHON, else a `.venv-cookbook`
    in the working directory, one of its parents, or the checkout this package runs from, else this Python if it
    has tinker_cookbook."""
    candidates = [python, settings().cookbook_python]
    here = Path.cwd().resolve()
    candidates += [d / ".venv-cookbook" / "bin" / "python" for d in (here, *here.parents)]
    candidates.append(CHECKOUT / ".venv-cookbook" / "bin" / "python")
    for c in candidates:
        if c and Path(c).exists():
            return str(c)
    if python:
        raise CookbookError(f"no Python at {python}")
    try:
        import tinker_cookbook  # noqa: F401  # pyright: ignore[reportMissingImports] - an environment that has both

        return sys.executable
    except ImportError:
        raise CookbookError(
            "tinker-cookbook is not installed here and no .venv-cookbook was found: run `make "
            f"cookbook-env` in the checkout, or set ${PYTHON_ENV_VAR} (or python=) to the Python of "
            "an environment with tinker-cookbook 0.5.8"
        ) from None


def recipe_module(recipe: str) -> str:
    """ "math_rl" -> "tinker_cookbook.recipes.math_rl.train", "sl_basic" -> "tinker_cookbook.recipes.sl_basic"; a
    dotted module name is used as it is."""
    if "." in recipe:
        return recipe
    return f"tinker_cookbook.recipes.{recipe}" + ("" if recipe in SINGLE_FILE_RECIPES else ".train")


def renderer_for(model: str, renderer: str | None = AUTO) -> str | None:
    """The renderer_name to pass (None: none, so the cookbook picks its own for the model's name)."""
    if renderer != AUTO:
        return renderer
    return RENDERER if model.startswith("openrl-lab/") else None


def recipe_env(base_url: str, api_key: str, hf_home: str | os.PathLike) -> dict[str, str]:
    """The recipe's environment: this lab's key, the lab's /hf mirror as the hub (for the tokenizer), the lab's
    sandbox for code rewards (SANDBOX_URL: code_rl's SandboxFusion client), a private Hugging Face cache, no
    wandb."""
    env = dict(
        os.environ,
        TINKER_API_KEY=api_key,
        SANDBOX_URL=sandbox_url(base_url, api_key),
        HF_ENDPOINT=f"{base_url}/hf",
        HF_TOKEN=api_key,
        HF_HOME=str(hf_home),
        WANDB_MODE="disabled",
        TINKER_TELEMETRY="0",
    )
    env.pop("HF_HUB_OFFLINE", None)  # the mirror is the hub here
    return env


def recipe_command(
    python: str,
    recipe: str,
    base_url: str,
    log_path: str | os.PathLike,
    *args: str,
    model: str = DEFAULT_MODEL,
    renderer: str | None = AUTO,
    **options: Any,
) -> list[str]:
    """`python -m <recipe's module> base_url=... model_name=... [renderer_name=...] log_path=... key=value ...`
    (`renderer`: see `renderer_for`)."""
    settings = [f"{k}={_value(v)}" for k, v in options.items()]
    chosen = renderer_for(model, renderer)
    return [
        python,
        "-m",
        recipe_module(recipe),
        f"base_url={base_url}",
        f"model_name={model}",
        *([f"renderer_name={chosen}"] if chosen is not None else []),
        f"log_path={log_path}",
        *args,
        *settings,
    ]


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def read_metrics(log_path: str | os.PathLike, skip: int = 0) -> list[dict]:
    """The rows of the recipe's metrics.jsonl after the first `skip` lines (a line still being written is left
    for the next read)."""
    path = Path(log_path) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[skip:]
    rows = []
    for line in lines[:-1]:  # the text after the last newline is incomplete (or empty)
        rows.append(json.loads(line) if line.strip() else {})
    return rows


class CookbookRun:
    """One cookbook recipe running as a child process against a lab (see the module's docstring)."""

    def __init__(self, process: subprocess.Popen, log_path: Path, command: list[str], output: Path):
        self.process, self.log_path, self.command, self.output = process, log_path, command, output
        self._plots: list = []

    @classmethod
    def start(
        cls,
        lab,
        recipe: str,
        log_path: str | os.PathLike,
        *args: str,
        python: str | None = None,
        model: str = DEFAULT_MODEL,
        renderer: str | None = AUTO,
        **options: Any,
    ) -> CookbookRun:
        """Starts `recipe` ("math_rl", "chat_sl", ... or a module name) with `options` as its key=value settings,
        writing into `log_path` (a new run refuses an existing log directory unless behavior_if_log_dir_exists
        says otherwise, as the cookbook does)."""
        log_path = Path(log_path).expanduser().resolve()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        py = find_python(python)
        command = recipe_command(py, recipe, lab.base_url, log_path, *args, model=model, renderer=renderer, **options)
        output = log_path.parent / f"{log_path.name}.output.log"  # beside: the recipe owns log_path itself
        env = recipe_env(lab.base_url, lab.connection.api_key, log_path.parent / "hf-cache")
        with output.open("w") as out:
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        return cls(process, log_path, command, output)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the recipe to end; raises CookbookError (with its output's last lines) if it failed."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise CookbookError(f"{self.command[2]} still runs after {timeout:g} s ({self.output})") from None
        for plot in self._plots:
            plot.flush()
        if code != 0:
            raise CookbookError(
                f"{self.command[2]} failed (exit {code}); the last lines of {self.output}:\n" + self.tail()
            )
        return code

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the recipe (SIGTERM, then SIGKILL after `timeout`)."""
        if self.running:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output.read_text(errors="replace").splitlines()[-lines:]) if self.output.exists() else ""

    def metrics(self):
        """Every row the recipe logged so far, one per step (pandas)."""
        import pandas as pd

        return pd.DataFrame([r for r in read_metrics(self.log_path) if "step" in r])

    def plot(self, metrics: Sequence[str] | None = None, *, title: str | None = None, **kw):
        """A LivePlot of the recipe's metrics (all numeric ones, or `metrics`), fed from metrics.jsonl by a
        background thread until the recipe ends (one last read then) or the plot is closed."""
        from openrl_lab.lab.widgets import LivePlot

        plot = LivePlot(metrics, title=title or f"{self.command[2]} ({self.log_path.name})", **kw)
        self._plots.append(plot)
        threading.Thread(
            target=self._follow, args=(plot, metrics), daemon=True, name=f"cookbook-follow-{self.log_path.name}"
        ).start()
        return plot

    def _follow(self, plot, metrics: Sequence[str] | None) -> None:
        seen = 0
        while not plot.closed:
            ended = not self.running
            rows = read_metrics(self.log_path, skip=seen)
            seen += len(rows)
            for row in rows:
                values = {
                    k: float(v)
                    for k, v in row.items()
                    if k != "step"
                    and (metrics is None or k in metrics)
                    and isinstance(v, (int, float))
                    and not isinstance(v, bool)
                }
                if "step" in row and values:
                    plot.append(int(row["step"]), **values)
            if ended:
                plot.flush()
                return
            time.sleep(FOLLOW_POLL_S)

    def __repr__(self) -> str:
        state = "running" if self.running else f"exit {self.process.returncode}"
        return f"CookbookRun({self.command[2]}, {state}, log {self.log_path})"
