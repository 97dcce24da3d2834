"""vLLM's `POST /tokenize` (a prompt, or chat messages rendered with the chat template) and
`POST /detokenize`."""

from __future__ import annotations

from typing import Any

import pydantic
from fastapi import APIRouter, Body
from fastapi.exceptions import RequestValidationError

from worker.frontend.openai_shapes import tokenize_body
from worker.frontend.prompts import check_vocabulary, encode_messages
from worker.frontend.routes.common import Service
from worker.frontend.schemas import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from worker.frontend.vllm_parsers import tool_dicts_of

router = APIRouter()


def parse_tokenize(body: dict[str, Any]) -> TokenizeChatRequest | TokenizeCompletionRequest:
    """vLLM's two shapes, told apart by whether the body has `messages`."""
    shape = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return shape.model_validate(body)
    except pydantic.ValidationError as error:
        raise RequestValidationError(error.errors()) from error


@router.post("/tokenize")
async def tokenize(service: Service, body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
    parsed = parse_tokenize(body)
    model = (await service.target(parsed.model, None)).model
    tokenizer = model.tokenizer
    if isinstance(parsed, TokenizeChatRequest):
        token_ids = encode_messages(
            tokenizer,
            parsed.messages,
            template_kwargs=parsed.chat_template_kwargs,
            add_generation_prompt=parsed.add_generation_prompt,
            add_special_tokens=parsed.add_special_tokens,
            tools=tool_dicts_of(parsed.tools),
        )
    else:
        token_ids = tokenizer.encode_prompt(parsed.prompt, parsed.add_special_tokens)
    token_strs = tokenizer.token_strs(token_ids) if parsed.return_token_strs else None
    return tokenize_body(token_ids, await service.max_model_len(model), token_strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, service: Service) -> dict[str, str]:
    tokenizer = (await service.target(body.model, None)).model.tokenizer
    check_vocabulary(body.tokens, len(tokenizer))
    return {"prompt": tokenizer.decode(body.tokens)}
