"""The kernel's device memory budget (in-process, a real Engine and the built-in tiny model): a full fine-tuning
job is refused before its copy is made when its weights, gradients and AdamW moments do not fit next to what the
kernel holds; an evicted job's state is in host memory and makes room."""

from __future__ import annotations

import pytest

from openrl_lab.kernel.api import LoraSettings
from openrl_lab.kernel.engine import Engine, UserError
from openrl_lab.memory import BUDGET_ENV, full_finetune_bytes
from openrl_lab.settings import parse_bytes

MODEL = "openrl-lab/tiny-llama-1m"
PARAMS = 1_115_264
BASE = 4 * PARAMS  # float32 weights
FULL = full_finetune_bytes(PARAMS)  # 16 bytes a weight: 17.0 MiB


@pytest.fixture
def engine(tmp_path, monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "30MiB")
    return Engine(tmp_path / "home")


def test_a_full_finetune_is_admitted_against_the_budget_and_what_is_resident(engine):
    engine.create_job("a", MODEL, None)
    assert engine.memory() == {
        "budget_bytes": 30 << 20,
        "used_bytes": BASE + FULL,
        "available_bytes": (30 << 20) - BASE - FULL,
    }
    assert engine.metrics().job_bytes == {"a": FULL}
    with pytest.raises(
        UserError,
        match=r"a full fine-tuning job on openrl-lab/tiny-llama-1m needs 17\.0 MiB of "
        r"device memory .* but its kernel \(cpu, budget 30\.0 MiB, 21\.3 MiB held by "
        r"base models and resident jobs\) has 8\.7 MiB available",
    ):
        engine.create_job("b", MODEL, None)
    assert engine.metrics().job_ids == ["a"]  # nothing half-made
    engine.create_job("lora", MODEL, LoraSettings(rank=4))  # an adapter is small: LoRA jobs are not held back
    assert 0 < engine.metrics().job_bytes["lora"] < FULL / 10
    engine.evict_job("a")  # its state went to host memory (another job waited): room on the device
    engine.create_job("b", MODEL, None)
    assert engine.metrics().job_bytes["b"] == FULL


def test_a_bad_budget_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(UserError, match=f"{BUDGET_ENV}='lots': 'lots' is not a size"):
        Engine(tmp_path / "home")
    assert parse_bytes("1.5 GiB") == 3 << 29 and parse_bytes("4096") == 4096 and parse_bytes("2MB") == 2_000_000
