"""A read-only Hugging Face Hub mirror of the served models' tokenizers, under /hf (not /api/v1).

A client on another host (no shared filesystem, no hub) loads a served model's tokenizer with
`HF_ENDPOINT=<base_url>/hf` and `HF_TOKEN=<its lab API key>`: the tinker SDK's `get_tokenizer()` calls
`AutoTokenizer.from_pretrained(tokenizer_id)`, and huggingface_hub asks this mirror what it would ask the hub:

- `HEAD|GET /hf/{repo_id}/resolve/{revision}/{filename}`: the file, with `X-Repo-Commit`, `ETag` (its git blob
  id) and `Content-Length`. A file the model lacks is a 404 with `X-Error-Code: EntryNotFound` and the commit,
  which transformers takes as "optional file absent" (and caches) at once.
- `GET /hf/api/models/{repo_id}` and `.../revision/{revision}`: the repository's info (`sha`, `siblings`);
  `snapshot_download` and transformers ask it.
- `GET /hf/api/models/{repo_id}/tree/{revision}[/{path}]`: the file list (transformers lists the repository
  and its `additional_chat_templates/` folder).

A repository is a served model: `repo_id` is its name, as get_info's `tokenizer_id` gives it (or an alias
for a model whose name is a directory). Revisions: `main` and the commit, a sha1 over the files. The files
come from the kernel (`tokenizer_files`) once per model, kept in memory: this process never reads the
kernel's filesystem. Keys: `Authorization: Bearer <key>` (what huggingface_hub sends) or `X-API-Key`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from huggingface_hub.utils import HFValidationError, validate_repo_id

from openrl_lab.gateway.deps import API_KEY, REFUSALS, Gw
from openrl_lab.gateway.errors import ApiError, header_text, redact
from openrl_lab.gateway.gateway import Gateway, TokenizerRepo

BEARER = HTTPBearer(
    auto_error=False,
    description="an OpenRL Lab key as `Authorization: Bearer <key>` (what huggingface_hub sends for HF_TOKEN=<key>)",
)


def hf_user(
    request: Request, _key: Annotated[str | None, Security(API_KEY)], _bearer: Annotated[object, Security(BEARER)]
) -> str:
    """The caller (ApiKeyAuth checked the key; naming both schemes here documents them in the OpenAPI schema)."""
    return request.state.user


router = APIRouter(prefix="/hf", tags=["hugging face mirror"], dependencies=[Depends(hf_user)], responses=REFUSALS)


def _refusal(gw: Gateway, status: int, code: str | None, message: str, commit: str | None = None) -> JSONResponse:
    # huggingface_hub reads X-Error-Code to tell a missing file from a missing repository, and shows
    # X-Error-Message; X-Repo-Commit lets it cache a file's absence.
    message = redact(message, gw.home)
    headers = {"X-Error-Message": header_text(message)}
    if code:
        headers["X-Error-Code"] = code
    if commit:
        headers["X-Repo-Commit"] = commit
    return JSONResponse({"detail": message, "error": message}, status_code=status, headers=headers)


async def _repo(gw: Gateway, repo_id: str, revision: str | None) -> TokenizerRepo | JSONResponse:
    """The repository, or the refusal huggingface_hub understands."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return _refusal(gw, 400, None, f"{repo_id!r} is not a repository id: {e}")
    try:
        repo = await gw.tokenizer(repo_id)
    except ApiError as e:
        return _refusal(gw, e.status_code, "RepoNotFound" if e.status_code == 404 else None, e.message)
    if revision is not None and not (revision == "main" or revision == repo.commit):
        return _refusal(
            gw,
            404,
            "RevisionNotFound",
            f"revision {revision!r} of {repo_id} not found: this mirror serves 'main' and its commit {repo.commit}",
        )
    return repo


@router.get("/api/models/{repo_id:path}/tree/{revision}/{path:path}")
@router.get("/api/models/{repo_id:path}/tree/{revision}")
async def tree(gw: Gw, repo_id: str, revision: str, path: str = ""):
    """The repository's files (`list_repo_tree`, `list_repo_files`)."""
    repo = await _repo(gw, repo_id, revision)
    if isinstance(repo, Response):
        return repo
    if path.strip("/"):  # the files are all at the top: there is no folder
        return _refusal(
            gw,
            404,
            "EntryNotFound",
            f"{path!r} not found in {repo_id}: this mirror serves only the "
            f"tokenizer files at the top ({', '.join(sorted(repo.files))})",
            repo.commit,
        )
    return [
        {"type": "file", "path": name, "size": len(data), "oid": repo.oids[name]}
        for name, data in sorted(repo.files.items())
    ]


@router.get("/api/models/{repo_id:path}")  # decorators register bottom-up: this catch-all goes last
@router.get("/api/models/{repo_id:path}/revision/{revision}")
async def model_info(gw: Gw, repo_id: str, revision: str | None = None):
    """The repository's info (`model_info`, `repo_info`: what `snapshot_download` asks first)."""
    repo = await _repo(gw, repo_id, revision)
    if isinstance(repo, Response):
        return repo
    return {
        "id": repo_id,
        "modelId": repo_id,
        "sha": repo.commit,
        "private": False,
        "disabled": False,
        "gated": False,
        "tags": [],
        "library_name": "transformers",
        "siblings": [{"rfilename": name, "size": len(data)} for name, data in sorted(repo.files.items())],
    }


_FILE = {"response_class": Response, "responses": {200: {"content": {"application/octet-stream": {}}}}}


@router.head("/{repo_id:path}/resolve/{revision}/{filename:path}", **_FILE)  # one route per method: one operation id
@router.get("/{repo_id:path}/resolve/{revision}/{filename:path}", **_FILE)
async def resolve(request: Request, gw: Gw, repo_id: str, revision: str, filename: str):
    """One tokenizer file (HEAD: its metadata), as huggingface_hub's `hf_hub_download` asks for it."""
    repo = await _repo(gw, repo_id, revision)
    if isinstance(repo, Response):
        return repo
    data = repo.files.get(filename)  # only the kernel's allow-listed names are in there: no path reaches a disk
    if data is None:
        return _refusal(
            gw,
            404,
            "EntryNotFound",
            f"{filename!r} not found in {repo_id}: this mirror serves only "
            f"its tokenizer files ({', '.join(sorted(repo.files))})",
            repo.commit,
        )
    headers = {
        "X-Repo-Commit": repo.commit,
        "ETag": f'"{repo.oids[filename]}"',
        "Content-Length": str(len(data)),
        "Cache-Control": "private, max-age=0",
    }
    return Response(b"" if request.method == "HEAD" else data, media_type="application/octet-stream", headers=headers)
