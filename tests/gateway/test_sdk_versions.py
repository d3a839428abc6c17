"""The SDK versions people use, each from its own environment, against one real lab: every call of the surface
they share answers, and answers right (`sdk_versions_driver.py` makes the calls; `make sdk-envs` makes the
environments). 0.18.1 sends forward_backward and forward as JSON and decodes only sample results from
protobuf; 0.24.1 sends protobuf because client/config asks it to; 0.25.0 and 0.38.0 always send protobuf."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
from packaging.version import Version

from .helpers import MODEL

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("sdk_versions_driver.py")
OLDER = ("0.18.1", "0.24.1", "0.25.0")  # the Makefile's SDK_VERSIONS
VERSIONS = (*OLDER, tinker.__version__)

pytestmark = pytest.mark.timeout(600)


def interpreter(version: str) -> str:
    if version == tinker.__version__:
        return sys.executable
    python = REPO / ".venv-sdk" / version / "bin" / "python"
    if not python.exists():
        pytest.fail(f"tinker {version}'s environment is missing: {python} (run `make sdk-envs`)")
    return str(python)


@pytest.fixture(scope="module")
def runs(lab, service):
    """Each version's run of the driver, one after the other on the same lab, whose user also holds a checkpoint
    of a type SDKs before 0.28 do not know (an external one)."""
    trainer = service.create_lora_training_client(base_model=MODEL, rank=2).result()
    external = trainer.save_weights_external("sdk-versions-external").result().path
    out = {"external": external}
    for version in VERSIONS:
        done = subprocess.run(
            [
                interpreter(version),
                str(DRIVER),
                "--base-url",
                lab.base_url,
                "--api-key",
                lab.api_key,
                "--base-model",
                MODEL,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        lines = done.stdout.strip().splitlines()
        assert done.returncode == 0 and lines, f"tinker {version}'s driver failed:\n{done.stdout}\n{done.stderr}"
        out[version] = json.loads(lines[-1])
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_every_call_answers(runs, version):
    run = runs[version]
    assert run["sdk"] == version
    assert not run["errors"], "\n\n".join(f"{step}: {error}" for step, error in run["errors"].items())


@pytest.mark.parametrize("version", VERSIONS)
def test_training_learns_and_forward_matches_the_data(runs, version):
    steps = runs[version]["steps"]
    losses = steps["forward_backward+optim_step"]["losses"]
    assert losses[-1] < losses[0], losses
    forward = steps["forward"]
    assert [len(lp) for lp in forward["logprobs"]] == [7, 5]  # one per target token of each datum
    assert all(math.isfinite(v) and v <= 0 for lp in forward["logprobs"] for v in lp)
    # the reported loss is the sum of the datums' negative logprobs (weights 1)
    assert forward["loss"] == pytest.approx(-sum(v for lp in forward["logprobs"] for v in lp), rel=1e-4)
    assert math.isfinite(steps["forward_backward importance_sampling"]["loss"])


@pytest.mark.parametrize("version", VERSIONS)
def test_sampling_is_seeded_and_its_logprobs_are_the_models(runs, version):
    steps = runs[version]["steps"]
    sampled = steps["save_weights_and_get_sampling_client+sample"]
    assert sampled["tokens"] == sampled["again"]  # seeded
    assert all(len(t) == 6 for t in sampled["tokens"])  # stop=[]: every sample runs to max_tokens
    scored = steps["compute_logprobs"]["logprobs"]  # the prompt (3 tokens) + the first sample
    assert scored[0] is None
    assert scored[3:] == pytest.approx(sampled["logprobs"][0], abs=1e-4)
    lengths = steps["create_sampling_client(base_model)"]["lengths"]
    assert len(lengths) == 2 and all(1 <= n <= 4 for n in lengths)  # max_tokens 4; EOS may end one early


@pytest.mark.parametrize("version", VERSIONS)
def test_checkpoints_and_models_are_listed(runs, version):
    steps = runs[version]["steps"]
    assert MODEL in steps["get_server_capabilities"]["models"]
    assert steps["get_info"] == {"model_name": MODEL, "lora_rank": 4}
    assert steps["get_tokenizer"]["round_trip"] == "copy AB:"
    listed = steps["rest list_user_checkpoints"]["paths"]
    assert steps["save_state+load_state"]["path"] in listed
    # an external checkpoint only for the SDKs that know the type (0.28 on); older ones would fail to read it
    assert (runs["external"] in listed) == (Version(version) >= Version("0.28")), listed
