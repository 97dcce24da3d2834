"""The frontend's error bodies and statuses (worker/frontend/errors.py), the 400s of prompts it
cannot encode (prompts.py), and the GenerateRequests it makes of a body (generate_requests.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats.errors
import pydantic
import pytest

from tests.unit.test_frontend_shapes import BOS, HELLO, TOKENIZER, chat_body
from worker.client import FrameOrderError, RequestError
from worker.frontend.errors import OpenAIError, transport_error, validation_error
from worker.frontend.generate_requests import (
    chat_logprobs,
    chat_request,
    completion_requests,
    new_request_id,
)
from worker.frontend.prompts import check_vocabulary, encode_messages, encode_prompts
from worker.frontend.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest


def test_error_body_has_openais_four_fields() -> None:
    error = OpenAIError(400, "n: too big", "invalid_request_error", "n")
    assert error.body() == {
        "error": {
            "message": "n: too big",
            "type": "invalid_request_error",
            "param": "n",
            "code": None,
        }
    }


@pytest.mark.parametrize(
    ("code", "status", "type_"),
    [
        ("invalid_request", 400, "invalid_request_error"),
        ("overloaded", 503, "service_unavailable"),
        ("worker_shutdown", 503, "service_unavailable"),
        ("no_workers", 503, "service_unavailable"),
        ("worker_lost", 503, "service_unavailable"),
        ("engine_error", 500, "internal_error"),
        ("deadline_exceeded", 504, "timeout"),
        ("client_gone", 499, "client_gone"),
        ("a_newer_workers_code", 500, "internal_error"),
    ],
)
def test_a_worker_error_code_maps_to_its_status_and_type(
    code: str, status: int, type_: str
) -> None:
    error = OpenAIError.from_worker(code, "said the worker")
    assert (error.status, error.type, error.code, error.message) == (
        status,
        type_,
        code,
        "said the worker",
    )


def _errors(shape: type[pydantic.BaseModel], body: dict[str, Any]) -> list[Any]:
    with pytest.raises(pydantic.ValidationError) as caught:
        shape.model_validate(body)
    return caught.value.errors()


def test_validation_errors_name_the_field_in_param() -> None:
    refused = validation_error(_errors(CompletionRequest, {"prompt": "x", "best_of": 2}))
    assert (refused.status, refused.param) == (400, "best_of")
    assert refused.message == "best_of: not supported by this frontend (use n)"
    unknown = validation_error(_errors(CompletionRequest, {"prompt": "x", "guided_json": {}}))
    assert unknown.param == "guided_json"
    assert "not supported by this frontend" in unknown.message
    nested = validation_error(
        _errors(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]})
    )
    assert nested.param == "messages.0.role" and nested.message.startswith("messages.0.role: ")
    assert '(got "robot")' in nested.message
    assert nested.type == "invalid_request_error"


def test_a_union_fields_error_says_every_shape_it_may_take() -> None:
    error = validation_error(_errors(CompletionRequest, {"prompt": 5}))
    assert error.param == "prompt"
    assert error.message.startswith("prompt: must be a string, a list of token ids")
    assert error.message.endswith("(got 5)")


@pytest.mark.parametrize(
    ("raised", "status", "type_"),
    [
        (RequestError("overloaded", "everyone busy"), 503, "service_unavailable"),
        (nats.errors.TimeoutError(), 504, "timeout"),
        (FrameOrderError("seq 3 after 1"), 502, "internal_error"),
        (nats.errors.ConnectionClosedError(), 503, "service_unavailable"),
        (OpenAIError(404, "x", "NotFoundError"), 404, "NotFoundError"),
    ],
)
def test_transport_failures_map_to_statuses(raised: Exception, status: int, type_: str) -> None:
    error = transport_error(raised)
    assert (error.status, error.type) == (status, type_)


def test_an_unexpected_failure_is_a_500_logged_on_one_escaped_line(caplog: Any) -> None:
    caplog.set_level(logging.ERROR, logger="worker.frontend")
    error = transport_error(ValueError("bad \r\nPUB x 1\r\n"))
    assert (error.status, error.type) == (500, "internal_error")
    [record] = caplog.records
    first_line = record.getMessage().split("\n")[0]
    assert first_line == "request failed: ValueError: bad \\x0d\\x0aPUB x 1\\x0d\\x0a"


def test_a_cancellation_is_not_turned_into_an_error_body() -> None:
    with pytest.raises(asyncio.CancelledError):
        transport_error(asyncio.CancelledError())


def test_an_empty_prompt_is_a_400_naming_its_position_in_a_batch() -> None:
    with pytest.raises(OpenAIError) as caught:
        encode_prompts(TOKENIZER, ["Hello", []], batched=True)
    assert (caught.value.status, caught.value.param) == (400, "prompt.1")
    assert caught.value.message == "prompt.1: must not be empty"
    with pytest.raises(OpenAIError) as caught:
        encode_prompts(TOKENIZER, [[]], batched=False)
    assert caught.value.param == "prompt"


def test_messages_a_chat_template_refuses_are_a_400_on_messages() -> None:
    messages = [ChatMessage(role="user", content="Hello")]
    assert encode_messages(TOKENIZER, messages) == [HELLO]
    with pytest.raises(OpenAIError) as caught:
        encode_messages(TOKENIZER, messages, template_kwargs={"refuse": True})
    assert (caught.value.status, caught.value.param) == (400, "messages")
    assert caught.value.message == "messages: the chat template failed: roles must alternate"


def test_detokenize_refuses_ids_outside_the_vocabulary() -> None:
    check_vocabulary([0, 9], 10)
    with pytest.raises(OpenAIError) as caught:
        check_vocabulary([0, 10], 10)
    assert (caught.value.status, caught.value.param) == (400, "tokens.1")


def test_a_batch_is_one_generate_request_per_prompt() -> None:
    body = CompletionRequest(prompt=["Hello", "Hello"], max_tokens=4, stop=".", logprobs=2)
    prompts = encode_prompts(TOKENIZER, body.prompts, body.batched)
    requests = completion_requests(body, "cmpl-1", prompts)
    assert [r.request_id for r in requests] == ["cmpl-1-0", "cmpl-1-1"]
    assert requests[0].token_ids == [BOS, HELLO]
    assert requests[0].stop_conditions.max_tokens == 4
    assert requests[0].stop_conditions.stop == ["."]
    assert requests[0].stop_conditions.include_stop_str_in_output is None
    assert requests[0].output_options.logprobs == 2
    assert requests[0].output_options.prompt_logprobs is None
    single = CompletionRequest(prompt="Hello")
    assert [r.request_id for r in completion_requests(single, "cmpl-2", prompts[:1])] == ["cmpl-2"]


def test_prompt_scoring_asks_one_token_and_the_prompts_logprobs() -> None:
    body = CompletionRequest(prompt="Hello", echo=True, max_tokens=0, logprobs=3)
    [request] = completion_requests(body, "cmpl-1", encode_prompts(TOKENIZER, body.prompts, False))
    assert request.stop_conditions.max_tokens == 1
    assert (request.output_options.logprobs, request.output_options.prompt_logprobs) == (None, 3)


def test_chat_logprobs_and_sampling_reach_the_wire() -> None:
    assert chat_logprobs(chat_body()) is None
    assert chat_logprobs(chat_body(logprobs=True)) == 0
    assert chat_logprobs(chat_body(logprobs=True, top_logprobs=5)) == 5
    body = chat_body(max_completion_tokens=7, temperature=0.5, logit_bias={"3": 200.0}, n=2)
    request = chat_request(body, "chatcmpl-1", [HELLO])
    assert request.stop_conditions.max_tokens == 7
    assert request.sampling_options.temperature == 0.5
    assert request.sampling_options.n == 2
    assert request.sampling_options.logit_bias == {3: 100.0}  # clamped as vLLM's server
    assert new_request_id("chatcmpl").startswith("chatcmpl-")
