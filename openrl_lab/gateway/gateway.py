"""The state the routes share: the store, the kernels, the per-model sequencers and the in-flight futures,
with the steps every route takes (ownership lookups, refusing a seq_id, submitting work, starting a job)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from huggingface_hub.utils import HFValidationError, validate_repo_id

from openrl_lab.cluster.fleet import Fleet, KernelRecord
from openrl_lab.gateway import wire
from openrl_lab.gateway.downloads import Signer
from openrl_lab.gateway.errors import ApiError, not_found, redact
from openrl_lab.gateway.gang import GangApi, devices_of, is_gang, phase_key, ranks_of
from openrl_lab.gateway.leases import lease_options
from openrl_lab.gateway.liveness import Liveness
from openrl_lab.gateway.sequencer import Sequencer
from openrl_lab.gateway.store import Store
from openrl_lab.home import served_models, served_names
from openrl_lab.kernel.api import KernelApi, ModelCard
from openrl_lab.kernel.client import KernelError, KernelLost, KernelNotFound, KernelTimeout, KernelUserError, NoKernel
from openrl_lab.memory import fmt_bytes, no_room
from openrl_lab.settings import settings
from openrl_lab.train.loss_spec import DataError, LossInputError

log = logging.getLogger("openrl_lab.gateway")
T = TypeVar("T")
Encode = Callable[[Any], tuple[str, bytes]]
# A checkpoint name is a directory name; the atomic write adds up to ~35 bytes for its temp siblings
# (train/checkpoint.py), and a name must stay under the filesystem's 255 with them.
MAX_CHECKPOINT_NAME_BYTES = 200
MAX_TTL_S = 100 * 365 * 24 * 3600  # an expiry time past this is not representable everywhere
# The /hf mirror's repository for a model whose name is not a Hugging Face repo id (a directory on the server).
LOCAL_REPO_NAMESPACE = "openrl-lab-local"


def tokenizer_paths() -> bool:
    """Whether get_info may give a client on this machine a model's directory as tokenizer_id.
    OPENRL_LAB_TOKENIZER_PATHS=0 gives every client the name (served by the /hf mirror): what a client on
    another host gets, testable from this one."""
    return settings().lab_tokenizer_paths


@dataclass(frozen=True)
class TokenizerRepo:
    """A served model's tokenizer files, as the /hf mirror serves them."""

    model: str  # the model's name (base_model)
    files: dict[str, bytes]
    oids: dict[str, str]  # each file's git blob id: what the hub gives as its ETag and tree oid
    commit: str  # sha1 over the files: stable while they do not change

    @classmethod
    def of(cls, model: str, files: dict[str, bytes]) -> TokenizerRepo:
        oids = {name: hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() for name, data in files.items()}
        commit = hashlib.sha1("".join(f"{name}\0{oids[name]}\n" for name in sorted(files)).encode()).hexdigest()
        return cls(model, files, oids, commit)


def encode_json(result: Any) -> tuple[str, bytes]:
    return "application/json", json.dumps(result).encode()


def ttl_problem(ttl: int | None) -> str | None:
    if ttl is None or 0 < ttl <= MAX_TTL_S:
        return None
    return f"ttl_seconds {ttl} must be a positive number of seconds up to {MAX_TTL_S} (100 years), or null"


def check_metadata(user_metadata: dict | None) -> None:
    """The SDK reads user_metadata back as strings (runs, checkpoints, sessions): another value, once stored,
    would break every later listing of the owner's runs."""
    bad = [key for key, value in (user_metadata or {}).items() if not isinstance(value, str)]
    if bad:
        raise ApiError(
            400,
            f"user_metadata {', '.join(map(repr, bad[:5]))}: values must be strings (the SDK reads "
            "them back as strings)",
        )


