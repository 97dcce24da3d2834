"""What the route modules share: the FrontendService as a FastAPI dependency, the HTTP client's
disconnect as the service's `ClientGone`, and an answer sent as one JSON body or as an SSE
stream."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive

from messages.request import GenerateRequest
from worker.frontend.answers import Answer
from worker.frontend.catalog import ServedModel
from worker.frontend.schemas import SamplingFields
from worker.frontend.service import FrontendService


async def service_of(request: Request) -> FrontendService:
    # async: FastAPI runs a plain function dependency in its thread pool, a thread hop and a
    # turn of the event loop before every request's handler.
    service: FrontendService = request.app.state.service
    return service


Service = Annotated[FrontendService, Depends(service_of)]


async def watch_disconnect(receive: Receive) -> None:
    """Returns once the HTTP client is gone (or the response has ended). `receive` is the HTTP
    request's ASGI receive after its body was read, so the server's next message is
    `http.disconnect`, which uvicorn's receive waits for without polling: Starlette's
    `Request.is_disconnected` instead costs a cancel scope per look, at least one per request
    while a wave of requests is admitted."""
    while (await receive())["type"] != "http.disconnect":
        pass  # body a route left unread


async def respond(
    service: FrontendService,
    request: Request,
    body: SamplingFields,
    answer: Answer[Any],
    model: ServedModel,
    generate_requests: Sequence[GenerateRequest],
) -> JSONResponse | StreamingResponse:
    """`generate_requests` sent and `answer` built from their frames: streamed when the body
    asks, else one JSON body."""
    client_gone = partial(watch_disconnect, request.receive)
    if body.stream:
        events = await service.stream(
            client_gone,
            answer,
            model,
            generate_requests,
            include_usage=body.include_usage,
        )
        return StreamingResponse(events, media_type="text/event-stream")
    body_of = await service.complete(client_gone, answer, model, generate_requests)
    return JSONResponse(body_of)
