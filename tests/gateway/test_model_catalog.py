"""Operators name what they serve: `serve --model NAME=PATH` (a directory or an HF-cache repo), `--models FILE`;
get_server_capabilities lists them with their context length, family and what is validated; a name outside the
catalog is a 400 that lists what is served. Through the real SDK against a real `openrl-lab serve`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import tinker
from tinker import types

from openrl_lab.home import BUILTIN_MODEL_NAMES, CatalogError, with_catalog
from openrl_lab.server import LabServer
from openrl_lab.train.models import MARKER_FILE, UnknownModelError, register_in_hf_cache, resolve_model_dir

from ..conftest import sdk_client
from .helpers import MODEL, served_models


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two copies of the built-in tiny Llama: one served from its directory, one from the HF cache."""
    root = tmp_path_factory.mktemp("catalog-models")
    built = resolve_model_dir(MODEL, root / "home")
    dirs = {}
    for name in ("acme-tiny", "cached-tiny", "from-file"):
        shutil.copytree(built, root / name)
        (root / name / MARKER_FILE).unlink()  # an ordinary HF directory, not a built-in
        dirs[name] = root / name
    register_in_hf_cache("acme/cached-tiny", dirs["cached-tiny"])
    return dirs


@pytest.fixture(scope="module")
def catalog_lab(tmp_path_factory, model_dirs):
    home = tmp_path_factory.mktemp("catalog-lab")
    models_file = home.parent / "models.toml"
    models_file.write_text(f'[models]\n"acme/from-file" = "{model_dirs["from-file"]}"\n')
    args = (
        "--model",
        f"acme/tiny={model_dirs['acme-tiny']}",
        "--model",
        "acme/cached-tiny",
        "--models",
        str(models_file),
    )
    with LabServer(home, args=args) as lab:
        yield lab


@pytest.fixture(scope="module")
def client(catalog_lab):
    yield from sdk_client(catalog_lab)


SERVED = [*BUILTIN_MODEL_NAMES, "acme/from-file", "acme/tiny", "acme/cached-tiny"]


@pytest.mark.server  # `openrl-lab serve` processes
def test_capabilities_list_the_catalog_with_what_each_model_is(catalog_lab):
    caps = tinker.RestClient(base_url=catalog_lab.base_url, api_key=catalog_lab.api_key).get_server_capabilities()
    caps = caps.result()
    assert [m.model_name for m in caps.supported_models] == SERVED
    for entry in served_models(catalog_lab).values():
        assert entry["max_context_length"] == 512 and entry["trainable"] and entry["sampleable"], entry
        assert entry["family"] == "llama" and entry["architecture"] == "LlamaForCausalLM"
        assert "lora" in entry["validated"] and entry["num_parameters"] > 0


@pytest.mark.server  # `openrl-lab serve` processes
@pytest.mark.parametrize("name", ["acme/tiny", "acme/cached-tiny", "acme/from-file"])
def test_a_catalog_model_trains_and_samples_under_its_name(client, name):
    trainer = client.create_lora_training_client(base_model=name, rank=4).result()
    assert trainer.get_info().model_data.model_name == name
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 9, 12, 7]),
        loss_fn_inputs={"target_tokens": [9, 12, 7, 3], "weights": [1.0] * 4},
    )
    losses = []
    for _ in range(4):
        fb = trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=2e-3)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0]
    sampler = trainer.save_weights_and_get_sampling_client().result()
    out = sampler.sample(types.ModelInput.from_ints([5, 9]), 2, types.SamplingParams(max_tokens=3)).result()
    assert len(out.sequences) == 2


@pytest.mark.server  # `openrl-lab serve` processes
@pytest.mark.parametrize("which", ["a directory", "a name"])
def test_a_model_outside_the_catalog_is_refused_with_what_is_served(client, model_dirs, which):
    base_model = str(model_dirs["acme-tiny"]) if which == "a directory" else "acme/not-served"
    with pytest.raises(tinker.BadRequestError) as e:
        client.create_lora_training_client(base_model=base_model, rank=4).result()
    message = str(e.value)
    assert "is not served here" in message and all(name in message for name in SERVED), message


BAD_STARTS = {
    "a path that is no model": (["--model", "acme/x=/no/such/dir"], "'/no/such/dir' is not a model directory"),
    "a name not in the cache": (["--model", "acme/not-cached"], "'acme/not-cached' is not a model directory"),
    "a built-in name": (["--model", f"{MODEL}=/tmp"], "built-in model's"),
    "no name": (["--model", "=/tmp"], "give NAME or NAME=PATH"),
    "an alias of a model not served": (
        ["--tokenizer-alias", "acme/tok=acme/not-served"],
        "'acme/not-served' is not a model this server serves",
    ),
    "an alias that is no repo id": (["--tokenizer-alias", f"a//b={MODEL}"], "not a repo id"),
    "an alias without its model": (["--tokenizer-alias", "acme/tok"], "give REPO=MODEL"),
}


@pytest.mark.server  # `openrl-lab serve` processes
@pytest.mark.parametrize("case", sorted(BAD_STARTS))
def test_serve_refuses_a_bad_catalog_at_start_in_one_line(tmp_path, case):
    args, words = BAD_STARTS[case]
    done = subprocess.run(
        [sys.executable, "-m", "openrl_lab.cli", "serve", "--home", str(tmp_path), "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"openrl-lab serve: {args[0]}") and words in last, done.stderr


def test_catalog_files_and_the_closed_catalog(tmp_path, model_dirs, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text("[models]\nx = 3\n")
    with pytest.raises(CatalogError, match="must map each name to a string"):
        with_catalog({}, bad, [])
    bad.write_text("[models\n")
    with pytest.raises(CatalogError, match=r"bad\.toml"):
        with_catalog({}, bad, [])
    catalog = with_catalog({}, None, [f"acme/tiny={model_dirs['acme-tiny']}"])
    monkeypatch.setenv("OPENRL_LAB_MODELS", json.dumps({"acme/tiny": str(model_dirs["acme-tiny"])}))
    assert catalog == {"acme/tiny": str(model_dirs["acme-tiny"])}
    assert resolve_model_dir("acme/tiny") == model_dirs["acme-tiny"]
    with pytest.raises(UnknownModelError, match=r"this server serves openrl-lab/tiny-llama-1m, .*acme/tiny"):
        resolve_model_dir(str(model_dirs["cached-tiny"]))  # a directory, but not in the catalog
    monkeypatch.delenv("OPENRL_LAB_MODELS")
    assert resolve_model_dir(str(model_dirs["cached-tiny"])) == model_dirs["cached-tiny"]  # no catalog: any
    with pytest.raises(UnknownModelError, match="not a local directory"):
        resolve_model_dir(str(tmp_path))  # a directory without a config.json is no model