class Gateway:
    def __init__(self, home: Path, store: Store, kernels: Fleet, checkpoint_root: Path | None = None):
        self.home = home
        self.store = store
        self.kernels = kernels
        # The checkpoint store: a directory every kernel sees at the same path (a mounted volume on other hosts).
        self.checkpoint_root = checkpoint_root or home / "checkpoints"
        self.sequencers: dict[str, Sequencer] = {}
        self.done_events: dict[str, asyncio.Event] = {}
        self.cards: dict[str, ModelCard] = {}
        self.tokenizers: dict[str, TokenizerRepo] = {}  # by model name
        self._tokenizer_loads: dict[str, asyncio.Future] = {}
        # /hf repo id -> model name: the operator's (serve --tokenizer-alias), and one for each name that is no
        # repo id (a directory on the server), made by tokenizer_id
        self.tokenizer_aliases: dict[str, str] = dict(settings().lab_tokenizer_aliases)
        self.sample_slots = asyncio.Semaphore(64)
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self.liveness = Liveness(self)

    # --- futures ----------------------------------------------------------------------------------
    def new_future(
        self, owner: str, kind: str, target: str | None = None, seq_id: int | None = None
    ) -> tuple[str, bool]:
        """(request_id, is_new); a repeated (target, seq_id) gets the first request's id back."""
        rid = uuid.uuid4().hex
        got = self.store.add_future(rid, owner, kind, target, seq_id)
        if got == rid:
            self.done_events[rid] = asyncio.Event()
        return got, got == rid

    def finish(self, rid: str, content_type: str, body: bytes, ok: bool = True) -> None:
        self.store.finish_future(rid, "done" if ok else "error", content_type, body)
        event = self.done_events.pop(rid, None)
        if event:
            event.set()

    def fail(self, rid: str, message: str, category: str) -> None:
        body = {"error": redact(message, self.home), "category": category}
        self.finish(rid, "application/json", json.dumps(body).encode(), ok=False)

    async def run(self, rid: str, kernel_call: Callable[[], Awaitable[Any]], encode: Encode, model: Any = None) -> None:
        """Runs one kernel call and settles the future with its result or a named error (for a `model`'s call
        whose kernel was lost, one that names the run's last checkpoint)."""
        try:
            result = await kernel_call()
            content_type, body = encode(result)
            self.finish(rid, content_type, body)
        except (KernelUserError, KernelNotFound, LossInputError, DataError, wire.WireError, ApiError) as e:
            self.fail(rid, str(e), "user")
        except KernelLost as e:
            self.fail(
                rid,
                f"model {model['model_id']}: {e}. {self._last_checkpoint(model)}" if model is not None else str(e),
                "server",
            )
        except KernelError as e:
            self.fail(rid, str(e), "server")
        except Exception as e:  # never leave a future pending forever
            log.exception("request %s failed", rid)
            self.fail(rid, f"{type(e).__name__}: {e}", "server")

    def spawn(self, rid: str, call: Callable[[], Awaitable[Any]], encode: Encode) -> None:
        self.background(self.run(rid, call, encode))

    def background(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def sequencer(self, model_id: str) -> Sequencer:
        if model_id not in self.sequencers:
            self.sequencers[model_id] = Sequencer(depth=settings().lab_pipeline_depth)
        return self.sequencers[model_id]

    def refuse(self, model_id: str, seq_id: int | None, status: int, message: str) -> ApiError:
        """The error for a refused request of a model's sequencer; the requests after its seq_id need not wait."""
        self.sequencer(model_id).skip(seq_id or 0)
        return ApiError(status, message)

    def submit(
        self,
        model_id: str,
        seq_id: int | None,
        owner: str,
        kind: str,
        call: Callable[[], Awaitable[Any]],
        encode: Encode,
        model: Any = None,
    ) -> dict:
        """Queues `call` in the model's sequencer (seq_id order); answers the future's id at once. `model`: its row."""
        rid, new = self.new_future(owner, kind, model_id, seq_id)
        if new:

            async def work():
                await self.run(rid, call, encode, model)

            self.sequencer(model_id).submit(seq_id, work)
        return {"request_id": rid, "model_id": model_id}

    def submit_op(
        self,
        model: Any,
        seq_id: int | None,
        owner: str,
        kind: str,
        op: Callable[[KernelApi], Any],
        encode: Encode,
    ) -> dict:
        """`submit` for a request that is one operation on the model's kernel (forward_backward, forward,
        optim_step): pipelined, so it is sent while the model's previous call still runs (sequencer.py)."""
        model_id = model["model_id"]
        if is_gang(model):  # every rank answers before the next call goes out (gateway/gang.py)
            return self.submit(model_id, seq_id, owner, kind, lambda: self.model_call(model, op), encode, model)
        rid, new = self.new_future(owner, kind, model_id, seq_id)
        if new:
            sequencer = self.sequencer(model_id)

            async def work(sent: Callable[[], None]):
                async def call():
                    return await self.kernel_call(model["epoch"], op, order=(sequencer, sent))

                await self.run(rid, call, encode, model)

            sequencer.submit(seq_id, work, pipelined=True)
        return {"request_id": rid, "model_id": model_id}

    async def start_job(
        self,
        owner: str,
        session_id: str,
        model_seq_id: int,
        kind: str,
        user_metadata: dict | None,
        create: Callable[[str, dict, KernelRecord], Awaitable[tuple[str, dict | None]]],
        answer: dict,
        base_model: str | None = None,
        needs_bytes: int | None = None,
        create_gang: Callable[[str, dict, list[KernelRecord]], Awaitable[tuple[str, dict | None]]] | None = None,
    ) -> dict:
        """A new model handle (create_model, load_weights): the job is placed on a kernel of its lease's group;
        `create(model_id, slicing, kernel)` makes its job there and returns (base_model, lora); the handle is
        recorded, with the kernel's epoch, once the job exists. `needs_bytes`: the device memory of a full
        fine-tuning job, refused now (a 400) when no kernel of its group has that much available. A run on
        several devices (`openrl_devices`, gateway/gang.py) is placed on that many kernels and made there by
        `create_gang(model_id, slicing, kernels)` (a 400 where the request cannot make one)."""
        check_metadata(user_metadata)
        slicing = await self.lease_options(user_metadata)  # bad openrl_* metadata is a 400 now
        try:
            devices = devices_of(user_metadata)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        if devices > 1 and create_gang is None:
            raise ApiError(400, f"{kind} cannot make a run on {devices} devices (openrl_devices): leave it out")
        if needs_bytes is not None:
            self.check_room(slicing.get("group"), needs_bytes, f"a full fine-tuning job on {base_model}")
        model_id = f"{session_id}:train:{model_seq_id}"
        rid, new = self.new_future(owner, kind, model_id, 0)
        if new:

            async def work():
                if devices > 1:
                    assert create_gang is not None  # refused above
                    kernels = await self.place_gang(devices, slicing.get("group"), base_model, model_id, needs_bytes)
                else:
                    kernels = [
                        await self.place(slicing.get("group"), base_model, job_id=model_id, needs_bytes=needs_bytes)
                    ]
                try:
                    if devices > 1:
                        assert create_gang is not None
                        base, lora = await create_gang(model_id, slicing, kernels)
                    else:
                        base, lora = await create(model_id, slicing, kernels[0])
                except BaseException:
                    for kernel in kernels:
                        kernel.pending.pop(model_id, None)  # it never became a job there
                    raise
                self.store.add_model(
                    model_id,
                    owner,
                    session_id,
                    base,
                    lora,
                    user_metadata,
                    kernels[0].epoch,
                    ranks=[k.epoch for k in kernels],
                )
                self.sequencers.pop(model_id, None)
                session = self.store.session(session_id, owner)
                if session is not None and session["finished"]:
                    # The session ended while its job was being made (silent for longer than the job took to
                    # place and load): the sweep found nothing to free then, and would never look again.
                    why = f"session {session_id} {session['finished']}"
                    await self.liveness.free(session_id, why)
                    raise ApiError(404, f"model {model_id} was freed ({why} while it was being created)")
                return {"model_id": model_id, "type": kind, **answer}

            self.spawn(rid, work, encode_json)
        return {"request_id": rid, "model_id": model_id}

    # --- kernels ----------------------------------------------------------------------------------
    def check_room(self, group: str | None, needed: int, what: str) -> None:
        """A 400 naming the sizes when no kernel a job of `group` may go to reported `needed` bytes of device
        memory available (reported each second; the kernel checks again when it makes the job)."""
        room = self.kernels.room(group)
        if not room or any(available is None or available >= needed for _, available in room):
            return
        kernel, available = max(room, key=lambda r: r[1] or 0)  # none is None here (returned above)
        budget = kernel.metrics.device_budget_bytes if kernel.metrics else None
        where = f"kernel {kernel.name!r} ({kernel.device}" + (f", budget {fmt_bytes(budget)})" if budget else ")")
        if len(room) > 1:
            where = f"the roomiest kernel of group {kernel.group!r}, {where},"
        raise ApiError(400, no_room(what, needed, available, where))

    async def place(
        self,
        group: str | None = None,
        base_model: str | None = None,
        purpose: str = "train",
        job_id: str | None = None,
        needs_bytes: int | None = None,
    ) -> KernelRecord:
        """The kernel a new job or sampler goes to (`Fleet.place`); a 503 naming the group when none serves it.
        It may wait for a kernel that is (re)starting: off the event loop."""
        try:
            return await asyncio.to_thread(
                self.kernels.place, group, base_model, purpose, job_id, needs_bytes=needs_bytes
            )
        except NoKernel as e:
            raise ApiError(503, str(e)) from None

    async def place_gang(
        self, devices: int, group: str | None, base_model: str | None, job_id: str, needs_bytes: int | None
    ) -> list[KernelRecord]:
        """The kernels of a run on `devices` devices, rank 0 first (`Fleet.place_gang`); a 503 naming what is up
        when there are not that many."""
        try:
            return await asyncio.to_thread(
                self.kernels.place_gang, devices, group, base_model, job_id, needs_bytes=needs_bytes
            )
        except NoKernel as e:
            raise ApiError(503, str(e)) from None

    async def make_gang(
        self,
        model_id: str,
        kernels: list[KernelRecord],
        make: Callable[[KernelApi, int, str, str], Any],
    ) -> None:
        """A gang job's ranks: rank 0's kernel opens the gang (its worker's rendezvous address), then every
        kernel makes its rank at once (`make(api, rank, master, gang_phase)`, in one gang phase), since each waits
        for the others to join its process group. If one rank fails, the others are dropped again."""
        world = len(kernels)
        address = await self.kernel_call(kernels[0], lambda k: k.open_gang(job_id=model_id, world_size=world))
        master = f"{address.host}:{address.port}"
        key = phase_key(model_id)
        try:
            await _all_ranks(
                self.kernel_call(kernel, functools.partial(_call_rank, make, rank, master, key))
                for rank, kernel in enumerate(kernels)
            )
        except BaseException:
            for kernel in kernels:
                with contextlib.suppress(Exception):
                    await self.kernel_call(kernel, lambda k: k.drop_job(job_id=model_id))
            raise

    async def model_call(self, row: Any, call: Callable[[KernelApi], T]) -> T:
        """`call` on the run's kernel; for a run on several devices, on every rank's kernel at once in one gang
        phase (gateway/gang.py), answering rank 0's result, or the failure that explains the others (a lost
        kernel first)."""
        ranks = ranks_of(row)
        if len(ranks) == 1:
            return await self.kernel_call(ranks[0], call)
        key = phase_key(row["model_id"])
        results = await _all_ranks(
            self.kernel_call(epoch, lambda k: call(cast(KernelApi, GangApi(k, key)))) for epoch in ranks
        )
        return cast(T, results[0])

    def live(self, row: Any) -> bool:
        """Whether every kernel of the run (every rank's, for a run on several devices) is still the one it ran on."""
        return all(self.kernels.is_live(epoch) for epoch in ranks_of(row))

    def placement(self, row: Any) -> dict[str, Any] | None:
        """Where the run lives (`Fleet.where` of its kernel; None once gone); a run on several devices adds
        `ranks`, each rank's, rank 0 first (the top-level fields are rank 0's)."""
        ranks = ranks_of(row)
        where = self.kernels.where(ranks[0])
        if where is not None and len(ranks) > 1:
            where = where | {"ranks": [self.kernels.where(epoch) for epoch in ranks]}
        return where

    def why_gone(self, row: Any) -> str:
        lost = [epoch for epoch in ranks_of(row) if not self.kernels.is_live(epoch)]
        return "; ".join(self.kernels.why_gone(epoch) for epoch in lost) or "it is gone"

    async def kernel_call(
        self,
        on: str | KernelRecord | None,
        call: Callable[[KernelApi], T],
        order: tuple[Sequencer, Callable[[], None]] | None = None,
    ) -> T:
        """`call` on the kernel `on` (an epoch a run or sampler recorded, or a placed kernel; None: any kernel),
        off the event loop: `await gw.kernel_call(epoch, lambda k: k.drop_job(job_id=...))`. A call that fails
        because its kernel went away raises KernelLost saying why. `order`: (the model's sequencer, `sent`) for
        a pipelined call: it takes the sequencer's next ticket and calls `sent` once it is on its way."""
        kernel = on if isinstance(on, KernelRecord) else self.kernels.get(on) if on else await self.place(purpose="any")
        try:
            if order is None:
                return await asyncio.to_thread(call, kernel.client.api())
            sequencer, sent = order
            # Handed to the thread pool (first in, first out) before the next call is: the kernel then never
            # waits for a predecessor that has no thread yet.
            running = asyncio.get_running_loop().run_in_executor(
                None, call, kernel.client.api(order=sequencer.ticket())
            )
            sent()
            return await running
        except KernelLost:
            raise
        except KernelError as e:
            if await asyncio.to_thread(self.kernels.settle, kernel.epoch):
                raise  # the kernel is there: the call itself failed
            raise KernelLost(
                f"its kernel {kernel.name!r} was lost while running {e.op}: {self.kernels.why_gone(kernel.epoch)}"
            ) from None

    async def lease_options(self, user_metadata: dict | None) -> dict:
        """How a new run's phases are time-sliced (its `openrl_*` user_metadata); a 400 for bad values."""
        names = None
        if self.kernels.orchestrator is not None and any(k.startswith("openrl_") for k in (user_metadata or {})):
            names = await asyncio.to_thread(self.kernels.group_names)
        try:
            return lease_options(user_metadata, names, self.kernels.groups())
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def card(self, base_model: str) -> ModelCard:
        """The model's card; one 400 for every base_model the kernel cannot load, so that the answer does not
        tell which directories exist on the server."""
        if base_model not in self.cards:
            try:
                self.cards[base_model] = await self.kernel_call(None, lambda k: k.model_info(base_model=base_model))
            except (KernelUserError, KernelError) as e:
                if isinstance(e, (KernelTimeout, KernelLost)):
                    raise  # the kernel is slow or died: not the model's fault
                log.info("base_model %r refused: %s", base_model, e)
                names = ", ".join(served_names())
                if served_models():  # the operator's catalog: only what it names
                    raise ApiError(400, f"base_model {base_model!r} is not served here; served: {names}") from None
                raise ApiError(
                    400,
                    f"base_model {base_model!r} is not a model this server can load: use one it serves ({names}), "
                    "a model directory on the server or a model in its Hugging Face cache",
                ) from None
        return self.cards[base_model]

    def tokenizer_id(self, base_model: str) -> str:
        """The repo id under which the /hf mirror serves the model's tokenizer: its name, or for a name that
        is no Hugging Face repo id (a directory on the server) a stable alias, remembered here."""
        try:
            validate_repo_id(base_model)
            return base_model
        except HFValidationError:
            pass
        slug = re.sub(r"[^A-Za-z0-9_]+", "-", Path(base_model).name).strip("-")[:40].strip("-") or "model"
        alias = f"{LOCAL_REPO_NAMESPACE}/{slug}-{hashlib.sha256(base_model.encode()).hexdigest()[:12]}"
        self.tokenizer_aliases[alias] = base_model
        return alias

    async def tokenizer(self, repo_id: str) -> TokenizerRepo:
        """The tokenizer files of the model served as `repo_id`, fetched from the kernel once and kept. A 404
        with card's message for every name the kernel cannot load (no directory-existence oracle)."""
        model = self.tokenizer_aliases.get(repo_id, repo_id)
        if model in self.tokenizers:
            return self.tokenizers[model]
        load = self._tokenizer_loads.get(model)
        if load is None:
            load = self._tokenizer_loads[model] = asyncio.ensure_future(self._load_tokenizer(model))
            load.add_done_callback(self._tokenizer_loaded)
        return await asyncio.shield(load)  # a client that hangs up does not cancel the others' load

    def _tokenizer_loaded(self, load: asyncio.Future) -> None:
        self._tokenizer_loads = {m: f for m, f in self._tokenizer_loads.items() if f is not load}
        if not load.cancelled():
            load.exception()  # retrieved: when every client hung up, nobody else reads a refusal

    async def _load_tokenizer(self, model: str) -> TokenizerRepo:
        try:
            await self.card(model)  # only models the server can load
        except ApiError as e:
            raise ApiError(404, e.message) from None
        try:
            files = await self.kernel_call(None, lambda k: k.tokenizer_files(base_model=model))  # the only call
        except KernelUserError as e:  # a model it loads but whose tokenizer it does not serve (over the size cap)
            raise ApiError(422, str(e)) from None
        # hashing up to 64 MiB: off the event loop
        repo = await asyncio.to_thread(TokenizerRepo.of, model, {name: data.tobytes() for name, data in files.items()})
        self.tokenizers[model] = repo
        return repo

    @functools.cached_property
    def downloads(self) -> Signer:
        """Signs the download URLs of exported weights (made at the first export: it may write its secret)."""
        return Signer(self.home)

    # --- ownership --------------------------------------------------------------------------------
    def session(self, session_id: str, owner: str):
        row = self.store.session(session_id, owner)
        if row is None:
            raise not_found(f"session {session_id}")
        return row

    def model(self, model_id: str, owner: str):
        row = self.store.model(model_id, owner)
        if row is None:
            raise not_found(f"model {model_id}")
        if row["freed"]:
            raise ApiError(404, f"model {model_id} was freed ({row['freed']}). {self._last_checkpoint(row)}")
        if not self.live(row):
            if is_gang(row):  # the other ranks cannot go on without it: their workers go too
                self.background(self.drop_ranks(row))
            raise ApiError(
                404,
                f"model {model_id} is no longer resident: its kernel was lost "
                f"({self.why_gone(row)}). {self._last_checkpoint(row)}",
            )
        self.store.touch_model(model_id)
        self.liveness.touch(row["session_id"])
        return row

    async def drop_ranks(self, row: Any, job_id: str | None = None) -> None:
        """Drops the run's job on each of its kernels that is still up (a failure is logged: what a dead kernel
        held is gone with it)."""
        job_id = job_id or row["job_id"] or row["model_id"]
        for epoch in ranks_of(row):
            if self.kernels.is_live(epoch):
                try:
                    await self.kernel_call(epoch, lambda k: k.drop_job(job_id=job_id))
                    await asyncio.to_thread(self.kernels.dropped, epoch, job_id)
                except Exception as e:  # noqa: BLE001
                    log.warning("drop_job %s on %s: %s", job_id, epoch, e)

    async def kernel_lost(self, epoch: str) -> None:
        """A kernel was lost: every run on several devices with a rank there cannot go on, so its other ranks'
        workers are dropped now (their memory is freed; the run answers with its last checkpoint)."""
        for row in self.store.live_gangs_on(epoch):
            await self.drop_ranks(row)

    def sampler(self, sampler_id: str, owner: str):
        row = self.store.sampler(sampler_id, owner)
        if row is None:
            raise not_found(f"sampler {sampler_id}")
        if row["freed"]:
            raise ApiError(404, f"sampler {sampler_id} was freed ({row['freed']}); make a new one")
        self.liveness.touch(row["session_id"])
        return row

    def _last_checkpoint(self, row) -> str:
        last = self.store.last_checkpoint(row["owner"], row["model_id"], "training")
        if last is None:
            return "It saved no checkpoint to train from; start a new run."
        return f"Load its last checkpoint, {last['tinker_path']}, with create_training_client_from_state."

    def checkpoint(self, tinker_path: str, owner: str, readable: bool = False):
        row = self.store.checkpoint(tinker_path, owner)
        if row is None and readable:
            row = self.store.public_checkpoint(tinker_path)
        if row is None:
            raise not_found(f"checkpoint {tinker_path}")
        return row

    def checkpoint_dir(self, owner: str, run_id: str, kind: str, name: str) -> Path:
        """Where checkpoint `name` goes; a ValueError naming the problem if it cannot be a directory name."""
        if not name or "/" in name or "\0" in name or name in (".", ".."):
            raise ValueError(f"checkpoint name {name!r} is not allowed: use a non-empty name without '/'")
        if len(name.encode()) > MAX_CHECKPOINT_NAME_BYTES:
            raise ValueError(
                f"checkpoint name of {len(name.encode())} bytes is too long: at most "
                f"{MAX_CHECKPOINT_NAME_BYTES} bytes (UTF-8)"
            )
        return self.checkpoint_root / owner / run_id / kind / name


def _call_rank(
    make: Callable[[KernelApi, int, str, str], Any], rank: int, master: str, key: str, api: KernelApi
) -> Any:
    return make(api, rank, master, key)


async def _all_ranks(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Every rank's answer, in rank order. The first failure is raised as soon as it comes (a lost kernel's first,
    among those in by then): the other ranks would only fail later, waiting for their lost peer; their calls end
    on their own."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        failures = [e for t in done if not t.cancelled() and (e := t.exception()) is not None]
        if failures:
            for t in pending:  # their outcome is read, so that it is not reported as never retrieved
                t.add_done_callback(lambda t: t.cancelled() or t.exception())
            raise next((f for f in failures if isinstance(f, KernelLost)), failures[0])
    return [t.result() for t in tasks]
