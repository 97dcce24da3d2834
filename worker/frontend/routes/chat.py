"""`POST /v1/chat/completions`: the messages (and tools) rendered with the model's chat template,
one NATS request; structured outputs, tool choices and output parsers as vLLM's server handles
them (the service's chat plan, worker/frontend/vllm_parsers.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from worker.frontend.answers import ChatAnswer, ResponseEnvelope
from worker.frontend.generate_requests import chat_logprobs, chat_request, new_request_id
from worker.frontend.prompts import encode_messages
from worker.frontend.routes.common import Service, respond
from worker.frontend.schemas import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, service: Service
) -> JSONResponse | StreamingResponse:
    target = await service.target(body.model)
    tokenizer = target.model.tokenizer
    plan = service.chat_plan(body, target.model)
    prompt_ids = encode_messages(
        tokenizer,
        body.messages,
        template_kwargs=body.chat_template_kwargs,
        tools=None if plan is None else plan.tool_dicts,
    )
    request_id = new_request_id("chatcmpl")
    service.log_accepted(request_id, target.name, body.user, 1)
    envelope = ResponseEnvelope(request_id, target.name)
    output = None if plan is None else plan.output(prompt_ids)
    answer = ChatAnswer(envelope, tokenizer, len(prompt_ids), body, chat_logprobs(body), output)
    guided = None if plan is None else plan.guided
    generate_request = chat_request(body, request_id, prompt_ids, guided)
    generate_request.model = target.adapter
    return await respond(service, request, body, answer, target.model, [generate_request])
