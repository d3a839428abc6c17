"""Getting trained weights out, through the real SDK against a real lab: save_weights_external and
get_external_weights_urls (the SDK's download path), for training and sampler checkpoints too, as a PEFT adapter
that plain peft loads, or merged into a Hugging Face model that plain transformers loads; signed URLs that only
serve what they were signed for."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from openrl_lab.gateway.downloads import BadDownload, Signer
from openrl_lab.gateway.sequencer import GAP_GRACE_S
from openrl_lab.train.models import resolve_model_dir

from ..conftest import make_key
from .helpers import MODEL, TEXTS, new_trainer, sft_batch
from .test_wire_and_bad_input import Api, decode_logprobs

PROMPT_TEXT = "12+34=46 abc cba"


@pytest.fixture(scope="module")
def trained(service):
    """A LoRA run trained a few steps, with a training, a sampler and an external checkpoint of the same weights."""
    trainer = new_trainer(service, rank=4, seed=3)
    tok = trainer.get_tokenizer()
    for _ in range(4):
        trainer.forward_backward(sft_batch(tok, TEXTS), "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    paths = {
        "training": trainer.save_state("w").result().path,
        "sampler": trainer.save_weights_for_sampler("s").result().path,
        "external": trainer.save_weights_external("e").result().path,
    }
    sampler = service.create_sampling_client(model_path=paths["sampler"]).result()
    prompt = types.ModelInput.from_ints(tok.encode(PROMPT_TEXT, add_special_tokens=False))
    return trainer, paths, prompt, sampler.compute_logprobs(prompt).result()


def _download(urls: dict[str, str], dest: Path) -> Path:
    """As the SDK's `tinker checkpoint download` does: a plain GET per file, no key."""
    dest.mkdir(parents=True)
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=60) as r:
            (dest / name).write_bytes(r.read())
    return dest


def _logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return picked.numpy()


def _base(lab):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_model_dir(MODEL, lab.home), dtype=torch.float32).eval()


def _urls(lab, key: str, tinker_path: str, fmt: str | None = None) -> httpx.Response:
    run, _, checkpoint_id = tinker_path.removeprefix("tinker://").partition("/")
    return httpx.get(
        f"{lab.base_url}/api/v1/training_runs/{run}/checkpoints/{checkpoint_id}/external_weights_urls",
        params={"format": fmt} if fmt else None,
        headers={"X-API-Key": key},
        timeout=300,
    )


def test_external_weights_load_with_plain_peft(lab, service, trained, tmp_path):
    from peft import PeftModel

    trainer, paths, prompt, lab_logprobs = trained
    assert paths["external"].endswith("/external_weights/e")
    rest = service.create_rest_client()
    answer = rest.get_external_weights_urls(paths["external"]).result()
    assert set(answer.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    folder = _download(answer.urls, tmp_path / "adapter")
    model = PeftModel.from_pretrained(_base(lab), folder).eval()
    got = _logprobs(model, prompt.to_ints())
    diff = np.abs(got - np.asarray(lab_logprobs[1:], dtype=np.float32)).max()
    print(f"peft adapter vs the lab's compute_logprobs: max |diff| = {diff:.2e}")
    assert diff < 1e-5
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}
    assert listed["external_weights/e"].checkpoint_type == "external"
    assert listed["external_weights/e"].size_bytes == sum((folder / n).stat().st_size for n in answer.urls)


