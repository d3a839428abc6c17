"""The notebook layer's client library: works in any Python process, with or without Jupyter.

    from openrl_lab.lab import Lab
    lab = Lab.connect()                       # a running lab, or an embedded one started for you
    run = lab.lease("grpo-1", group="trainer-group", model="openrl-lab/tiny-llama-1m", rank=16)
    full = lab.lease("sft-1", full=True)      # full fine-tuning: every weight (the lease says what it holds)
    big = lab.lease("sft-2", full=True, devices=2)  # one run sharded over 2 devices (a gang: FSDP2)
    run.training.forward_backward(...)        # the plain tinker TrainingClient
    run.log(step, reward=..., loss=...)       # kept by the control plane, drawn by run.plot()
    ...                                       # notebook kernel restarted:
    run = Lab.connect().attach("grpo-1")      # same kernel job, same state, history replayed

It talks to the control plane only through public clients: the tinker SDK (Tinker HTTP API), the lab's
REST endpoints (/api/v1/lab/...) and the orchestrator's gRPC client. The magics are a thin layer on this.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload
from urllib.parse import urlsplit

import httpx
import pandas as pd

from openrl_lab.collapse import COLLAPSE_METRIC, CollapseWarning, CollapseWatch
from openrl_lab.home import DEFAULT_MODEL, default_home
from openrl_lab.lab.connection import Connection, LabError, find_connection
from openrl_lab.memory import FULL_FINETUNE_RANK, MAX_LORA_RANK, fmt_bytes
from openrl_lab.orchestrator.types import PRIORITIES
from openrl_lab.sockets import http_client

if TYPE_CHECKING:
    import tinker

    from openrl_lab.lab.widgets import LivePlot
    from openrl_lab.orchestrator import TimeSliceOrchestratorClient
    from openrl_lab.sandbox.client import SandboxClient

DEFAULT_RANK = 16  # LoRA rank of a lease that names none
LOG_FLUSH_S = 1.0  # metric rows reach the control plane at most this late (batched: one request per flush)
FOLLOW_POLL_S = 0.5  # a followed plot (`plot(follow=True)`) asks the control plane for new steps this often
MAX_DEVICES = 64  # the most devices one run may be sharded over (the gateway checks `openrl_devices` too)
DEVICES_KEY = "openrl_devices"  # user_metadata: how many devices a new run asks for (absent: 1)


def check_devices(devices: Any) -> int:
    """`devices` as a number of devices for one run: an int from 1 to MAX_DEVICES, else a ValueError naming it."""
    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"devices must be a whole number of devices from 1 to {MAX_DEVICES}, got {devices!r}")
    return devices


def devices_metadata(devices: int) -> dict[str, str]:
    """The user_metadata that asks for `devices` devices: nothing for one (a single-device request stays as it
    always was, for servers that predate gangs too), else `openrl_devices` as a string (user_metadata's values
    are strings)."""
    return {} if check_devices(devices) == 1 else {DEVICES_KEY: str(devices)}


class Lab:
    """A connection to one control plane, as one user (the API key's)."""

    def __init__(self, connection: Connection, server=None):
        self.connection = connection
        self.server = server  # the embedded control plane this process started, if any
        self.http = http_client(base_url=connection.base_url, headers=connection.headers(), timeout=30)
        self._service: tinker.ServiceClient | None = None
        self._orchestrator: TimeSliceOrchestratorClient | None = None
        self._sandbox: SandboxClient | None = None
        self._leases: dict[str, LabLease] = {}

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        *,
        api_key: str | None = None,
        home: str | Path | None = None,
        local: bool = False,
        device: str = "auto",
    ) -> Lab:
        """A running control plane (explicit URL, $OPENRL_LAB_URL, or this home's connection.json); with
        `local=True`, or when none runs and no URL was given, an embedded one started under `home`. The
        embedded one outlives this process, so a restarted notebook kernel finds it again."""
        home = Path(home).expanduser() if home else default_home()
        conn = None if local and not url else find_connection(url, api_key, home)
        if conn is not None:
            return cls(conn)
        from openrl_lab.server import LabServer

        server = LabServer(home, device=device, detach=True).start()
        return cls(find_connection(server.base_url, api_key or server.api_key, home), server=server)

    # --- public clients ---------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return self.connection.base_url

    @property
    def service(self) -> tinker.ServiceClient:
        """The tinker SDK's ServiceClient for this lab (one session per Lab)."""
        if self._service is None:
            import tinker

            self._service = tinker.ServiceClient(base_url=self.base_url, api_key=self.connection.api_key)
        return self._service

    @property
    def sandbox(self) -> SandboxClient:
        """The lab's sandbox service: model-written code run in isolation (`run`, `run_many` for a whole RL
        group, `arun`/`arun_many`, `status()`), and `url`/`env()` for a SandboxFusion client (tinker-cookbook's
        code_rl: `os.environ.update(lab.sandbox.env())`)."""
        if self._sandbox is None:
            from openrl_lab.sandbox.client import SandboxClient

            self._sandbox = SandboxClient(self.base_url, self.connection.api_key or "")
        return self._sandbox

    @property
    def orchestrator(self) -> TimeSliceOrchestratorClient:
        if self._orchestrator is None:
            from openrl_lab.orchestrator import TimeSliceOrchestratorClient

            target = self.connection.grpc_target or self._get("/api/v1/lab/info").get("grpc_target")
            if not target:
                raise LabError(
                    f"the lab at {self.base_url} runs without the time-slicing orchestrator "
                    "(started with --grpc-port -1)"
                )
            # a notebook's own phases (%%openrl phase, on_accelerators) are someone waiting on a cell
            self._orchestrator = TimeSliceOrchestratorClient(
                target, api_key=self.connection.api_key, priority="interactive"
            )
        return self._orchestrator

    def load_tokenizer(self, tokenizer_id: str):
        """A served model's tokenizer, wherever this process runs. `tokenizer_id` is what get_info gives: the
        model's directory when this process is on the server's machine (loaded from there), else a repo id of
        the lab's Hugging Face mirror (`<base_url>/hf`): its files are downloaded with huggingface_hub, with this
        lab's key, into a cache of this lab's own under the user's cache directory (`tokenizer_cache`), so no
        model hub and no filesystem shared with the server is needed."""
        from transformers import AutoTokenizer

        if os.path.isdir(tokenizer_id):
            return AutoTokenizer.from_pretrained(tokenizer_id)
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        try:
            # huggingface_hub, not the tinker SDK's loader: it would ask HF_ENDPOINT (by default the public hub)
            snapshot = snapshot_download(
                tokenizer_id,
                endpoint=f"{self.base_url}/hf",
                token=self.connection.api_key,
                cache_dir=tokenizer_cache(self.base_url),
            )
        except HFValidationError:
            raise LabError(
                f"the lab gave tokenizer_id {tokenizer_id!r}: not a directory on this machine, and not a "
                "repository of its /hf mirror (a server older than this client?)"
            ) from None
        except LocalEntryNotFoundError as e:
            if constants.HF_HUB_OFFLINE:
                raise LabError(
                    f"cannot download the tokenizer of {tokenizer_id!r} from the lab's mirror "
                    f"({self.base_url}/hf): HF_HUB_OFFLINE is set, and huggingface_hub then downloads "
                    "nothing, not even from the lab; unset it for the first load (later loads use the "
                    "cache)"
                ) from None
            raise LabError(
                f"could not download the tokenizer of {tokenizer_id!r} from the lab's mirror "
                f"({self.base_url}/hf): {_hub_message(e.__cause__ or e)}"
            ) from None
        except Exception as e:  # noqa: BLE001 - huggingface_hub's HTTP errors carry the server's message
            raise LabError(
                f"could not download the tokenizer of {tokenizer_id!r} from the lab's mirror "
                f"({self.base_url}/hf): {_hub_message(e)}"
            ) from None
        return AutoTokenizer.from_pretrained(snapshot)

    # --- REST -------------------------------------------------------------------------------------
    @overload
    def _request(self, method: str, path: str, *, missing_ok: Literal[False] = False, **kw) -> httpx.Response: ...
    @overload
    def _request(self, method: str, path: str, *, missing_ok: bool, **kw) -> httpx.Response | None: ...
    def _request(self, method: str, path: str, *, missing_ok: bool = False, **kw) -> httpx.Response | None:
        """The response, or a LabError with the server's message (None for a 404 when `missing_ok`)."""
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise LabError(f"the lab at {self.base_url} did not answer: {e}") from None
        if r.status_code == 404 and missing_ok:
            return None
        if r.status_code >= 400:
            try:
                msg = r.json().get("error") or r.text
            except ValueError:
                msg = r.text
            raise LabError(msg.strip() or f"HTTP {r.status_code} from {path}") from None
        return r

    def _get(self, path: str, **params) -> dict:
        return self._request("GET", path, params=params or None).json()

    def _lease_record(self, name: str) -> dict | None:
        r = self._request("GET", f"/api/v1/lab/leases/{name}", missing_ok=True)
        return r.json() if r is not None else None

    # --- leases -----------------------------------------------------------------------------------
    def lease(
        self,
        name: str,
        group: str = "trainer-group",
        model: str = DEFAULT_MODEL,
        rank: int | None = None,
        *,
        full: bool = False,
        seed: int | None = None,
        weight: float | None = None,
        quota_s: float | None = None,
        priority: str = "interactive",
        devices: int = 1,
    ) -> LabLease:
        """A new named training run: a LoRA training client on `model` (`rank`, default 16), or with `full=True`
        full fine-tuning (every weight, on its own copy of the model: its weights, gradients and AdamW moments,
        16 bytes per parameter, must fit on the group's device; the lease states how much). Its phases run on
        `group` under an orchestrator lease of the same name (fair-share `weight`, `quota_s` accelerator-seconds
        at most). `priority`: interactive (the default: a person waits on it, so its phases go before waiting
        batch phases, within the group's interactive share) or batch. `devices`: how many devices the run is
        sharded over (1 to 64; default 1): with N > 1 it is a gang of N ranks on N kernels, rank 0 on `group`,
        whose slices are granted all together (`LabLease.devices`, and the status rows say where each rank is);
        the tinker client and checkpoints are the same as for one device. ValueError for a bad `devices`."""
        devices = check_devices(devices)
        if priority not in PRIORITIES:
            raise LabError(f"priority {priority!r} is not a priority class: one of {', '.join(PRIORITIES)}")
        if full and rank is not None:
            raise LabError(f"full fine-tuning trains every weight: it takes no LoRA rank (got rank {rank!r})")
        rank = None if full else DEFAULT_RANK if rank is None else rank
        if not full and (not isinstance(rank, int) or not 1 <= rank <= MAX_LORA_RANK):
            raise LabError(f"rank {rank!r} is out of range [1, {MAX_LORA_RANK}] (full=True for full fine-tuning)")
        if self._lease_record(name) is not None:
            raise LabError(
                f"lease {name!r} already exists: attach to it (%openrl attach {name} / "
                f"lab.attach({name!r})) or release it first"
            )
        # the server checks them (gateway/leases.py)
        slicing = {"openrl_lease": name, "openrl_group": group, "openrl_priority": priority}
        slicing |= {k: str(v) for k, v in (("openrl_weight", weight), ("openrl_quota_s", quota_s)) if v is not None}
        slicing |= devices_metadata(devices)
        try:
            # LoRA rank 0 is how the SDK asks this lab for full fine-tuning (gateway/routes/training.py)
            training = self.service.create_lora_training_client(
                base_model=model, rank=FULL_FINETUNE_RANK if full else rank, seed=seed, user_metadata=slicing
            ).result()  # the SDK returns a future-like handle: wait here, so its errors surface here
        except Exception as e:  # noqa: BLE001 - the SDK's errors carry the server's message
            raise LabError(f"could not create a training client on {model!r}: {_message(e)}") from None
        record = self._request(
            "PUT",
            f"/api/v1/lab/leases/{name}",
            json={"group": group, "base_model": model, "rank": rank, "model_id": training.model_id},
        ).json()
        if _devices(record) != devices:  # a server that predates gangs ignores openrl_devices: never silently
            self._request("DELETE", f"/api/v1/lab/leases/{name}", missing_ok=True)
            raise LabError(
                f"the lab at {self.base_url} made lease {name!r} on {_devices(record)} device(s), not the "
                f"{devices} asked for (a control plane older than this client?); the run was released"
            )
        return self._bind(record, training)

    def attach(self, name: str) -> LabLease:
        """The named run again, from a fresh process: a new handle on the same kernel job (its state and
        metric history intact); if the kernel restarted meanwhile, restored from the run's last checkpoint."""
        record = self._lease_record(name)
        if record is None:
            raise LabError(f"no lease named {name!r}; your leases: {', '.join(self.lease_names()) or '(none)'}")
        holder = self.service.holder
        seq = holder.get_training_client_id()
        r = self.http.post(
            f"/api/v1/lab/leases/{name}/attach", json={"session_id": holder.get_session_id(), "model_seq_id": seq}
        )
        if r.status_code == 409 and record.get("checkpoint"):
            training = self.service.create_training_client_from_state_with_optimizer(
                record["checkpoint"],
                # a run on several devices is restored on as many (its checkpoint loads on any number)
                user_metadata={"openrl_lease": name, "openrl_group": record["group"]}
                | devices_metadata(_devices(record)),
            ).result()
            record = self._request(
                "PUT",
                f"/api/v1/lab/leases/{name}",
                json={
                    "group": record["group"],
                    "base_model": record["base_model"],
                    "rank": record["rank"],
                    "model_id": training.model_id,
                    "checkpoint": record["checkpoint"],
                },
            ).json()
            return self._bind(record, training, restored_from=record["checkpoint"])
        if r.status_code >= 400:
            raise LabError(r.json().get("error", r.text))
        record = r.json()
        return self._bind(record, _training_client(holder, seq, record["model_id"]))

    def fork(
        self, run: LabLease | str, names: Sequence[str], *, priority: str = "interactive", **settings: Any
    ) -> list[LabLease]:
        """New runs that carry on from `run` as it is now: its weights, pending gradients, AdamW state and step,
        copied on its kernel (no checkpoint round trip), each a lease of its own named `names[i]` with its
        metric history so far. `settings` are the variants' settings, recorded with each (`LabLease.variant`)
        for your loop to read: a list gives one value per name (`learning_rate=[3e-4, 1e-3]`), anything else
        the same value for all. A full fine-tuning run's copy is refused with the sizes when it does not fit,
        and a run on several devices is not forked (the lab refuses it, saying so: save it and start a lease
        from the checkpoint instead)."""
        source = run if isinstance(run, str) else run.name
        names = [names] if isinstance(names, str) else list(names)
        if not names or len(set(names)) != len(names):
            raise LabError(f"fork needs distinct new names, got {names!r}")
        per_name = {}
        for key, value in settings.items():
            values = list(value) if isinstance(value, (list, tuple)) else [value] * len(names)
            if len(values) != len(names):
                raise LabError(f"setting {key!r} has {len(values)} values for {len(names)} names")
            per_name[key] = values
        if priority not in PRIORITIES:
            raise LabError(f"priority {priority!r} is not a priority class: one of {', '.join(PRIORITIES)}")
        if not isinstance(run, str):
            run.flush()  # its history so far goes with the forks
        holder = self.service.holder
        forks = []
        for i, name in enumerate(names):
            seq = holder.get_training_client_id()
            body = {
                "session_id": holder.get_session_id(),
                "model_seq_id": seq,
                "name": name,
                "priority": priority,
                "settings": {k: v[i] for k, v in per_name.items()},
            }
            record = self._request("POST", f"/api/v1/lab/leases/{source}/fork", json=body).json()
            forks.append(self._bind(record, _training_client(holder, seq, record["model_id"])))
        return forks

    def compare(
        self, runs: Sequence[LabLease | str], metrics: Sequence[str] = ("reward", "loss"), *, follow: bool = True
    ) -> Comparison:
        """The runs' curves overlaid in one live plot (a series per metric and run) and a summary table
        (`Comparison.summary()`: per run its variant settings, steps, and each metric's last and best values).
        The plot grows as the runs log: in this process at once, and (`follow`, the default) from any other
        notebook or script through the control plane, as `plot(follow=True)` does."""
        leases = [self._leases.get(r, None) or self.attach(r) if isinstance(r, str) else r for r in runs]
        return Comparison(leases, list(metrics), follow=follow)

    def _bind(self, record: dict, training, restored_from: str | None = None) -> LabLease:
        old = self._leases.pop(record["name"], None)
        if old is not None:
            old.close()
        lease = LabLease(self, record, training, restored_from=restored_from)
        self._leases[lease.name] = lease
        return lease

    def release(self, name: str) -> None:
        """Ends the run: its kernel job is dropped (device and host memory freed); checkpoints stay."""
        lease = self._leases.pop(name, None)
        if lease is not None and lease.close():
            # Steps just sent: a plot following this run from another notebook polls every FOLLOW_POLL_S; the
            # lease's rows go with it, so leave it one poll to read them.
            time.sleep(FOLLOW_POLL_S + 0.2)
        self._request("DELETE", f"/api/v1/lab/leases/{name}")

    def lease_names(self) -> list[str]:
        return [r["name"] for r in self._get("/api/v1/lab/leases")["leases"]]

    # --- what is going on -------------------------------------------------------------------------
    def status(self) -> list[dict]:
        """One row per lease of yours, the view `%openrl status`, the LeasePanel, the server extension and the
        JupyterLab sidebar share (`openrl_lab.lab.rows`): name, canonical group, state (running | waiting | idle |
        evicted | lost), resident, share of the group among your live leases, weight, use, queue position, the
        orchestrator's reason and rough expected wait while waiting, kernel and host, model, last step, metrics,
        reward, checkpoint."""
        from openrl_lab.lab.rows import lease_rows

        lab = self._get("/api/v1/lab/leases")["leases"]
        try:
            orchestrator = self.orchestrator
        except LabError:  # a lab without the orchestrator: its runs are not sliced
            return lease_rows(lab, [], {})
        return lease_rows(lab, orchestrator.leases(), orchestrator.list_groups())

    def leases(self) -> pd.DataFrame:
        """`status()` as a DataFrame (one row per lease)."""
        from openrl_lab.lab.rows import ROW_KEYS

        return pd.DataFrame(self.status(), columns=list(ROW_KEYS))

    def kernels(self) -> pd.DataFrame:
        """The fleet: every kernel with its host, device, group, state, resident jobs, memory and last heartbeat."""
        rows = self._get("/api/v1/lab/kernels")["kernels"]
        columns = [
            "name",
            "state",
            "group",
            "device",
            "host",
            "origin",
            "jobs",
            "samplers",
            "device_bytes",
            "rss_bytes",
            "last_heartbeat",
            "lost_why",
        ]
        return pd.DataFrame([{c: r.get(c) for c in columns} for r in rows], columns=columns)

    def queues(self, window_s: float = 60.0) -> list:
        """Every group: holder, queue (position, reason, expected wait), resident jobs, duty cycle."""
        status = self.orchestrator.get_status(window_s=window_s)
        return status if isinstance(status, list) else [status]

    def timeline(self, group: str = "default", since_s: float = 300.0) -> pd.DataFrame:
        """Recorded slices of a group over the last `since_s` seconds (one row per slice)."""
        return self.orchestrator.timeline(group, since=time.time() - since_s, limit=100_000).to_dataframe()

    def close(self) -> None:
        for lease in list(self._leases.values()):
            lease.close()
        self._leases.clear()
        if self._orchestrator is not None:
            self._orchestrator.close()
        if self._sandbox is not None:
            self._sandbox.close()
        self.http.close()

    def __repr__(self) -> str:
        where = " (embedded)" if self.server else ""
        return f"Lab at {self.base_url}{where}"


