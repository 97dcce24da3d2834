"""`POST /v1/completions`: a prompt, its token ids, or a batch of either (one NATS request per
prompt, answered as one response)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from worker.frontend.answers import CompletionAnswer, ResponseEnvelope
from worker.frontend.generate_requests import completion_requests, new_request_id
from worker.frontend.prompts import encode_prompts
from worker.frontend.routes.common import Service, respond
from worker.frontend.schemas import CompletionRequest

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, service: Service
) -> JSONResponse | StreamingResponse:
    target = await service.target(body.model)
    prompts = encode_prompts(target.model.tokenizer, body.prompts, body.batched)
    request_id = new_request_id("cmpl")
    service.log_accepted(request_id, target.name, body.user, len(prompts))
    envelope = ResponseEnvelope(request_id, target.name)
    answer = CompletionAnswer(envelope, target.model.tokenizer, prompts, body)
    guided = service.completion_guided(body)
    generate_requests = completion_requests(body, request_id, prompts, guided)
    for generate_request in generate_requests:
        generate_request.model = target.adapter
    return await respond(service, request, body, answer, target.model, generate_requests)
