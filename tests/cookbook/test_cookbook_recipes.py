"""tinker-cookbook's own recipes, unchanged, against a real lab.

Runs in the cookbook's environment (`make cookbook-env`: tinker-cookbook 0.5.8 pins a transformers below the
lab's band). The lab runs from the main environment (`.venv/bin/python`, through LabServer(python=...)); each
recipe runs as a user would run it, `python -m tinker_cookbook.recipes.<recipe>.train key=value ...`, with:

- on the lab's built-in Llama, `renderer_name=role_colon`: the cookbook picks a renderer from its own model table
  otherwise, and `openrl-lab/tiny-llama-1m` is not in it ("Unknown model: ...");
- on a model served under a name the cookbook knows (the Qwen3 stand-in, `openrl_lab.train.families`, cached as
  `Qwen/Qwen3-8B` the way a download leaves it), no renderer_name: the recipe picks its own (`qwen3`), with the
  real Qwen tokenizer the lab's mirror serves;
- the tokenizer from the lab's /hf mirror (`HF_ENDPOINT=<base_url>/hf`, `HF_TOKEN=<key>`): the cookbook loads
  `AutoTokenizer.from_pretrained(model_name)` itself, and no hub is reachable;
- a small local dataset the test writes (chat_sl's `dataset=<file>.jsonl`); math_rl's `env=arithmetic`
  generates its problems and needs no dataset. sl_basic and rl_basic read hub datasets (no_robots, gsm8k) that no
  test can reach: their dataset builder is swapped on the command line (chz), the recipe otherwise as it is.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from openrl_lab.lab import Lab
from openrl_lab.lab.connection import find_connection
from openrl_lab.lab.cookbook import CookbookError, CookbookRun, recipe_command, recipe_env
from openrl_lab.server import LabServer
from openrl_lab.train.families import build_with

MODEL = "openrl-lab/tiny-llama-1m"
QWEN = "Qwen/Qwen3-8B"
LLAMA3 = "meta-llama/Llama-3.1-8B-Instruct"
REPO = Path(__file__).resolve().parents[2]
# the lab's own environment: the cookbook's transformers is outside the lab's band
LAB_PYTHON = os.environ.get("OPENRL_TEST_LAB_PYTHON", str(REPO / ".venv" / "bin" / "python"))

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not os.path.exists(LAB_PYTHON):
        pytest.fail(
            f"the lab's environment is missing: {LAB_PYTHON} (run `make install`, or set OPENRL_TEST_LAB_PYTHON)"
        )
    with LabServer(tmp_path_factory.mktemp("cookbook-lab"), python=LAB_PYTHON) as server:
        yield server


@pytest.fixture(scope="module")
def qwen_lab(tmp_path_factory):
    """A lab serving the Qwen3 stand-in by its hub name, from a Hugging Face cache it was put in by the lab's own
    command line (in the lab's environment: the real vocabulary comes from a test dependency there)."""
    root = tmp_path_factory.mktemp("cookbook-qwen3")
    hf_home = root / "hf"
    build_with(LAB_PYTHON, QWEN, root / "model", hf_home)
    with LabServer(root / "home", python=LAB_PYTHON, args=("--model", QWEN), env={"HF_HOME": str(hf_home)}) as server:
        yield server


@pytest.fixture(scope="module")
def llama3_lab(tmp_path_factory):
    """A lab serving the Llama 3.1 Instruct stand-in (the real Llama 3 vocabulary) by its hub name, its tokenizer
    also under the repo the cookbook loads every Llama 3's from (`serve --tokenizer-alias`)."""
    root = tmp_path_factory.mktemp("cookbook-llama3")
    hf_home = root / "hf"
    build_with(LAB_PYTHON, LLAMA3, root / "model", hf_home)
    args = ("--model", LLAMA3, "--tokenizer-alias", f"thinkingmachineslabinc/meta-llama-3-instruct-tokenizer={LLAMA3}")
    with LabServer(root / "home", python=LAB_PYTHON, args=args, env={"HF_HOME": str(hf_home)}) as server:
        yield server


def run_recipe(lab, module: str, log_path: Path, *args: str, timeout: float = 240, model: str = MODEL) -> str:
    """`python -m <module> args...` in this (the cookbook's) environment, pointed at the lab as
    `openrl_lab.lab.cookbook` points a notebook's recipe; its output."""
    env = recipe_env(lab.base_url, lab.api_key, log_path.parent / "hf-client")
    cmd = recipe_command(sys.executable, module, lab.base_url, log_path, *args, model=model)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{module} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}"
    return out.stdout + out.stderr


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def checkpoints(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]


