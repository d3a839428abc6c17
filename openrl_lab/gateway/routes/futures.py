"""Futures: every primitive answers a request id at once; its result is long-polled here."""

from __future__ import annotations

import asyncio

from fastapi.responses import Response
from tinker import types as tt

from openrl_lab.gateway.deps import Gw, User, api_router
from openrl_lab.gateway.errors import not_found

router = api_router(tags=["futures"])
LONG_POLL_S = 25.0  # the SDK's read timeout for retrieve_future is 45 s


@router.post("/retrieve_future")
async def retrieve_future(req: tt.FutureRetrieveRequest, gw: Gw, owner: User):
    fut = gw.store.future(req.request_id, owner)
    if fut is None:
        raise not_found(f"request {req.request_id}")
    if fut.status == "pending":
        event = gw.done_events.get(req.request_id)
        if event is not None:
            try:
                await asyncio.wait_for(event.wait(), timeout=LONG_POLL_S)
            except asyncio.TimeoutError:
                pass
        fut = gw.store.future(req.request_id, owner)
        if fut.status == "pending":
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
    return Response(fut.result, media_type=fut.content_type)
