"""The gateway: the Tinker HTTP API (see docs/architecture.md) in front of the kernels.

It authenticates keys, checks ownership and input, orders each model's requests by seq_id, turns each
request into one kernel call, and hands results back through long-polled futures. It never touches
tensors: requests are decoded to numpy and passed on; results come back as plain arrays.

The routes live in `routes/`, one router per resource; what they share is the `Gateway` (gateway.py).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from openrl_lab.cluster.fleet import Fleet
from openrl_lab.gateway.bodies import LIMITS_DOC, MAX_BODY
from openrl_lab.gateway.deps import ApiKeyAuth
from openrl_lab.gateway.errors import install_error_handlers
from openrl_lab.gateway.gateway import Gateway
from openrl_lab.gateway.metrics import LabCollector, RequestMetrics
from openrl_lab.gateway.routes import HF_ROUTER, ROUTERS, SANDBOX_ROUTER
from openrl_lab.gateway.routes.rest import delete_checkpoint_files
from openrl_lab.gateway.store import Store
from openrl_lab.sandbox.serving import SandboxService, config_from_settings
from openrl_lab.version import __version__

log = logging.getLogger("openrl_lab.gateway")
API = "/api/v1"
EXPIRY_SWEEP_S = 30.0
# Threads for blocking work off the event loop, kernel calls most of all (each waits for its answer in one):
# up to Gateway.sample_slots samples, two pipelined calls per training model, decoding. asyncio's default
# (cores + 4) let only 6 concurrent sample calls reach a 2-core kernel, which batches the ones that meet.
WORKER_THREADS = 128
FUTURES_KEPT_S = 24 * 3600


def create_app(
    home: Path, store: Store, kernels: Fleet, scheduler=None, checkpoint_root: Path | None = None
) -> FastAPI:
    """`scheduler`: the in-process orchestrator's, for /metrics (None: no group metrics). `checkpoint_root`: the
    checkpoint store (default <home>/checkpoints)."""
    gw = Gateway(home, store, kernels, checkpoint_root)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=WORKER_THREADS, thread_name_prefix="gateway")
        )
        failed = store.fail_pending_futures("the server restarted before this request finished; send it again")
        if failed:
            log.warning("marked %d unfinished futures from before the restart as failed", failed)
        loop = asyncio.get_running_loop()
        # (called on the fleet's watcher thread)
        kernels.on_lost.append(lambda rec: loop.call_soon_threadsafe(gw.background, gw.kernel_lost(rec.epoch)))
        tasks = [asyncio.create_task(_reap_expired(gw)), asyncio.create_task(gw.liveness.run())]
        tasks.append(asyncio.create_task(app.state.sandbox.announce(log)))  # what the host lacks, said at start
        yield
        for task in tasks:
            task.cancel()
        await app.state.sandbox.aclose()

    # strict_content_type off: a JSON body without a Content-Type is still read as JSON (every body here is
    # JSON but forward_backward's); the API key header already rules out cross-site form posts.
    app = FastAPI(
        title="OpenRL Lab (Tinker API)",
        version=__version__,
        lifespan=lifespan,
        max_body_size=MAX_BODY,
        strict_content_type=False,
        description=f"The Tinker training API, self-hosted. {LIMITS_DOC}",
    )
    app.state.gateway = gw
    install_error_handlers(app)
    app.add_middleware(ApiKeyAuth, store=store)
    registry = CollectorRegistry()
    app.add_middleware(RequestMetrics, registry=registry)  # outermost: refused requests are counted too
    registry.register(LabCollector(lambda: len(gw.done_events), scheduler, kernels.running_by_name))
    app.state.sandbox = SandboxService(config_from_settings(), registry)  # its pool starts at the first request

    @app.get(f"{API}/healthz", tags=["sessions"])
    async def healthz():
        return {"status": "ok"}

    @app.get(
        "/metrics",
        tags=["operators"],
        response_class=Response,
        description="Prometheus metrics: open to clients on this machine, else an API key is needed",
    )
    async def metrics():
        # A scrape asks the kernel for its figures: off the event loop.
        return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

    for router in ROUTERS:
        app.include_router(router, prefix=API)
    app.include_router(HF_ROUTER)
    app.include_router(SANDBOX_ROUTER)
    return app


async def _reap_expired(gw: Gateway) -> None:
    while True:
        try:
            for row in gw.store.expired_checkpoints():
                delete_checkpoint_files(gw, row)
            gw.store.prune_futures(older_than_s=FUTURES_KEPT_S)
        except Exception:
            log.exception("checkpoint expiry sweep failed")
        await asyncio.sleep(EXPIRY_SWEEP_S)
