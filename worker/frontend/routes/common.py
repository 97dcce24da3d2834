"""What the route modules share: the FrontendService as a FastAPI dependency, and an answer
sent as one JSON body or as an SSE stream."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

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
    if body.stream:
        events = await service.stream(
            request.receive,
            answer,
            model,
            generate_requests,
            include_usage=body.include_usage,
        )
        return StreamingResponse(events, media_type="text/event-stream")
    body_of = await service.complete(request.receive, answer, model, generate_requests)
    return JSONResponse(body_of)