def lab_checkpoints(lab) -> set[str]:
    import tinker

    found = tinker.RestClient(base_url=lab.base_url, api_key=lab.api_key).list_user_checkpoints(limit=1000).result()
    return {c.tinker_path for c in found.checkpoints}


def write_conversations(path: Path, n: int) -> Path:
    """A tiny chat dataset in the cookbook's conversation format: one fixed answer to learn."""
    with path.open("w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"Say hello {i % 7}."},
                            {"role": "assistant", "content": "hello hello hello"},
                        ]
                    }
                )
                + "\n"
            )
    return path


def test_chat_sl_trains_saves_and_resumes(lab, tmp_path):
    data = write_conversations(tmp_path / "chat.jsonl", 64)
    log = tmp_path / "chat_sl"
    common = (
        "tinker_cookbook.recipes.chat_sl.train",
        log,
        f"dataset={data}",
        "batch_size=8",
        "lora_rank=8",
        "learning_rate=5e-3",
        "lr_schedule=constant",
        "max_length=64",
        "save_every=3",
        "eval_every=0",
        "num_epochs=2",
    )
    run_recipe(lab, *common, "max_steps=6", "behavior_if_log_dir_exists=raise")
    rows = metrics(log)
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 6 and all(math.isfinite(x) for x in nll), rows
    assert nll[-1] < nll[0], nll
    saved = checkpoints(log)
    assert saved and saved[-1]["state_path"].startswith("tinker://"), saved
    in_lab = lab_checkpoints(lab)
    assert saved[-1]["state_path"] in in_lab, (saved, in_lab)

    # an interrupted run: as if killed after the step-3 save (the "final" record marks a finished run, which
    # resume leaves alone). The same command told to resume picks up from that checkpoint in the lab, weights
    # and optimizer. The recipe submits a step ahead before it saves, so that checkpoint holds the updates of
    # steps 0-3 at least (one later step too, in tinker's order of requests): the replayed step 3 starts from
    # trained weights, not fresh ones.
    mid = [c for c in saved if c["name"] != "final"][-1]
    (log / "checkpoints.jsonl").write_text(json.dumps(mid) + "\n")
    out = run_recipe(lab, *common, "max_steps=6", "behavior_if_log_dir_exists=resume")
    assert f"Resumed training from {mid['state_path']}" in out, out[-3000:]
    resumed = [r for r in metrics(log)[len(rows) :] if "train_mean_nll" in r]
    assert [r["step"] for r in resumed] == list(range(mid["batch"], 6)), resumed
    assert resumed[0]["train_mean_nll"] < nll[mid["batch"]] - 0.1, (resumed, nll)
    assert all(math.isfinite(r["train_mean_nll"]) for r in resumed)
    assert checkpoints(log)[-1]["name"] == "final"


def test_math_rl_arithmetic_runs_steps_with_rewards(lab, tmp_path):
    log = tmp_path / "math_rl"
    run_recipe(
        lab,
        "tinker_cookbook.recipes.math_rl.train",
        log,
        "env=arithmetic",
        "group_size=4",
        "groups_per_batch=2",
        "lora_rank=8",
        "learning_rate=1e-3",
        "max_tokens=4",
        "max_steps=2",
        "save_every=1",
        "eval_every=0",
        "behavior_if_log_dir_exists=raise",
    )
    steps = [r for r in metrics(log) if "env/all/reward/total" in r]
    assert [r["step"] for r in steps] == [0, 1], steps
    for r in steps:
        # the reward of every rollout (a wrong or malformed answer is 0 or the format penalty, -0.1), and how the
        # groups split: the tiny random model seldom answers sums, so a step may have no group with reward spread
        assert math.isfinite(r["env/all/reward/total"]) and -1.0 <= r["env/all/reward/total"] <= 1.0, r
        fracs = [r[f"env/all/by_group/frac_{k}"] for k in ("mixed", "all_good", "all_bad")]
        assert sum(fracs) == pytest.approx(1.0), r
        assert r["time/train_step"] > 0, r
    saved = checkpoints(log)
    assert "000001" in [c["name"] for c in saved] and saved[-1]["name"] == "final", saved
    in_lab = lab_checkpoints(lab)
    assert all(c["state_path"] in in_lab and c["sampler_path"] in in_lab for c in saved), (saved, in_lab)


