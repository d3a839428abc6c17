"""Where the lab keeps its state, which models it serves by name (the built-in ones and the operator's catalog),
and how clients find a running control plane (torch-free)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from openrl_lab.settings import settings

BUILTIN_MODEL_NAMES = ("openrl-lab/tiny-llama-1m", "openrl-lab/tiny-llama-10m")
DEFAULT_MODEL = BUILTIN_MODEL_NAMES[0]


# What `make test` checks for a model family, by its config's model_type (get_server_capabilities shows it): the
# built-in models are Llama, which every test trains and samples; Qwen3 is checked on a stand-in with the real
# vocabulary served as Qwen/Qwen3-8B, Qwen3-MoE as Qwen/Qwen3-30B-A3B, Llama 3 as meta-llama/Llama-3.2-1B and
# Llama-3.1-8B-Instruct (openrl_lab/train/families.py; tests/gateway/test_qwen3.py and test_families.py,
# tests/train/test_moe.py, tests/vllm/test_vllm_families.py, tests/cookbook).
VALIDATED: dict[str, tuple[str, ...]] = {
    "llama": (
        "lora",
        "full fine-tuning",
        "torch sampler",
        "vllm sampler",
        "export",
        "cookbook (role_colon)",
        "cookbook (llama3)",
    ),
    "qwen3": ("lora", "full fine-tuning", "torch sampler", "vllm sampler", "cookbook (qwen3)"),
    "qwen3_moe": (
        "lora (every expert, router frozen)",
        "full fine-tuning",
        "torch sampler",
        "vllm sampler (base weights; LoRA refused)",
        "export",
    ),
    # stand-ins on the lab's tokenizer (theirs cannot be had offline): the architecture is what is checked
    "gemma3_text": ("lora", "full fine-tuning", "torch sampler", "vllm sampler", "architecture only"),
    "mistral": ("lora", "full fine-tuning", "torch sampler", "vllm sampler", "architecture only"),
    "gpt_oss": (
        "lora (every expert, router frozen)",
        "full fine-tuning",
        "torch sampler",
        "vllm sampler (base weights; LoRA refused)",
        "export",
        "architecture only",
    ),
}


class CatalogError(ValueError):
    """A catalog entry that names no model this machine has; one line naming it."""


def _file_table(file: Path, name: str, maps: str) -> dict[str, str]:
    """A catalog file's [name] table of strings (empty when it has none); CatalogError naming the file."""
    import tomllib

    try:
        table = tomllib.loads(Path(file).read_text()).get(name, {})
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CatalogError(f"--models {file}: {e}") from None
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise CatalogError(f"--models {file}: [{name}] must map {maps}")
    return table


def with_catalog(catalog: dict[str, str], file: Path | None, entries: list[str]) -> dict[str, str]:
    """`catalog` with a TOML file's [models] table and `serve --model NAME[=PATH]` entries added, each checked
    to resolve here (a directory with a config.json, or a repo in the HF cache)."""
    out = dict(catalog)
    if file is not None:
        out.update(_file_table(file, "models", 'each name to a string (a path, or "")'))
    for entry in entries:
        name, _, target = entry.partition("=")
        if not name.strip():
            raise CatalogError(f"--model {entry!r}: give NAME or NAME=PATH")
        out[name.strip()] = target.strip()
    for name, target in out.items():
        if name in BUILTIN_MODEL_NAMES:
            raise CatalogError(f"--model {name}: that name is a built-in model's")
        if find_model(target or name) is None:
            raise CatalogError(
                f"--model {name}{'=' + target if target else ''}: {target or name!r} is not a model directory (with "
                "a config.json) and not in the Hugging Face cache (no hub is contacted)"
            )
    return out


def with_tokenizer_aliases(
    aliases: dict[str, str], file: Path | None, entries: list[str], catalog: dict[str, str]
) -> dict[str, str]:
    """`aliases` with a TOML file's [tokenizers] table and `serve --tokenizer-alias REPO=MODEL` entries added, each
    a repo id naming a model this server serves (built-in, in `catalog`, or with no catalog any it resolves)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    out = dict(aliases)
    if file is not None:
        out.update(_file_table(file, "tokenizers", "each repo id to a served model's name"))
    for entry in entries:
        repo, _, model = entry.partition("=")
        if not repo.strip() or not model.strip():
            raise CatalogError(f"--tokenizer-alias {entry!r}: give REPO=MODEL")
        out[repo.strip()] = model.strip()
    for repo, model in out.items():
        try:
            validate_repo_id(repo)
        except HFValidationError as e:
            raise CatalogError(f"--tokenizer-alias {repo}: not a repo id ({e})") from None
        if repo in BUILTIN_MODEL_NAMES or repo in catalog:
            raise CatalogError(f"--tokenizer-alias {repo}: that name is a served model's")
        served = model in BUILTIN_MODEL_NAMES or model in catalog or (not catalog and find_model(model) is not None)
        if not served:
            raise CatalogError(
                f"--tokenizer-alias {repo}={model}: {model!r} is not a model this server serves "
                f"({', '.join([*BUILTIN_MODEL_NAMES, *catalog])})"
            )
    return out


def served_models() -> dict[str, str]:
    """The operator's catalog (`$OPENRL_LAB_MODELS`: name -> a directory or an HF repo id, "" for the name)."""
    return dict(settings().lab_models)


def served_names() -> list[str]:
    """The names this server lists and, with a catalog, the only ones it serves: built-in first."""
    return [*BUILTIN_MODEL_NAMES, *(n for n in served_models() if n not in BUILTIN_MODEL_NAMES)]


def find_model(target: str) -> Path | None:
    """A model directory, or a repo id's snapshot in the HF cache; None when neither holds a config.json."""
    local = Path(target).expanduser()
    if local.is_dir():
        return local if (local / "config.json").is_file() else None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(target, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or no huggingface_hub: the same answer for the user
        return None


def default_home() -> Path:
    """$OPENRL_LAB_HOME, else the per-user data directory (like JupyterHub's default)."""
    if env := settings().lab_home:
        return env.expanduser()
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "openrl-lab"


def write_private(path: Path, text: str) -> None:
    """Writes a secret file readable by its owner only, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def connection_file(home: Path | None = None) -> Path:
    return (home or default_home()) / "connection.json"


def read_connection(home: Path | None = None) -> dict:
    """{"base_url": ..., "api_key": ...} of the control plane serving this home."""
    path = connection_file(home)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no running OpenRL Lab found: {path} does not exist (start one with `openrl-lab serve`)"
        ) from None


def find_api_key(explicit: str | None = None, saved: dict | None = None, home: Path | None = None) -> str | None:
    """The API key a client uses: `explicit`, else $OPENRL_LAB_API_KEY, else $TINKER_API_KEY, else the one in
    `saved` (a connection dict already read), or in the home's connection.json when `saved` is None. The one
    lookup every client (orchestrator, notebook, server extension) goes through."""
    key = explicit or settings().lab_api_key or os.environ.get("TINKER_API_KEY")
    if key:
        return key
    if saved is None:
        try:
            saved = read_connection(home)
        except (OSError, ValueError):
            return None
    return saved.get("api_key") or None


def secure_home(home: Path) -> Path:
    """Makes `home` private to its owner (0700, tightened if it was looser) and this process's new files
    private too (umask 077, inherited by kernels): the databases, their WAL files, logs and checkpoints
    hold other users' keys' hashes, runs and weights."""
    os.umask(0o077)
    home.mkdir(parents=True, exist_ok=True)
    if home.stat().st_mode & 0o077:
        home.chmod(0o700)
    return home
