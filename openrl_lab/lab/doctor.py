"""`%openrl doctor` / `openrl-lab doctor`: connect as the user would and say, one line each with the fix, what
works and what does not. Public clients only (HTTP, the orchestrator client, the tinker SDK's version).

    from openrl_lab.lab.doctor import diagnose, render
    print(render(diagnose("http://127.0.0.1:8000", api_key="...")))

Checks, in order (a check whose prerequisite failed is skipped, saying so):
  http        the lab answers GET /api/v1/healthz (and how fast)
  key         the API key is accepted, and whose it is
  version     this client's openrl-lab against the server's
  sdk         this process's tinker SDK against the versions the server is tested with
  wire        the SDK speaks protobuf to the server (0.25.0 and later) or JSON (older: slower, still served)
  clock       the server's clock against this machine's (the HTTP Date header; futures and TTLs use both)
  grpc        the time-slicing orchestrator answers on its gRPC port, and its groups
  lane        the hand-off lane (a loopback socket beside the gRPC port) when the orchestrator is on this
              machine; gRPC only otherwise (not a fault)
  tokenizer   the lab's Hugging Face mirror serves the default model's tokenizer files
  kernels     every kernel of the fleet is up
  runs        each of your runs' last sampler-vs-trainer mismatch (`sampler_kl`, logged by the RL recipe
              from forward_backward's `sampler_kl:mean`) is under SAMPLER_KL_LIMIT
"""

from __future__ import annotations

import email.utils
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from openrl_lab.home import DEFAULT_MODEL, find_api_key
from openrl_lab.sockets import http_client
from openrl_lab.version import TESTED_SDKS, __version__