def test_cookbook_run_follows_metrics_and_reports_a_failed_recipe(lab, tmp_path):
    """The notebook's helper: a run's metrics as it logs them, and a recipe that fails names why."""
    client = Lab(find_connection(lab.base_url, lab.api_key, tmp_path / "no-home"))
    data = write_conversations(tmp_path / "chat.jsonl", 32)
    run = CookbookRun.start(
        client,
        "chat_sl",
        tmp_path / "ok",
        python=sys.executable,
        dataset=str(data),
        batch_size=8,
        lora_rank=8,
        learning_rate=5e-3,
        max_length=64,
        save_every=0,
        eval_every=0,
        max_steps=3,
        behavior_if_log_dir_exists="raise",
    )
    assert run.wait(timeout=240) == 0 and not run.running
    rows = run.metrics()
    assert list(rows["step"]) == [0, 1, 2] and rows["train_mean_nll"].notna().all(), rows

    bad = CookbookRun.start(
        client,
        "chat_sl",
        tmp_path / "bad",
        python=sys.executable,
        dataset=str(data),
        no_such_setting=1,
        behavior_if_log_dir_exists="raise",
    )
    with pytest.raises(CookbookError, match=r"(?s)chat_sl\.train failed \(exit [1-9]\d*\).*no_such_setting"):
        bad.wait(timeout=120)


def renderers_used(log_path: Path) -> set[str]:
    """Every renderer_name in the config the recipe logged (the recipe's and its dataset builder's)."""
    found: set[str] = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "renderer_name" and isinstance(v, str):
                    found.add(v)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads((log_path / "config.json").read_text()))
    return found


SMALL_RL = ("lora_rank=8", "max_tokens=4", "save_every=0")  # the Qwen3 RL runs' size


def assert_nll_falls(log_path: Path, steps: int) -> None:
    nll = [r["train_mean_nll"] for r in metrics(log_path) if "train_mean_nll" in r]
    assert len(nll) == steps and all(math.isfinite(x) for x in nll) and nll[-1] < nll[0], nll