class LabLease:
    """One named run: its tinker TrainingClient, a sampling helper, and its metric log."""

    def __init__(self, lab: Lab, record: dict, training, restored_from: str | None = None):
        self.lab = lab
        self.name: str = record["name"]
        self.group: str = record["group"]
        self.base_model: str = record["base_model"]
        self.rank: int | None = record.get("rank")  # None: full fine-tuning
        self.state_bytes: int | None = record.get("state_bytes")  # its device memory, as its kernel said
        self.devices: int = _devices(record)  # how many devices the run is sharded over (1: not a gang)
        self.training = training
        self.restored_from = restored_from
        self._pending: list[dict] = []
        self._sending: list[dict] = []  # taken from _pending by a flush whose POST has not been answered yet
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()  # one flush at a time: rows reach the control plane in log order
        self._plots: list[LivePlot] = []
        self._watch = CollapseWatch()  # flags a collapse in logged rows that carry reward and entropy
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        self.checkpoint: str | None = record.get("checkpoint")
        # a fork's origin and settings: {"forked_from": NAME, "step": N, "settings": {...}}; None otherwise
        self.variant: dict | None = record.get("variant")
        self._tokenizer = None

    @property
    def model_id(self) -> str:
        return self.training.model_id

    # --- sampling ---------------------------------------------------------------------------------
    def sampling_client(self) -> tinker.SamplingClient:
        """A sampler on the weights as they are now (later training does not change it)."""
        return self.training.save_weights_and_get_sampling_client().result()

    def tokenizer(self):
        """The base model's tokenizer: from the model's directory on the server's machine, else from the lab's
        Hugging Face mirror (`Lab.load_tokenizer`); never from a model hub."""
        if self._tokenizer is None:
            self._tokenizer = self.lab.load_tokenizer(
                self.training.get_info().model_data.tokenizer_id or self.base_model
            )
        return self._tokenizer

    def sample(
        self,
        prompt: str | Sequence[int],
        num_samples: int = 1,
        *,
        max_tokens: int = 32,
        temperature: float = 1.0,
        **params: Any,
    ) -> list[str]:
        """Completions of `prompt` (text or token ids) from the current weights, as text."""
        import tinker

        sampler = self.sampling_client()
        tok = self.tokenizer()
        ids = tok.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        out = sampler.sample(
            tinker.ModelInput.from_ints(ids),
            num_samples,
            tinker.SamplingParams(max_tokens=max_tokens, temperature=temperature, **params),
        ).result()
        return [tok.decode(s.tokens, skip_special_tokens=True) for s in out.sequences]

    # --- checkpoints ------------------------------------------------------------------------------
    def save(self, name: str | None = None) -> str:
        """save_state, recorded as the run's last checkpoint (what `attach` restores after a kernel restart)."""
        path = self.training.save_state(name or f"step-{int(time.time())}").result().path
        self.lab._request("PATCH", f"/api/v1/lab/leases/{self.name}", json={"checkpoint": path})
        self.checkpoint = path
        return path

    # --- metrics ----------------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float] | None = None, /, **values: float) -> None:
        """Records one step's metrics (a dict such as a recipe's metrics row, and/or keywords): drawn at once by
        this process's plots, sent to the control plane within a second (batched, from a background thread:
        the loop never waits for the network)."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        clean = {}
        for k, v in {**(metrics or {}), **values}.items():
            if k == "step":
                continue
            try:
                clean[k] = float(v)
            except (TypeError, ValueError):
                raise TypeError(f"metric {k!r} must be a number, got {type(v).__name__}") from None
        if COLLAPSE_METRIC not in clean and "reward" in clean and "entropy" in clean:
            was = self._watch.collapsed
            clean[COLLAPSE_METRIC] = float(self._watch.update(clean["reward"], clean["entropy"]))
            if clean[COLLAPSE_METRIC] and not was:
                warnings.warn(
                    CollapseWarning(f"{self.name}: step {step}: the policy is collapsing: {self._watch.reason}"),
                    stacklevel=2,
                )
        with self._lock:
            # NaN/inf are not JSON: stored as missing values
            self._pending.append(
                {
                    "step": step,
                    "time": time.time(),
                    "metrics": {k: (v if math.isfinite(v) else None) for k, v in clean.items()},
                }
            )
            plots = list(self._plots)
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name=f"openrl-log-{self.name}", daemon=True)
                self._flusher.start()
                atexit.register(self.flush)
        for plot in plots:
            plot.append(step, **clean)

    def _flush_loop(self) -> None:
        while not self._closed.wait(LOG_FLUSH_S):
            with contextlib.suppress(LabError):  # the control plane is away: the rows stay pending for the next flush
                self.flush()

    def flush(self) -> int:
        """Sends the pending rows now; how many were sent."""
        with self._send_lock:
            with self._lock:
                rows, self._pending = self._pending, []
                self._sending = rows
            if not rows:
                return 0
            try:
                for i in range(0, len(rows), 10_000):
                    self.lab._request(
                        "POST", f"/api/v1/lab/leases/{self.name}/metrics", json={"rows": rows[i : i + 10_000]}
                    )
            except LabError:
                with self._lock:
                    self._pending = rows + self._pending
                raise
            finally:
                with self._lock:
                    self._sending = []
            return len(rows)

    def history(self) -> pd.DataFrame:
        """Every logged step (from the control plane, plus rows not sent yet): step, time, one column per metric."""
        # The rows not yet on the control plane are read *before* asking it: a flush in flight then counts
        # once or twice (the same step, kept once), never zero times.
        with self._lock:
            local = self._sending + self._pending
        rows = self.lab._get(f"/api/v1/lab/leases/{self.name}/metrics")["rows"] + local
        by_step = {r["step"]: {"step": r["step"], "time": r["time"], **r["metrics"]} for r in rows}
        df = pd.DataFrame([by_step[s] for s in sorted(by_step)])
        if not len(df):
            return pd.DataFrame({"step": pd.Series(dtype="int64"), "time": pd.Series(dtype="datetime64[ns, UTC]")})
        # epoch seconds as datetimes (UTC), not floats a DataFrame shows as 1.796e+09
        df["time"] = pd.to_datetime(df["time"], unit="s", utc=True)
        return df

    def plot(self, metrics: Sequence[str] | None = None, *, follow: bool = False, **kw) -> LivePlot:
        """A live plot of this run: the history so far, then every `log` of this process. `follow=True` also
        polls the control plane (a run driven from another notebook)."""
        from openrl_lab.lab.widgets import LivePlot

        history = self.history()
        if metrics is None:
            metrics = [c for c in history.columns if c not in ("step", "time")] or None
        plot = LivePlot(metrics, title=kw.pop("title", self.name), **kw)
        if len(history):
            plot.extend(history.drop(columns=["time"]))
        with self._lock:
            self._plots.append(plot)
        if follow:
            threading.Thread(
                target=self._follow,
                args=(plot, int(history["step"].max()) if len(history) else -1, _output_parent()),
                name=f"openrl-follow-{self.name}",
                daemon=True,
            ).start()
        return plot

    def _follow(self, plot: LivePlot, last: int, parent: dict | None = None, every_s: float = FOLLOW_POLL_S) -> None:
        """Polls the control plane for steps after `last` into `plot` until the plot is closed, this handle is
        closed (one last fetch first, so the steps logged since the previous poll are not lost) or the lease
        is gone (404: released; a one-line note in the plot's cell, and no more polling)."""

        def fetch() -> bool:
            nonlocal last
            try:
                r = self.lab._request(
                    "GET", f"/api/v1/lab/leases/{self.name}/metrics", missing_ok=True, params={"after_step": last}
                )
            except LabError:
                return True  # the control plane is away for now: try again at the next poll
            if r is None:
                _note(
                    parent,
                    f"{self.name}: the lease was released; the plot stops at "
                    + (f"step {last}" if last >= 0 else "no steps")
                    + ".",
                )
                return False
            for row in r.json()["rows"]:
                plot.append(row["step"], **{k: v for k, v in row["metrics"].items() if v is not None})
                last = row["step"]
            return True

        while not plot.closed:
            if self._closed.wait(every_s):
                if not plot.closed:
                    fetch()  # final fetch
                return
            if plot.closed or not fetch():
                return

    def info(self):
        """The orchestrator's view of this run's lease: state, resident, queue position, use."""
        for o in self.lab.orchestrator.leases():
            if o.name == self.name:
                return o
        return None

    def close(self) -> int:
        """Stops this handle's background work (the run itself lives on in its kernel; see Lab.release).
        Returns how many pending rows the last flush sent."""
        try:
            sent = self.flush()
        except LabError:
            sent = 0
        self._closed.set()
        return sent

    def __repr__(self) -> str:
        extra = f", restored from {self.restored_from}" if self.restored_from else ""
        kind = "full fine-tuning" if self.rank is None else f"rank {self.rank}"
        held = (
            ""
            if self.state_bytes is None
            else (f", {fmt_bytes(self.state_bytes)} of device memory (weights, gradients, AdamW moments)")
        )
        where = f"{self.group}, {self.devices} devices" if self.devices > 1 else self.group
        return f"LabLease {self.name!r}: {self.base_model} {kind} on {where}, model {self.model_id}{held}{extra}"


def _output_parent() -> dict | None:
    """The running cell's message header in an IPython kernel (None elsewhere): a background thread's notes are
    pinned to it rather than landing in whichever cell runs when they are printed."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "parent_header", None) if shell is not None else None


def _note(parent: dict | None, text: str) -> None:
    """One line from a background thread, in the cell of `parent` when in a kernel."""
    tokens = None
    if parent:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None and hasattr(shell, "set_thread_parent"):
            tokens = shell.set_thread_parent(parent)
    try:
        print(text, flush=True)
    finally:
        if tokens is not None:
            get_ipython().reset_thread_parent(tokens)


def tokenizer_cache(base_url: str) -> Path:
    """Where a lab's tokenizers are kept on this machine: one Hugging Face cache per lab (two labs may serve
    different models under one name), under $XDG_CACHE_HOME or ~/.cache."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return root / "openrl-lab" / "tokenizers" / re.sub(r"[^A-Za-z0-9_.-]+", "_", urlsplit(base_url).netloc or base_url)


