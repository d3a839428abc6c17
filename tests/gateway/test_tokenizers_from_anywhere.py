"""Tokenizers from anywhere: a client that shares no filesystem with the server and reaches no model hub loads
a served model's tokenizer through the lab's Hugging Face mirror (/hf).

The server runs with OPENRL_LAB_TOKENIZER_PATHS=0, so that even its loopback clients get model names, as a
client on another host does. The clients run as subprocesses with empty Hugging Face caches and without
HF_HUB_OFFLINE: the real tinker SDK (HF_ENDPOINT=<base_url>/hf, HF_TOKEN=<key>) and the lab client."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from huggingface_hub.utils import HFValidationError, validate_repo_id

import openrl_lab
from tests.conftest import make_key, running_lab
from tests.gateway.helpers import MODEL

pytestmark = pytest.mark.server  # starts labs of its own and client processes

TEXTS = ["7+7=14", "hello olleh", "The quick brown fox, 123!", " leading space\nand a newline", "</s><s>"]
REPO = f"/hf/{MODEL}"
# Each client gets a fresh, empty cache and no way to the public hub or the server's files.
HF_VARS = (
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_ENDPOINT",
    "HF_TOKEN",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "XDG_CACHE_HOME",
    "OPENRL_LAB_HOME",
    "OPENRL_LAB_URL",
    "OPENRL_LAB_API_KEY",
    "TINKER_API_KEY",
)

SDK_CLIENT = textwrap.dedent("""
    import json, sys
    import tinker

    base_url, key, model, texts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    service = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = service.create_lora_training_client(base_model=model, rank=2).result()
    sampler = service.create_sampling_client(base_model=model).result()
    out = {"tokenizer_id": trainer.get_info().model_data.tokenizer_id}
    for name, tok in (("training", trainer.get_tokenizer()), ("sampling", sampler.get_tokenizer())):
        out[name] = {"ids": [tok.encode(t) for t in texts], "eos": tok.eos_token_id, "size": len(tok)}
    service.close("success").result()
    print(json.dumps(out))
""")

LAB_CLIENT = textwrap.dedent("""
    import json, sys
    from openrl_lab.lab import Lab

    base_url, key, model, texts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    lab = Lab.connect(base_url, api_key=key)
    run = lab.lease("tokenizer-from-afar", model=model, rank=2)
    tok = run.tokenizer()
    print(json.dumps({"ids": [tok.encode(t) for t in texts], "eos": tok.eos_token_id, "size": len(tok),
                      "loaded_from": tok.name_or_path}))
    lab.release(run.name)
    lab.close()
""")


@pytest.fixture(scope="module")
def afar(tmp_path_factory):
    """A lab that gives every client model names, never its directories."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OPENRL_LAB_TOKENIZER_PATHS", "0")  # the server process reads it; the child inherits it
        yield from running_lab(tmp_path_factory.mktemp("afar-home"))


@pytest.fixture(scope="module")
def reference(afar) -> dict:
    """The server's own tokenizer of the built-in model, loaded from the model's directory."""
    from openrl_lab.train.models import load_tokenizer

    # the server builds the model on first use: a mirror request is one
    assert (
        httpx.head(
            f"{afar.base_url}{REPO}/resolve/main/config.json", headers=bearer(afar.api_key), timeout=120
        ).status_code
        == 200
    )
    tok = load_tokenizer(afar.home / "models" / MODEL)
    return {"ids": [tok.encode(t) for t in TEXTS], "eos": tok.eos_token_id, "size": len(tok)}


