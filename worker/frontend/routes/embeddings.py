"""`POST /v1/embeddings`: the inputs of a request for an embedding model's workers (a pooling
model, worker/client/embeddings.py), tokenized here, answered as vLLM's server answers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from messages.embeddings import EmbedRequest
from worker.frontend.generate_requests import new_request_id
from worker.frontend.openai_shapes import embedding_body
from worker.frontend.prompts import encode_inputs
from worker.frontend.routes.common import Service
from worker.frontend.schemas import EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, service: Service) -> dict[str, Any]:
    target = await service.target(body.model, "embed")
    inputs = encode_inputs(
        target.model.tokenizer, body.inputs, body.batched, body.add_special_tokens
    )
    request_id = new_request_id("embd")
    service.log_accepted(request_id, target.name, body.user, len(inputs))
    request = EmbedRequest(
        request_id=request_id,
        inputs=inputs,
        model=target.adapter,
        dimensions=body.dimensions,
        use_activation=body.use_activation,
    )
    answer = await service.embed(target.model, request)
    return embedding_body(
        request_id, target.name, answer.vectors, body.encoding_format, answer.prompt_tokens
    )
