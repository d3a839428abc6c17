"""The lab's sandbox from Python: a notebook's reward function, a script, a recipe. Over HTTP with the user's key,
as any SandboxFusion client talks to the lab, plus what a notebook wants on top: a whole RL group's programs in
one request (`run_many`), async variants for an event loop, and the URL to give a SandboxFusion client that
cannot send headers (`url`, `env()`: the key rides in it as HTTP Basic's password).

    sb = lab.sandbox                                     # or SandboxClient(base_url, api_key)
    r = sb.run("print(input()[::-1])", stdin="abc")      # r.ok, r.stdout == "cba\\n", r.execution_time
    rs = sb.run_many([completion_1, completion_2, ...], files={"tests.py": TESTS}, timeout=6)
    os.environ.update(sb.env())                          # tinker-cookbook's code_rl: SANDBOX_URL
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from openrl_lab.sandbox.protocol import MAX_BATCH, RunCodeResponse
from openrl_lab.sockets import http_client

# the HTTP client waits this much longer than the program may run (its queue and the sandbox's own start-up)
SLACK_S = 120.0


class SandboxError(RuntimeError):
    """The lab refused the request (its message says why: a bad field, too many queued runs, a wrong key)."""


@dataclass(frozen=True)
class RunResult:
    """One program's outcome. `ok`: it ran to its end with return code 0. `status`: Success | Failed |
    SandboxError (the sandbox itself failed; `message` says why)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    return_code: int | None = None
    execution_time: float | None = None
    timed_out: bool = False
    truncated: bool = False
    message: str = ""
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "Success"

    @classmethod
    def from_response(cls, r: RunCodeResponse) -> RunResult:
        run = r.run_result
        return cls(
            status=r.status,
            stdout=(run.stdout or "") if run else "",
            stderr=(run.stderr or "") if run else "",
            return_code=run.return_code if run else None,
            execution_time=run.execution_time if run else None,
            timed_out=bool(run and run.status == "TimeLimitExceeded"),
            truncated=bool(run and run.truncated),
            message=r.message,
            files={k: base64.b64decode(v) for k, v in r.files.items()},
        )


def _files(files: Mapping[str, str | bytes] | None) -> dict[str, str]:
    return {k: base64.b64encode(v.encode() if isinstance(v, str) else v).decode() for k, v in (files or {}).items()}


def request_body(
    code: str,
    *,
    language: str = "python",
    stdin: str = "",
    files: Mapping[str, str | bytes] | None = None,
    timeout: float = 10.0,
    fetch_files: Sequence[str] = (),
    memory_mb: int | None = None,
) -> dict[str, Any]:
    """A run_code request as JSON (SandboxFusion's fields)."""
    return {
        "code": code,
        "language": language,
        "stdin": stdin,
        "files": _files(files),
        "run_timeout": timeout,
        "fetch_files": list(fetch_files),
        "memory_limit_MB": -1 if memory_mb is None else memory_mb,
    }


def sandbox_url(base_url: str, api_key: str) -> str:
    """The run_code URL of the lab at `base_url` with `api_key` in it as HTTP Basic's password (SANDBOX_URL)."""
    parts = urlsplit(f"{base_url.rstrip('/')}/sandbox/run_code")
    netloc = f"openrl:{quote(api_key, safe='')}@{parts.netloc}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _batches(programs: Sequence[str | Mapping[str, Any]], kw: Mapping[str, Any]):
    """run_batch bodies of `programs`, MAX_BATCH at a time, each with the HTTP timeout it may need."""
    for i in range(0, len(programs), MAX_BATCH):
        chunk = [
            request_body(p, **kw) if isinstance(p, str) else request_body(**({**kw, **p}))
            for p in programs[i : i + MAX_BATCH]  # type: ignore[arg-type]
        ]
        yield chunk, max(b["run_timeout"] for b in chunk) * len(chunk) + SLACK_S