def _client_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in HF_VARS}
    root = str(Path(openrl_lab.__file__).parent.parent)
    env |= {
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_CACHE": str(tmp / "hf" / "hub"),
        "XDG_CACHE_HOME": str(tmp / "cache"),
        "OPENRL_LAB_HOME": str(tmp / "no-lab-here"),
        "HOME": str(tmp),
        "PYTHONPATH": os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    return env | extra


@pytest.fixture(scope="module")
def clients(afar, tmp_path_factory) -> dict[str, dict]:
    """Both clients, run at once: {"sdk": ..., "lab": ...} with what they printed, and their cache dirs."""
    args = [afar.base_url, afar.api_key, MODEL, json.dumps(TEXTS)]
    sdk_tmp, lab_tmp = tmp_path_factory.mktemp("sdk-client"), tmp_path_factory.mktemp("lab-client")
    procs = {
        "sdk": (
            subprocess.Popen(
                [sys.executable, "-c", SDK_CLIENT, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_client_env(sdk_tmp, HF_ENDPOINT=f"{afar.base_url}/hf", HF_TOKEN=afar.api_key),
            ),
            sdk_tmp,
        ),
        # the lab client needs neither HF_ENDPOINT nor HF_TOKEN: it asks its own lab
        "lab": (
            subprocess.Popen(
                [sys.executable, "-c", LAB_CLIENT, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_client_env(lab_tmp),
            ),
            lab_tmp,
        ),
    }
    out = {}
    for name, (proc, tmp) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} client failed:\n{stderr[-4000:]}"
        out[name] = json.loads(stdout.strip().splitlines()[-1]) | {"tmp": tmp}
    return out


def _cached_files(root: Path) -> set[str]:
    return {p.name for p in root.rglob("snapshots/*/*")}


def test_the_sdk_loads_the_tokenizer_through_the_mirror(clients, reference, afar):
    sdk = clients["sdk"]
    assert sdk["tokenizer_id"] == MODEL  # a name, not a directory of the server
    for client in ("training", "sampling"):
        assert {k: sdk[client][k] for k in reference} == reference, client
    # it came from the mirror, into the client's own empty cache: tokenizer files only
    files = _cached_files(sdk["tmp"] / "hf" / "hub")
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= files
    assert not any(f.endswith(".safetensors") for f in files)


def test_the_lab_client_loads_the_tokenizer_through_the_mirror(clients, reference):
    lab = clients["lab"]
    assert {k: lab[k] for k in reference} == reference
    cache = lab["tmp"] / "cache" / "openrl-lab" / "tokenizers"
    assert Path(lab["loaded_from"]).is_relative_to(cache)
    assert {"tokenizer.json", "config.json"} <= _cached_files(cache)
    assert not (lab["tmp"] / "hf" / "hub").exists()  # its own cache per lab, not the user's HF cache


# --- the mirror over HTTP ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def web(afar):
    with httpx.Client(base_url=afar.base_url, timeout=120) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_files_come_with_the_headers_huggingface_hub_needs(web, afar):
    key = bearer(afar.api_key)
    info = web.get(f"/hf/api/models/{MODEL}", headers=key).json()
    commit = info["sha"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit) and info["id"] == MODEL
    tree = {e["path"]: e for e in web.get(f"/hf/api/models/{MODEL}/tree/main", headers=key).json()}
    on_disk = {p.name for p in (afar.home / "models" / MODEL).iterdir()}
    assert set(tree) == {r["rfilename"] for r in info["siblings"]}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(tree) < on_disk
    for revision in ("main", commit):
        head = web.head(f"{REPO}/resolve/{revision}/tokenizer.json", headers=key)
        got = web.get(f"{REPO}/resolve/{revision}/tokenizer.json", headers=key)
        assert head.status_code == got.status_code == 200
        assert got.content == (afar.home / "models" / MODEL / "tokenizer.json").read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(got.content) + got.content).hexdigest()  # git's blob id
        for r in (head, got):
            assert r.headers["X-Repo-Commit"] == commit
            assert r.headers["ETag"] == f'"{blob}"' and tree["tokenizer.json"]["oid"] == blob
            assert int(r.headers["Content-Length"]) == len(got.content) == tree["tokenizer.json"]["size"]
    assert web.get(f"/hf/api/models/{MODEL}/revision/{commit}", headers=key).json()["sha"] == commit  # stable


def test_a_file_outside_the_allow_list_is_an_entry_not_found(web, afar):
    for name in ("model.safetensors", "openrl_lab_model.json", "tokenizer.model", "README.md"):
        r = web.head(f"{REPO}/resolve/main/{name}", headers=bearer(afar.api_key))
        assert r.status_code == 404, name
        assert r.headers["X-Error-Code"] == "EntryNotFound" and len(r.headers["X-Repo-Commit"]) == 40
        assert name in r.headers["X-Error-Message"]
    r = web.get(f"/hf/api/models/{MODEL}/tree/main/additional_chat_templates", headers=bearer(afar.api_key))
    assert r.status_code == 404 and r.headers["X-Error-Code"] == "EntryNotFound"
    r = web.head(f"{REPO}/resolve/v1.0/config.json", headers=bearer(afar.api_key))
    assert r.status_code == 404 and r.headers["X-Error-Code"] == "RevisionNotFound"
    # a HEAD answer has no body: every refusal under /hf says why in X-Error-Message, the router's own too
    r = web.head("/hf/%0Aorg/resolve/main/config.json", headers=bearer(afar.api_key))
    assert r.status_code == 404 and r.headers["X-Error-Message"]


def test_the_mirror_needs_a_lab_key(web, afar, tmp_path):
    url = f"{REPO}/resolve/main/config.json"
    for headers, says in (
        ({}, "HF_TOKEN"),
        (bearer("tml-not-a-key"), "unknown API key"),
        (bearer("hf_a_hugging_face_token"), "not Hugging Face tokens"),
        ({"Authorization": f"Basic {afar.api_key}"}, "Bearer"),
        ({"X-API-Key": "tml-not-a-key"}, "unknown API key"),
    ):
        r = web.get(url, headers=headers)
        assert r.status_code == 401, headers
        assert says in r.json()["detail"] and says in r.headers["X-Error-Message"]
    assert web.get(url, headers={"X-API-Key": afar.api_key}).status_code == 200
    # Bearer keys are for the mirror only: the Tinker API still wants X-API-Key
    assert web.get("/api/v1/lab/leases", headers=bearer(afar.api_key)).status_code == 401
    # any user may read the tokenizers of the models the server serves (they are not secret)
    bob = make_key(afar.home, "bob-tokenizers")
    assert web.get(url, headers=bearer(bob)).status_code == 200


def test_unknown_models_all_get_the_same_answer(web, afar):
    """A name the server cannot load, an existing directory that is no model and an alias never handed out
    are answered alike: the mirror tells no one which directories exist on the server."""
    candidates = ["no-such-org/no-such-model", "no-such-model", f"openrl-lab-local/{MODEL.split('/')[1]}-0123456789ab"]
    # the kernel resolves a relative name against its working directory, the server's (the tests')
    candidates += [p.name for p in sorted(Path.cwd().iterdir()) if p.is_dir() and _repo_id(p.name)][:2]
    answers = set()
    for name in candidates:
        r = web.head(f"/hf/{name}/resolve/main/config.json", headers=bearer(afar.api_key))
        g = web.get(f"/hf/api/models/{name}", headers=bearer(afar.api_key))
        assert r.status_code == g.status_code == 404 and r.headers["X-Error-Code"] == "RepoNotFound", name
        answers.add((g.text.replace(repr(name), "NAME"), r.headers["X-Error-Message"].replace(repr(name), "NAME")))
    assert len(answers) == 1, answers
    assert str(afar.home) not in next(iter(answers))[0]


def _repo_id(name: str) -> bool:
    try:
        validate_repo_id(name)
        return True
    except HFValidationError:
        return False


def _raw_get(base_url: str, path: str, key: str) -> tuple[int, dict, bytes]:
    """A request with the path exactly as written (httpx would resolve dot segments before sending)."""
    where = urlsplit(base_url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        conn.request("GET", path, headers=bearer(key))
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    "path",
    [
        f"{REPO}/resolve/main/../config.json",
        f"{REPO}/resolve/main/..%2Fconfig.json",
        f"{REPO}/resolve/main/..%2F..%2F..%2Fstate.db",
        f"{REPO}/resolve/main/%2Fetc%2Fpasswd",
        f"{REPO}/resolve/main/.%2Fmodel.safetensors",
        "/hf/openrl-lab/..%2F..%2Fmodels/resolve/main/config.json",
        "/hf/..%2F..%2Fetc/resolve/main/passwd",
        "/hf/openrl-lab/../../etc/resolve/main/passwd",
        "/hf/%0A..%2Fetc/resolve/main/passwd",  # no route matches a newline: the router's own 404
        f"/hf/api/models/{MODEL}/tree/main/..%2F..",
        "/hf/api/models/..%2F..%2Fmodels%2Fopenrl-lab%2Ftiny-llama-1m",
    ],
)
def test_paths_out_of_the_repository_are_refused(afar, path):
    status, _headers, body = _raw_get(afar.base_url, path, afar.api_key)
    assert status in (400, 404), (path, status)
    assert b"LlamaForCausalLM" not in body and b"SQLite" not in body
    assert str(afar.home).encode() not in body
    assert json.loads(body)["detail"]