def assert_rewarded_steps(log_path: Path, steps: int) -> None:
    rows = [r for r in metrics(log_path) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == list(range(steps)), rows
    assert all(math.isfinite(r["env/all/reward/total"]) for r in rows), rows


@pytest.mark.parametrize("served,model,renderer", [("qwen_lab", QWEN, "qwen3"), ("llama3_lab", LLAMA3, "llama3")])
def test_chat_sl_on_a_known_name_picks_its_own_renderer(request, tmp_path, served, model, renderer):
    lab = request.getfixturevalue(served)
    data = write_conversations(tmp_path / "chat.jsonl", 32)
    log = tmp_path / "chat_sl"
    args = ("dataset=" + str(data), "batch_size=8", "lora_rank=8", "learning_rate=5e-3", "lr_schedule=constant")
    more = ("max_length=64", "save_every=0", "eval_every=0", "max_steps=4", "behavior_if_log_dir_exists=raise")
    out = run_recipe(lab, "tinker_cookbook.recipes.chat_sl.train", log, *args, *more, model=model)
    assert "renderer_name=" not in " ".join(recipe_command("py", "chat_sl", "u", log, model=model))
    assert renderers_used(log) == {renderer}, out[-2000:]
    assert_nll_falls(log, steps=4)


def test_math_rl_on_qwen3_picks_its_own_renderer(qwen_lab, tmp_path):
    log = tmp_path / "math_rl"
    run_recipe(
        qwen_lab,
        "tinker_cookbook.recipes.math_rl.train",
        log,
        "env=arithmetic",
        "group_size=4",
        "groups_per_batch=2",
        *SMALL_RL,
        "max_steps=2",
        "eval_every=0",
        "behavior_if_log_dir_exists=raise",
        model=QWEN,
    )
    assert renderers_used(log) == {"qwen3"}
    assert_rewarded_steps(log, 2)


def test_sl_basic_on_qwen3_unchanged_but_its_dataset(qwen_lab, tmp_path):
    """sl_basic asks the cookbook's model table for the renderer before it reads the command line: on the lab's
    Llama it stops at "Unknown model"; on Qwen3 it trains with the qwen3 renderer."""
    data = write_conversations(tmp_path / "chat.jsonl", 32)
    log = tmp_path / "sl_basic"
    builder = "dataset_builder.common_config"
    run_recipe(
        qwen_lab,
        "tinker_cookbook.recipes.sl_basic",
        log,
        "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
        f"dataset_builder.file_path={data}",
        f"{builder}.model_name_for_tokenizer={QWEN}",
        f"{builder}.renderer_name=qwen3",  # the builder's own field: the recipe's table gives the same
        f"{builder}.batch_size=8",
        f"{builder}.max_length=64",
        "learning_rate=5e-3",
        "lora_rank=8",
        "max_steps=3",
        "eval_every=0",
        "save_every=0",
        model=QWEN,
    )
    assert renderers_used(log) == {"qwen3"}
    assert_nll_falls(log, steps=3)


def test_rl_basic_on_qwen3_unchanged_but_its_dataset(qwen_lab, tmp_path):
    log = tmp_path / "rl_basic"
    run_recipe(
        qwen_lab,
        "tinker_cookbook.recipes.rl_basic",
        log,
        "dataset_builder=tinker_cookbook.recipes.math_rl.arithmetic_env:ArithmeticDatasetBuilder",
        "dataset_builder.batch_size=2",
        "dataset_builder.group_size=4",
        "dataset_builder.n_batches=2",
        "dataset_builder.renderer_name=qwen3",
        f"dataset_builder.model_name_for_tokenizer={QWEN}",
        *SMALL_RL,
        model=QWEN,
    )
    assert renderers_used(log) == {"qwen3"}
    assert_rewarded_steps(log, 2)


GRADE = """
import asyncio, json, sys
from tinker_cookbook.recipes.code_rl.code_grading import sandbox_check_correctness

tests = [{"input": "1 2\\n", "output": "3\\n", "testtype": "stdin"},
         {"input": "5 7\\n", "output": "12\\n", "testtype": "stdin"}]
programs = json.loads(sys.argv[1])

async def main():
    return [await sandbox_check_correctness(tests, p, timeout=6) for p in programs]

print(json.dumps([[ok, details.get("status"), details.get("error")] for ok, details in asyncio.run(main())]))
"""


def test_code_rl_grades_through_the_lab_sandbox_unchanged(lab, tmp_path):
    """code_rl's grader (`sandbox_check_correctness`: its SandboxFusionClient, its LiveCodeBench test runner with
    numpy) runs unchanged against the lab's sandbox, with SANDBOX_URL as `recipe_env` sets it (the key in the
    URL): a right answer passes, a wrong one fails, and one that tries to read the lab's home finds nothing there."""
    secret = Path(lab.home) / "state.db"
    assert secret.exists()
    programs = [
        "a, b = map(int, input().split())\nprint(a + b)",
        "a, b = map(int, input().split())\nprint(a - b)",
        # right only where the lab's home is out of reach: it answers -1 if it could read the lab's database
        (
            f"try:\n    open({str(secret)!r}, 'rb').read(1)\n    leaked = True\nexcept OSError:\n    leaked = False\n"
            "a, b = map(int, input().split())\nprint(-1 if leaked else a + b)"
        ),
    ]
    env = recipe_env(lab.base_url, lab.api_key, tmp_path / "hf")
    assert env["SANDBOX_URL"].endswith("/sandbox/run_code") and lab.api_key.split("-", 1)[1][:8] in env["SANDBOX_URL"]
    out = subprocess.run(
        [sys.executable, "-c", GRADE, json.dumps(programs)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (right, wrong, snooping) = json.loads(out.stdout.strip().splitlines()[-1])
    assert right[:2] == [True, "Success"], right
    assert wrong[:2] == [False, "Failed"], wrong
    assert snooping[:2] == [True, "Success"], snooping  # the lab's home is not in the sandbox
