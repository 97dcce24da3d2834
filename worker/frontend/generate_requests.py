"""OpenAI request bodies → the wire's GenerateRequests: one per prompt of a completions request
(a batch is one NATS request per prompt), one per chat request."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from messages.request import (
    GenerateRequest,
    GuidedDecoding,
    OutputOptions,
    SamplingOptions,
    StopConditions,
)
from worker.frontend.prompts import Prompt
from worker.frontend.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields


def new_request_id(prefix: str) -> str:
    """`cmpl-<hex>` / `chatcmpl-<hex>`, as OpenAI's and vLLM's ids."""
    return f"{prefix}-{uuid.uuid4().hex}"


def prompt_request_id(request_id: str, prompt_index: int, batched: bool) -> str:
    """A batch's prompts are NATS requests of their own: `<id>-<prompt index>`."""
    return f"{request_id}-{prompt_index}" if batched else request_id


def stop_conditions(body: SamplingFields, max_tokens: int | None) -> StopConditions:
    return StopConditions(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        stop_token_ids=body.stop_token_ids,
        stop=body.stop_strings,
        include_stop_str_in_output=body.include_stop_str_in_output or None,
    )


def sampling_options(body: SamplingFields, guided: GuidedDecoding | None = None) -> SamplingOptions:
    """`guided`: the request's structured outputs as vLLM's request classes extracted them
    (worker/frontend/vllm_parsers.py), the wire's `guided_decoding`."""
    return SamplingOptions(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.token_bias,
        guided_decoding=guided,
    )


def completion_requests(
    body: CompletionRequest,
    request_id: str,
    prompts: Sequence[Prompt],
    guided: GuidedDecoding | None = None,
) -> list[GenerateRequest]:
    """One request per prompt. Prompt scoring (echo, max_tokens 0): the wire's max_tokens is
    >= 1, so one token is generated and dropped, as vLLM's server does; only the prompt and its
    logprobs return."""
    return [
        GenerateRequest(
            request_id=prompt_request_id(request_id, i, body.batched),
            token_ids=prompt.token_ids,
            sampling_options=sampling_options(body, guided),
            stop_conditions=stop_conditions(body, 1 if body.scoring else body.max_tokens),
            output_options=completion_output(body),
        )
        for i, prompt in enumerate(prompts)
    ]


def completion_output(body: CompletionRequest) -> OutputOptions:
    """`logprobs` k per generated token (none when scoring: nothing generated is returned),
    and with `echo` the prompt's too."""
    k = body.logprobs
    return OutputOptions(
        logprobs=None if body.scoring else k,
        prompt_logprobs=k if body.echo and k is not None else None,
    )


def chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """The top logprobs asked per token (0: the chosen token's alone); None: no logprobs."""
    return (body.top_logprobs or 0) if body.logprobs else None


def chat_request(
    body: ChatCompletionRequest,
    request_id: str,
    prompt_ids: list[int],
    guided: GuidedDecoding | None = None,
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        token_ids=prompt_ids,
        sampling_options=sampling_options(body, guided),
        stop_conditions=stop_conditions(body, body.token_limit),
        output_options=OutputOptions(logprobs=chat_logprobs(body)),
    )