# A sampler that samples the weights being trained gives ~1e-8 (float noise); one a step behind (RLConfig's
# overlap) stays orders of magnitude under this at RL learning rates. Above it, the sampler is on other weights.
SAMPLER_KL_LIMIT = 0.01
CLOCK_SKEW_LIMIT_S = 5.0
PROTOBUF_SINCE = (0, 25, 0)  # the first tinker SDK that always sends protobuf (docs/tinker-compatibility.md)

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
_MARK = {OK: "ok  ", WARN: "warn", FAIL: "FAIL", SKIP: "skip"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{_MARK[self.status]} {self.name:<9} {self.detail}" + (f" -> fix: {self.fix}" if self.fix else "")


def render(checks: list[Check]) -> str:
    bad = [c for c in checks if c.status == FAIL]
    warned = [c for c in checks if c.status == WARN]
    summary = (
        f"doctor: {len(bad)} failed, {len(warned)} warned of {len(checks)} checks"
        if bad or warned
        else f"doctor: all {len(checks)} checks passed"
    )
    return "\n".join([*(c.line() for c in checks), summary])


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def diagnose(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> list[Check]:
    """Every check against the lab at `url` with `api_key` (default: as `Lab.connect` finds it)."""
    url = url.rstrip("/")
    key = find_api_key(api_key)
    out: list[Check] = []
    with http_client(base_url=url, timeout=timeout_s, headers={"X-API-Key": key or ""}) as http:
        out.append(_http(http, url))
        if out[-1].status == FAIL:
            return out + [Check(n, SKIP, "the lab did not answer") for n in _AFTER_HTTP]
        info, check = _key(http, key)
        out.append(check)
        if info is None:
            return out + [Check(n, SKIP, "no accepted key") for n in _AFTER_HTTP[1:]]
        out += [_server_version(info), *_sdk(info), _clock(http)]
        out += _orchestrator(info, key)
        out.append(_tokenizer(http))
        out.append(_kernels(http))
        out.append(_runs(http))
    return out


_AFTER_HTTP = ("key", "version", "sdk", "wire", "clock", "grpc", "lane", "tokenizer", "kernels", "runs")


def _timed(fn: Callable[[], httpx.Response]) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = fn()
    return r, (time.perf_counter() - t0) * 1000


def _http(http: httpx.Client, url: str) -> Check:
    try:
        r, ms = _timed(lambda: http.get("/api/v1/healthz"))
    except httpx.HTTPError as e:
        return Check(
            "http",
            FAIL,
            f"no answer from {url} ({type(e).__name__}: {e})",
            "start it (openrl-lab serve, or %openrl connect --local) or give its URL (OPENRL_LAB_URL)",
        )
    if r.status_code != 200:
        return Check("http", FAIL, f"{url}/api/v1/healthz answered {r.status_code}: not an OpenRL Lab", "check the URL")
    return Check("http", OK, f"{url} answers in {ms:.0f} ms")


def _key(http: httpx.Client, key: str | None) -> tuple[dict | None, Check]:
    if not key:
        return None, Check("key", FAIL, "no API key", "pass one, or set OPENRL_LAB_API_KEY")
    r = http.get("/api/v1/lab/info")
    if r.status_code in (401, 403):
        return None, Check(
            "key",
            FAIL,
            f"the key was refused ({r.status_code})",
            "openrl-lab keys create NAME on the server, then use it",
        )
    if r.status_code != 200:
        return None, Check("key", FAIL, f"GET /api/v1/lab/info answered {r.status_code}: {r.text[:200]}")
    info = r.json()
    return info, Check("key", OK, f"accepted: user {info.get('user')!r}")


def _server_version(info: dict) -> Check:
    server = info.get("version")
    if server == __version__:
        return Check("version", OK, f"openrl-lab {__version__} here and on the server")
    return Check(
        "version", WARN, f"openrl-lab {__version__} here, {server} on the server", "install the server's version here"
    )


def _sdk(info: dict) -> list[Check]:
    try:
        import tinker

        here = tinker.__version__
    except ImportError:
        return [
            Check("sdk", FAIL, "the tinker SDK is not installed", "pip install tinker"),
            Check("wire", SKIP, "no SDK"),
        ]
    tested = info.get("tested_sdks") or list(TESTED_SDKS)
    sdk = (
        Check("sdk", OK, f"tinker {here}, one of the versions the server is tested with ({', '.join(tested)})")
        if here in tested
        else Check(
            "sdk",
            WARN,
            f"tinker {here} is not among the versions the server is tested with ({', '.join(tested)})",
            f"pip install tinker=={tested[-1]}",
        )
    )
    proto = _version(here) >= PROTOBUF_SINCE
    wire = Check(
        "wire",
        OK if proto else WARN,
        "protobuf both ways" if proto else f"JSON (tinker {here} predates protobuf): served, but larger and slower",
        "" if proto else f"pip install tinker=={tested[-1]}",
    )
    return [sdk, wire]


def _clock(http: httpx.Client) -> Check:
    before = time.time()
    r = http.get("/api/v1/healthz")
    after = time.time()
    date = r.headers.get("date")
    if not date:
        return Check("clock", SKIP, "the server sent no Date header")
    # whole seconds: the server read its clock somewhere in [stamp, stamp + 1) while we waited in [before, after]
    stamp = email.utils.parsedate_to_datetime(date).timestamp()
    skew = (stamp + 0.5) - (before + after) / 2
    if abs(skew) > CLOCK_SKEW_LIMIT_S:
        return Check(
            "clock", WARN, f"the server's clock is {skew:+.0f} s from this machine's", "sync both clocks (NTP)"
        )
    return Check("clock", OK, f"within {CLOCK_SKEW_LIMIT_S:g} s of the server's ({skew:+.1f} s, to the header's 1 s)")


def _orchestrator(info: dict, key: str | None) -> list[Check]:
    target = info.get("grpc_target")
    if not target:
        return [
            Check("grpc", WARN, "the lab runs without the time-slicing orchestrator (--grpc-port -1)"),
            Check("lane", SKIP, "no orchestrator"),
        ]
    from openrl_lab.orchestrator import OrchestratorError, TimeSliceOrchestratorClient

    client = TimeSliceOrchestratorClient(target, api_key=key, retry_timeout_s=3, job="doctor")
    try:
        t0 = time.perf_counter()
        groups = client.list_groups()
        ms = (time.perf_counter() - t0) * 1000
        grpc = Check("grpc", OK, f"{target} answers in {ms:.0f} ms; groups {', '.join(g.group_id for g in groups)}")
    except OrchestratorError as e:
        client.close()
        return [
            Check("grpc", FAIL, f"{target}: {e}", "open the gRPC port to this machine, or run here"),
            Check("lane", SKIP, "no gRPC"),
        ]
    try:
        lane = client.lane_address()
    finally:
        client.close()
    if lane is None:
        return [grpc, Check("lane", OK, "not offered to this client (the orchestrator is elsewhere): gRPC only")]
    try:
        socket.create_connection(lane, timeout=2).close()
    except OSError as e:
        return [grpc, Check("lane", WARN, f"offered at {lane[0]}:{lane[1]} but unreachable ({e}): gRPC is used")]
    return [grpc, Check("lane", OK, f"{lane[0]}:{lane[1]} reachable (hand-offs take it)")]


def _tokenizer(http: httpx.Client) -> Check:
    r = http.get(f"/hf/api/models/{DEFAULT_MODEL}")
    if r.status_code != 200:
        return Check(
            "tokenizer", FAIL, f"the mirror answered {r.status_code} for {DEFAULT_MODEL}", "see the server's log"
        )
    files = [s.get("rfilename") for s in r.json().get("siblings", [])]
    if not any(f and f.startswith("tokenizer") for f in files):
        return Check("tokenizer", FAIL, f"the mirror lists no tokenizer files for {DEFAULT_MODEL}")
    return Check("tokenizer", OK, f"the mirror serves {DEFAULT_MODEL}'s tokenizer ({len(files)} files)")


def _kernels(http: httpx.Client) -> Check:
    kernels = http.get("/api/v1/lab/kernels").json().get("kernels", [])
    if not kernels:
        return Check("kernels", FAIL, "the fleet has no kernel", "start one (openrl-lab kernel join ...)")
    down = [k for k in kernels if k.get("state") != "up"]
    if down:
        why = "; ".join(f"{k['name']} {k.get('state')}: {k.get('lost_why') or '?'}" for k in down)
        return Check(
            "kernels",
            FAIL,
            f"{len(down)} of {len(kernels)} not up ({why})",
            "restart them; runs restore from checkpoints",
        )
    return Check(
        "kernels", OK, ", ".join(f"{k['name']} up ({k['group']}, {k['device']}, {k['jobs']} jobs)" for k in kernels)
    )


def _runs(http: httpx.Client) -> Check:
    leases = http.get("/api/v1/lab/leases").json().get("leases", [])
    off = []
    for lease in leases:
        kl = (lease.get("last_metrics") or {}).get("sampler_kl")
        if isinstance(kl, (int, float)) and kl > SAMPLER_KL_LIMIT:
            off.append(f"{lease['name']} sampler_kl {kl:.3g}")
    if off:
        return Check(
            "runs",
            WARN,
            f"the sampler samples other weights than the trainer trains: {', '.join(off)} (limit {SAMPLER_KL_LIMIT:g})",
            "sample from save_weights_and_get_sampling_client() after each optim_step",
        )
    return Check("runs", OK, f"{len(leases)} runs, none with sampler_kl over {SAMPLER_KL_LIMIT:g}")
