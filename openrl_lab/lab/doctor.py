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
  rights      what the key may do: the user it acts as, the orchestrator leases that user holds against the
              per-user limit (GET /api/v1/lab/info's `max_leases_per_user`: warn at LEASE_LIMIT_WARN of it,
              fail at it, with how to close which), and any lease whose quota is used up or nearly (QUOTA_WARN)
  tokenizer   the lab's Hugging Face mirror serves the default model's tokenizer files
  kernels     every kernel of the fleet is up
  sandbox     the sandbox service can run code rewards here (the isolation in use), or what the host lacks
  runs        each of your runs' last sampler-vs-trainer mismatch (`sampler_kl`, logged by the RL recipe
              from forward_backward's `sampler_kl:mean`) is under SAMPLER_KL_LIMIT, and none is in a collapse
              (its log's `collapse` flag on its last step: openrl_lab/collapse.py)
  phase       a real phase, as a job runs one: a batch lease of its own (`doctor-<host>-<pid>`) on your default
              group (`trainer-group`, else the first listed), a slice acquired within PHASE_TIMEOUT_S and
              released, the lease closed (always); the wait and the round trip. A busy group is a warning
              naming who holds and waits, not a fault; a refused acquire fails with the server's message
"""

from __future__ import annotations

import email.utils
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from openrl_lab.collapse import ENTROPY_FLOOR
from openrl_lab.home import DEFAULT_MODEL, find_api_key
from openrl_lab.sockets import http_client
from openrl_lab.version import TESTED_SDKS, __version__

if TYPE_CHECKING:
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient
    from openrl_lab.orchestrator.types import GroupInfo, LeaseInfo, QueueEntry

# A sampler that samples the weights being trained gives ~1e-8 (float noise); one a step behind (RLConfig's
# overlap) stays orders of magnitude under this at RL learning rates. Above it, the sampler is on other weights.
SAMPLER_KL_LIMIT = 0.01
CLOCK_SKEW_LIMIT_S = 5.0
PROTOBUF_SINCE = (0, 25, 0)  # the first tinker SDK that always sends protobuf (docs/tinker-compatibility.md)
LEASE_LIMIT_WARN = 0.9  # of max_leases_per_user: past it a few more runs are refused
QUOTA_WARN = 0.9  # of a lease's quota_s: past it its next phases are about to be refused
DEFAULT_GROUP = "trainer-group"  # where Lab.lease runs go unless told (an alias on every discovered fleet)
# The phase check's acquire: an idle group grants at once (acquire to release 4 ms on a loopback lab, 2-core dev
# VM), a resident job's eviction counting in; past this the group counts as busy: a warning, not a fault.
PHASE_TIMEOUT_S = 5.0
PHASE_LEASE_TTL_S = 60.0  # the phase check's lease goes this long after a doctor killed mid-check stops heartbeating

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
        target = info.get("grpc_target")
        client = _orchestrator_client(target, key) if target else None
        try:
            groups, checks = _orchestrator(target, client)
            out += checks
            rights = _rights(http, info, client) if groups is not None and client is not None else None
            out.append(rights or Check("rights", SKIP, "no orchestrator" if client is None else "no gRPC"))
            out.append(_tokenizer(http))
            out.append(_kernels(http))
            out.append(_sandbox(http))
            out.append(_runs(http))
            if client is None or groups is None:
                out.append(Check("phase", SKIP, "no orchestrator" if client is None else "no gRPC"))
            elif rights is not None and rights.status == FAIL:
                out.append(Check("phase", SKIP, "the rights check failed: a lease of its own would be refused"))
            else:
                out.append(_phase(client, groups))
        finally:
            if client is not None:
                client.close()
    return out


_AFTER_HTTP = (
    "key",
    "version",
    "sdk",
    "wire",
    "clock",
    "grpc",
    "lane",
    "rights",
    "tokenizer",
    "kernels",
    "sandbox",
    "runs",
    "phase",
)


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


def _phase_lease_name() -> str:
    """`doctor-<host>-<pid>`, in the characters a lease name may have."""
    host = re.sub(r"[^A-Za-z0-9._:@/+-]", "-", socket.gethostname())
    return f"doctor-{host}-{os.getpid()}"[:128]


def _orchestrator_client(target: str, key: str | None) -> TimeSliceOrchestratorClient:
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient

    return TimeSliceOrchestratorClient(
        target, api_key=key, retry_timeout_s=3, job=_phase_lease_name(), priority="batch", ttl_s=PHASE_LEASE_TTL_S
    )


def _orchestrator(
    target: str | None, client: TimeSliceOrchestratorClient | None
) -> tuple[list[GroupInfo] | None, list[Check]]:
    """The grpc and lane checks, and the orchestrator's groups (None: it did not answer, or there is none)."""
    if not target or client is None:
        return None, [
            Check("grpc", WARN, "the lab runs without the time-slicing orchestrator (--grpc-port -1)"),
            Check("lane", SKIP, "no orchestrator"),
        ]
    from openrl_lab.orchestrator import OrchestratorError

    try:
        t0 = time.perf_counter()
        groups = client.list_groups()
        ms = (time.perf_counter() - t0) * 1000
        grpc = Check("grpc", OK, f"{target} answers in {ms:.0f} ms; groups {', '.join(g.group_id for g in groups)}")
    except OrchestratorError as e:
        return None, [
            Check("grpc", FAIL, f"{target}: {e}", "open the gRPC port to this machine, or run here"),
            Check("lane", SKIP, "no gRPC"),
        ]
    lane = client.lane_address()
    if lane is None:
        return groups, [
            grpc,
            Check("lane", OK, "not offered to this client (the orchestrator is elsewhere): gRPC only"),
        ]
    try:
        socket.create_connection(lane, timeout=2).close()
    except OSError as e:
        return groups, [
            grpc,
            Check("lane", WARN, f"offered at {lane[0]}:{lane[1]} but unreachable ({e}): gRPC is used"),
        ]
    return groups, [grpc, Check("lane", OK, f"{lane[0]}:{lane[1]} reachable (hand-offs take it)")]


def _names(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _closing(leases: list[LeaseInfo], runs: set[str]) -> str:
    """How to close `leases` (idle ones named first), by who drives each: a notebook run's lease goes with the
    run, a tinker SDK run's with its session (kernels drive both: the user cannot close them directly), the
    user's own jobs' leases with close_lease."""
    leases = sorted(leases, key=lambda lease: (lease.state != "idle", lease.created_at))
    lab = [lease.name for lease in leases if lease.driven_by and lease.name in runs]
    sdk = [lease.name for lease in leases if lease.driven_by and lease.name not in runs]
    own = [f"{lease.name} ({lease.group_id})" for lease in leases if not lease.driven_by]
    ways = []
    if lab:
        ways.append(f"%openrl release NAME (lab.release(NAME)) for the runs {_names(lab)}")
    if sdk:
        ways.append(f"end the tinker sessions (ServiceClient) of the SDK runs {_names(sdk)}")
    if own:
        ways.append(f"TimeSliceOrchestratorClient(...).close_lease(GROUP, NAME) for {_names(own)}")
    return "; ".join(ways)


def _more_quota(lease: LeaseInfo, runs: set[str]) -> str:
    """How to give `lease` more quota, or close it. A kernel takes a run's quota when the run starts: a run is
    ended (which closes its lease) and started again; the user's own job reattaches with a larger one."""
    name, group = lease.name, lease.group_id
    if not lease.driven_by:
        return (
            f"reattach it with a larger quota (TimeSliceOrchestratorClient(...).lease({group!r}, {name!r}, "
            f"quota_s=...)) or close it (.close_lease({group!r}, {name!r}))"
        )
    if name in runs:
        return f"%openrl release {name} (lab.release), then %openrl lease {name} --quota S with a larger S"
    return "end its tinker session (ServiceClient), then start the run again with a larger user_metadata openrl_quota_s"


def _rights(http: httpx.Client, info: dict, client: TimeSliceOrchestratorClient) -> Check:
    from openrl_lab.orchestrator import OrchestratorError

    user = info.get("user")
    try:
        # what it owns counts against its limit, the leases kernels drive for its runs included
        mine = [lease for lease in client.leases() if lease.owner == user]
    except OrchestratorError as e:
        return Check("rights", FAIL, f"user {user!r}: listing its leases was refused: {e}", "see the server's log")
    limit = info.get("max_leases_per_user")
    detail = f"user {user!r}: {len(mine)} orchestrator leases open" + (
        f" of at most {limit}" if limit else " (the server does not say its limit: older than this client)"
    )
    runs = {r.get("name") for r in http.get("/api/v1/lab/leases").json().get("leases", [])}
    status, problems, fixes = OK, [], []
    if limit and len(mine) >= limit:
        status = FAIL
        problems.append("at the limit: every new lease is refused (a new run, a new job)")
        fixes.append(f"close leases: {_closing(mine, runs)}")
    elif limit and len(mine) >= LEASE_LIMIT_WARN * limit:
        status = WARN
        problems.append(f"{limit - len(mine)} more and new ones are refused")
        fixes.append(f"close leases you no longer use: {_closing(mine, runs)}")
    spent = [lease for lease in mine if lease.quota_s > 0 and lease.used_s >= QUOTA_WARN * lease.quota_s]
    for lease in spent:
        status = FAIL if status == FAIL else WARN
        used = "used up" if lease.used_s >= lease.quota_s else "nearly used up"
        problems.append(
            f"lease {lease.name} ({lease.group_id}) has {used} its quota ({lease.used_s:.1f} of {lease.quota_s:g} s)"
        )
        fixes.append(f"{lease.name}: {_more_quota(lease, runs)}")
    if problems:
        detail += ": " + "; ".join(problems)
    return Check("rights", status, detail, "; ".join(fixes))


def _default_group(groups: list[GroupInfo]) -> GroupInfo:
    return next((g for g in groups if DEFAULT_GROUP in (g.group_id, *g.aliases)), groups[0])


def _who(e: QueueEntry) -> str:
    return (f"your job {e.job!r}" if e.mine else "another user's job") + (f" ({e.kind})" if e.kind else "")


def _busy(client: TimeSliceOrchestratorClient, group: GroupInfo) -> str:
    """Who holds the group and how many wait, as its status shows them to this user."""
    from openrl_lab.orchestrator import OrchestratorError
    from openrl_lab.orchestrator.types import GroupStatus

    try:
        status = client.get_status(group.group_id)
    except OrchestratorError as e:
        return f"its status was refused: {e}"
    assert isinstance(status, GroupStatus)  # one group asked, one answered
    held = f"held by {_who(status.holder)}" if status.holder is not None else "free again"
    yours = [e.job for e in status.queue if e.mine]
    waiting = f"{len(status.queue)} waiting" + (f" (yours: {_names(yours)})" if yours else "")
    return f"{held}, {waiting}" + (", switching jobs" if status.switching else "")


def _phase(client: TimeSliceOrchestratorClient, groups: list[GroupInfo]) -> Check:
    """One phase end to end on a lease of the doctor's own, closed however the phase ends."""
    from openrl_lab.orchestrator import OrchestratorError

    if not groups:
        return Check("phase", FAIL, "the orchestrator lists no group", "see the server's log")
    group = _default_group(groups)
    gid, name = group.group_id, client.job
    try:
        client.lease(gid)
    except OrchestratorError as e:
        return Check("phase", FAIL, f"a lease on group {gid!r} was refused: {e}", "see the rights check")
    try:
        check = _one_phase(client, group)
    finally:
        try:
            client.close_lease(gid)
            left = None
        except OrchestratorError as e:
            left = e
    if left is not None:  # whatever the phase did, a lease left behind is the worse news
        return Check(
            "phase",
            FAIL,
            f"its lease {name} on group {gid!r} could not be closed: {left}",
            f"nothing: it expires {PHASE_LEASE_TTL_S:g} s after its last heartbeat",
        )
    return check


def _one_phase(client: TimeSliceOrchestratorClient, group: GroupInfo) -> Check:
    from openrl_lab.orchestrator import DeadlineExceeded, OrchestratorError

    gid = group.group_id
    t0 = time.perf_counter()
    try:
        s = client.acquire(gid, kind="doctor", timeout=PHASE_TIMEOUT_S)
    except DeadlineExceeded:
        return Check(
            "phase",
            WARN,
            f"group {gid!r} is busy: no slice within {PHASE_TIMEOUT_S:g} s ({_busy(client, group)})",
            "nothing is broken while those jobs run: try again later; %openrl top shows the group's holder and "
            f"queue (a phase held past max_phase_s, {group.max_phase_s:g} s, while others wait is revoked)",
        )
    except OrchestratorError as e:
        return Check("phase", FAIL, f"the acquire on group {gid!r} was refused: {e}", "see the server's log")
    try:
        client.release(s)
    except OrchestratorError as e:
        return Check("phase", FAIL, f"the release on group {gid!r} was refused: {e}", "see the server's log")
    ms = (time.perf_counter() - t0) * 1000
    switch = s.grant.switch_wait_s * 1000
    return Check(
        "phase",
        OK,
        f"group {gid!r}: waited {s.waited_s * 1000:.0f} ms"
        + (f" ({switch:.0f} ms of it another job's eviction)" if switch else "")
        + f"; acquire to release {ms:.0f} ms (lease {client.job}, closed again)",
    )


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


def _sandbox(http: httpx.Client) -> Check:
    """The sandbox service (code rewards): the isolation in use, or what the host lacks. Not a failure: a lab
    whose users run no code needs none."""
    r = http.get("/sandbox/status")
    if r.status_code == 404:
        return Check("sandbox", SKIP, "this lab has no sandbox service (older than issue 30)")
    s = r.json()
    if not s.get("available"):
        return Check(
            "sandbox",
            WARN,
            f"code rewards cannot run here: {s.get('unavailable')}",
            "install what it names on the lab's host (make sandbox-tools), or set OPENRL_SANDBOX_REMOTE_URL",
        )
    return Check("sandbox", OK, str(s.get("isolation")))


def _runs(http: httpx.Client) -> Check:
    leases = http.get("/api/v1/lab/leases").json().get("leases", [])
    off = []
    for lease in leases:
        kl = (lease.get("last_metrics") or {}).get("sampler_kl")
        if isinstance(kl, (int, float)) and kl > SAMPLER_KL_LIMIT:
            off.append(f"{lease['name']} sampler_kl {kl:.3g}")
    collapsed = [f"{x['name']} since step {x['collapse_since']}" for x in leases if x.get("collapse_since") is not None]
    problems, fixes = [], []
    if off:
        problems.append(
            f"the sampler samples other weights than the trainer trains: {', '.join(off)} (limit {SAMPLER_KL_LIMIT:g})"
        )
        fixes.append("sample from save_weights_and_get_sampling_client() after each optim_step")
    if collapsed:
        problems.append(
            f"collapsed (entropy under {ENTROPY_FLOOR} nats/token while the reward fell or stayed at zero): "
            + ", ".join(collapsed)
        )
        fixes.append("restart it from a checkpoint before the collapse with a lower learning rate or a kl_coef")
    if problems:
        return Check("runs", WARN, "; ".join(problems), "; ".join(fixes))
    return Check("runs", OK, f"{len(leases)} runs, none collapsed, none with sampler_kl over {SAMPLER_KL_LIMIT:g}")