@pytest.mark.parametrize("kind", ["training", "sampler"])
def test_training_and_sampler_checkpoints_download_as_adapter_and_merged(lab, trained, tmp_path, kind):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, paths, prompt, lab_logprobs = trained
    want = np.asarray(lab_logprobs[1:], dtype=np.float32)
    adapter = _urls(lab, lab.api_key, paths[kind])
    assert adapter.status_code == 200, adapter.text
    assert adapter.json()["format"] == "peft"
    model = PeftModel.from_pretrained(_base(lab), _download(adapter.json()["urls"], tmp_path / "adapter")).eval()
    assert np.abs(_logprobs(model, prompt.to_ints()) - want).max() < 1e-5

    merged = _urls(lab, lab.api_key, paths[kind], "merged")
    assert merged.status_code == 200, merged.text
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(merged.json()["urls"])
    folder = _download(merged.json()["urls"], tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    diff = np.abs(_logprobs(model, prompt.to_ints()) - want).max()
    print(f"merged {kind} checkpoint vs the lab's compute_logprobs: max |diff| = {diff:.2e}")
    assert diff < 1e-5

    wrong = _urls(lab, lab.api_key, paths[kind], "hf")
    assert wrong.status_code == 400 and "use one of peft, merged" in wrong.text


def test_the_sdks_download_command(lab, trained, tmp_path):
    """`tinker checkpoint download` of a training checkpoint: it loads the checkpoint into a new run, exports it
    with save_weights_external, downloads by the signed URLs, and deletes the export."""
    import safetensors.numpy

    _, paths, _, _ = trained
    cli = Path(sys.executable).parent / "tinker"
    env = dict(os.environ, TINKER_BASE_URL=lab.base_url, TINKER_API_KEY=lab.api_key, TINKER_TELEMETRY="0")
    out = subprocess.run(
        [str(cli), "checkpoint", "download", paths["training"], "--output", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    folder = tmp_path / paths["training"].removeprefix("tinker://").replace("/", "_")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    direct = _download(_urls(lab, lab.api_key, paths["training"]).json()["urls"], tmp_path / "direct")
    got, want = (safetensors.numpy.load_file(d / "adapter_model.safetensors") for d in (folder, direct))
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)


def test_a_full_fine_tuning_run_exports_a_hugging_face_model(lab, tmp_path):
    """Full fine-tuning (a run without lora_config, which the SDK cannot ask for: raw HTTP) exports the whole
    model, tokenizer included; plain transformers gives the trainer's logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    api = Api(lab.base_url, lab.api_key)
    model_id = api.model(api.session())  # no lora_config: full fine-tuning
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(MODEL, lab.home))
    batch = sft_batch(tok, TEXTS[:3])
    assert api.result(api.fb(model_id, 1, batch).json()["request_id"]).status_code == 200
    step = api.post(
        "/optim_step",
        json={"model_id": model_id, "seq_id": 2, "type": "optim_step", "adam_params": {"learning_rate": 1e-2}},
    )
    assert api.result(step.json()["request_id"]).status_code == 200
    lab_logprobs = decode_logprobs(
        api.result(api.fb(model_id, 3, batch, forward_only=True).json()["request_id"]).content
    )
    saved = api.post(
        "/save_weights_external",
        json={"model_id": model_id, "path": "full", "seq_id": 4, "type": "save_weights_external"},
    )
    path = api.result(saved.json()["request_id"]).json()["path"]
    urls = _urls(lab, lab.api_key, path)
    assert urls.status_code == 200 and urls.json()["format"] == "hf", urls.text
    folder = _download(urls.json()["urls"], tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(folder).encode(TEXTS[0]) == tok.encode(TEXTS[0])
    diff = 0.0
    for datum, want in zip(batch, lab_logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([datum.model_input.to_ints()])).logits[0].float()
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
        got = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0].numpy()
        diff = max(diff, float(np.abs(got - want).max()))
    print(f"full fine-tuning export vs the lab's forward: max |diff| = {diff:.2e}")
    assert diff < 1e-5
    assert _urls(lab, lab.api_key, path, "merged").status_code == 400  # nothing to merge


def test_other_users_get_404_until_published(lab, service, trained):
    _, paths, _, _ = trained
    bob = make_key(lab.home, "bob-weights")
    mine = _urls(lab, lab.api_key, paths["training"])
    for kind in ("training", "external"):
        r = _urls(lab, bob, paths[kind])
        assert r.status_code == 404 and "not found" in r.text.lower(), r.text
    rest = service.create_rest_client()
    rest.publish_checkpoint_from_tinker_path(paths["training"]).result()
    try:
        theirs = _urls(lab, bob, paths["training"])
        assert theirs.status_code == 200
        with urllib.request.urlopen(theirs.json()["urls"]["adapter_config.json"], timeout=60) as r:
            assert r.status == 200
    finally:
        rest.unpublish_checkpoint_from_tinker_path(paths["training"]).result()
    # Unpublished: Bob's URLs stop working at once; the owner's still work.
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(theirs.json()["urls"]["adapter_config.json"], timeout=60)
    with urllib.request.urlopen(mine.json()["urls"]["adapter_config.json"], timeout=60) as r:
        assert r.status == 200


def test_tampered_urls_are_refused(lab, trained):
    _, paths, _, _ = trained
    urls = _urls(lab, lab.api_key, paths["training"]).json()["urls"]
    url = urls["adapter_model.safetensors"]
    prefix, token, name = url.rsplit("/", 2)
    payload, mac = token.split(".")
    flipped = payload[:-1] + ("A" if payload[-1] != "A" else "B")
    other_file = urls["adapter_config.json"].rsplit("/", 2)[1]  # a valid token for another file
    for bad in (
        f"{prefix}/{flipped}.{mac}/{name}",
        f"{prefix}/{token}x/{name}",
        f"{prefix}/{other_file}/{name}",
        f"{prefix}/{token}/adapter_config.json",
        f"{prefix}/garbage/{name}",
    ):
        r = httpx.get(bad, timeout=60)
        assert r.status_code == 403, (bad, r.status_code, r.text)
        assert "download URL" in r.json()["detail"]
    assert httpx.get(url, timeout=60).status_code == 200


def test_expired_and_foreign_tokens(tmp_path):
    signer = Signer(tmp_path)
    token = signer.sign("ann", "tinker://r:train:0/weights/w", "peft", "f", expires=1000.0)
    assert signer.check(token, "f", now=999.0).owner == "ann"
    with pytest.raises(BadDownload, match="expired at 1970-01-01 00:16:40 UTC; ask for new ones"):
        signer.check(token, "f", now=1000.0)
    assert Signer(tmp_path).check(token, "f", now=0).tinker_path.endswith("/w")  # the secret outlives a restart
    with pytest.raises(BadDownload, match="not signed by this server"):
        Signer(tmp_path / "other").check(token, "f", now=0)
    assert oct((tmp_path / "download_key").stat().st_mode & 0o777) == "0o600"


def test_save_weights_external_refuses_encryption(service):
    trainer = new_trainer(service, rank=2)
    batch = sft_batch(trainer.get_tokenizer(), TEXTS[:1])

    def forward_s() -> float:
        t0 = time.monotonic()
        trainer.forward(batch, "cross_entropy").result()
        return time.monotonic() - t0

    baseline = max(forward_s(), forward_s())  # this machine's speed now, not a fixed number
    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients is not supported"):
        trainer.save_weights_external("x", age_encryption_recipients=["age1xyz"]).result()
    # The refused request's seq_id is skipped at once: the next request does not wait GAP_GRACE_S for it (had it
    # waited, it would take GAP_GRACE_S + about `baseline`). The sequencer's own logic is tested without a clock in
    # tests/gateway/test_sequencer.py; this checks that the route tells the sequencer.
    took = forward_s()
    assert took < baseline + 0.6 * GAP_GRACE_S, (took, baseline)