class SandboxClient:
    """The sandbox service of the lab at `base_url`, with `api_key`."""

    def __init__(self, base_url: str, api_key: str):
        self.base_url = base_url.rstrip("/")
        self._key = api_key
        self._headers = {"X-API-Key": api_key}
        self._http: httpx.Client | None = None

    @property
    def url(self) -> str:
        """`SANDBOX_URL` for a SandboxFusion client (tinker-cookbook's `SandboxFusionClient`): the run_code URL
        with the key in it (HTTP Basic), since such clients send no headers of their own. A secret: do not
        print it into a shared notebook."""
        return sandbox_url(self.base_url, self._key)

    def env(self) -> dict[str, str]:
        """The environment a SandboxFusion client reads: `os.environ.update(lab.sandbox.env())`."""
        return {"SANDBOX_URL": self.url}

    def _client(self) -> httpx.Client:
        if self._http is None:
            self._http = http_client(base_url=self.base_url, headers=self._headers, timeout=None)
        return self._http

    @staticmethod
    def _json(r: httpx.Response) -> Any:
        if r.status_code >= 400:
            try:
                why = r.json().get("error") or r.text
            except ValueError:
                why = r.text
            raise SandboxError(f"the lab's sandbox refused the request ({r.status_code}): {why}")
        return r.json()

    def run(self, code: str, **kw: Any) -> RunResult:
        """One program (`request_body`'s keywords: language, stdin, files, timeout, fetch_files, memory_mb)."""
        body = request_body(code, **kw)
        r = self._client().post("/sandbox/run_code", json=body, timeout=body["run_timeout"] + SLACK_S)
        return RunResult.from_response(RunCodeResponse.model_validate(self._json(r)))

    def run_many(self, programs: Sequence[str | Mapping[str, Any]], **kw: Any) -> list[RunResult]:
        """Many programs (an RL group's completions), run at once within your share of the pool; in order. Each
        is its code (with `kw`'s settings) or a dict of `run`'s arguments (`{"code": ..., "files": {...}}`, over
        `kw`). One request per MAX_BATCH programs."""
        out: list[RunResult] = []
        for chunk, timeout in _batches(programs, kw):
            out += self._results(self._client().post("/sandbox/run_batch", json={"requests": chunk}, timeout=timeout))
        return out

    async def arun(self, code: str, **kw: Any) -> RunResult:
        """`run` for an event loop (a cookbook environment's `step`, say)."""
        body = request_body(code, **kw)
        async with httpx.AsyncClient(base_url=self.base_url, headers=self._headers) as http:
            r = await http.post("/sandbox/run_code", json=body, timeout=body["run_timeout"] + SLACK_S)
        return RunResult.from_response(RunCodeResponse.model_validate(self._json(r)))

    async def arun_many(self, programs: Sequence[str | Mapping[str, Any]], **kw: Any) -> list[RunResult]:
        """`run_many` for an event loop."""
        out: list[RunResult] = []
        async with httpx.AsyncClient(base_url=self.base_url, headers=self._headers) as http:
            for chunk, timeout in _batches(programs, kw):
                out += self._results(await http.post("/sandbox/run_batch", json={"requests": chunk}, timeout=timeout))
        return out

    def _results(self, r: httpx.Response) -> list[RunResult]:
        return [RunResult.from_response(RunCodeResponse.model_validate(x)) for x in self._json(r)["responses"]]

    def status(self) -> dict:
        """The isolation in use, the pool, and your own runs (counts by outcome, seconds) and limits."""
        return self._json(self._client().get("/sandbox/status", timeout=30))

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


def status_line(s: Mapping[str, Any]) -> str:
    """`%openrl sandbox`: the status in a line."""
    if not s.get("available"):
        return f"sandbox: not available here: {s.get('unavailable')}"
    you, pool, lim = s["you"], s["pool"], s["limits"]
    outcomes = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in you["outcomes"].items() if n)
    return (
        f"sandbox: {s['isolation']}; pool {pool.get('warm', 0)} warm of {pool.get('size', '?')}, "
        f"{pool.get('running', 0)} running; you: {you['runs']} runs ({outcomes or 'none yet'}), "
        f"{you['seconds']:.1f} s, {you['running']} running, {you['waiting']} waiting; "
        f"at most {lim['per_user']} at once, run_timeout <= {lim['max_wall_s']:g} s"
    )