class _RunSeries:
    """A run's logged steps, renamed to `metric run` series, into a shared plot (what `Comparison` overlays).
    A step comes once: one logged in this process also comes back from the control plane when followed."""

    def __init__(self, plot: LivePlot, run: str, metrics: Sequence[str]):
        self.plot, self.run, self.metrics = plot, run, metrics
        self._seen: set[int] = set()
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self.plot.closed

    def append(self, step: int, /, **values: float) -> None:
        with self._lock:
            if step in self._seen:
                return
            self._seen.add(step)
        self.plot.append(step, **{f"{m} {self.run}": values[m] for m in self.metrics if m in values})


class Comparison:
    """Runs side by side: `plot` (a LivePlot: one series per metric and run, live as they log) and
    `summary()` (a DataFrame: one row per run, its variant settings and each metric's last and best)."""

    def __init__(self, runs: Sequence[LabLease], metrics: Sequence[str], follow: bool = True):
        from openrl_lab.lab.widgets import LivePlot

        self.runs, self.metrics = list(runs), list(metrics)
        self.plot = LivePlot([f"{m} {r.name}" for m in self.metrics for r in self.runs], title="compare")
        parent = _output_parent()
        for r in self.runs:
            history = r.history()
            series = _RunSeries(self.plot, r.name, self.metrics)
            for row in history.to_dict("records"):
                series.append(int(row["step"]), **{m: row[m] for m in self.metrics if m in row and row[m] == row[m]})
            with r._lock:
                r._plots.append(series)  # type: ignore[arg-type] - it has what a run's log calls: append, closed
            if follow:  # steps logged elsewhere (another notebook drives this run), polled from the control plane
                last = int(history["step"].max()) if len(history) else -1
                threading.Thread(
                    target=r._follow, args=(series, last, parent), name=f"openrl-compare-{r.name}", daemon=True
                ).start()

    def summary(self) -> pd.DataFrame:
        rows = []
        for r in self.runs:
            h = r.history()
            row: dict[str, Any] = {"run": r.name, "forked_from": (r.variant or {}).get("forked_from")}
            row |= (r.variant or {}).get("settings", {})
            row["steps"] = int(h["step"].max()) if len(h) else 0
            for m in self.metrics:
                col = h[m].dropna() if m in h.columns else pd.Series(dtype=float)
                row[f"{m} last"] = float(col.iloc[-1]) if len(col) else float("nan")
                row[f"{m} best"] = float(col.min() if m == "loss" else col.max()) if len(col) else float("nan")
            rows.append(row)
        return pd.DataFrame(rows).set_index("run")

    def close(self) -> None:
        """Stops the plot (and the polling of followed runs)."""
        self.plot.close()

    def _repr_mimebundle_(self, **kw):
        return self.plot._repr_mimebundle_(**kw)

    def __repr__(self) -> str:
        return f"Comparison of {', '.join(r.name for r in self.runs)}\n{self.summary().to_string()}"


def _devices(record: dict) -> int:
    """How many devices a lease row says its run has: 1 when it says nothing (a server that predates gangs)."""
    return int(record.get("devices") or 1)


def _training_client(holder, model_seq_id: int, model_id: str):
    """A tinker TrainingClient for an existing model id (what the SDK builds after create_model)."""
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    info = holder.run_coroutine_threadsafe(fetch_training_info(holder, model_id)).result()
    return TrainingClient(holder, model_seq_id=model_seq_id, model_id=model_id, info=info)


def _hub_message(e: BaseException) -> str:
    """What the lab's mirror said (X-Error-Message), else the error's first line."""
    response = getattr(e, "response", None)
    said = getattr(e, "server_message", None) or (
        response.headers.get("X-Error-Message") if response is not None else None
    )
    return said or _message(e)


def _message(e: Exception) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict) and body.get("error"):
        return str(body["error"])
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
