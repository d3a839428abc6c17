"""Futures: every primitive answers a request id at once; its result is long-polled here."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response
from tinker import types as tt

from openrl_lab.gateway import wire
from openrl_lab.gateway.deps import Gw, User, api_router
from openrl_lab.gateway.errors import not_found
from openrl_lab.gateway.liveness import session_of

router = api_router(tags=["futures"])
LONG_POLL_S = 25.0  # the SDK's read timeout for retrieve_future is 45 s


@router.post("/retrieve_future")
async def retrieve_future(req: tt.FutureRetrieveRequest, gw: Gw, owner: User, request: Request):
    fut = gw.store.future(req.request_id, owner)
    if fut is None:
        raise not_found(f"request {req.request_id}")
    session = session_of(fut.target)
    gw.liveness.touch(session)
    if fut.status == "pending":
        event = gw.done_events.get(req.request_id)
        if event is not None and await _client_left(request, event):
            gw.liveness.lost_poll(session)  # a killed client stops polling and heartbeating at once
            return Response(status_code=499)  # nobody reads it
        fut = gw.store.future(req.request_id, owner)
        if fut is None:  # pruned while we waited
            raise not_found(f"request {req.request_id}")
        if fut.status == "pending":
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
    if fut.content_type == wire.PROTO and wire.PROTO not in request.headers.get("accept", ""):
        # A client that did not ask for protobuf gets the same result as JSON (tinker 0.18 asks for it only for
        # sample results, the only protobuf it decodes).
        return Response(
            await asyncio.to_thread(wire.result_as_json, fut.kind, fut.result), media_type="application/json"
        )
    return Response(fut.result, media_type=fut.content_type)


async def _client_left(request: Request, done: asyncio.Event) -> bool:
    """Waits up to LONG_POLL_S for `done`; True if the client hung up first."""

    async def hung_up():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    waiters = [asyncio.ensure_future(done.wait()), asyncio.ensure_future(hung_up())]
    finished, _ = await asyncio.wait(waiters, timeout=LONG_POLL_S, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    return waiters[1] in finished and waiters[0] not in finished
