"""Structured outputs in the frontend without vLLM: which bodies ask for them, vLLM's
StructuredOutputsParams → the wire's `guided_decoding` (field for field), the GenerateRequests
that carry it (chat and completions, over the routes with a scripted service), the worker's
refusal naming `sampling_options.guided_decoding` as a 400, and, in a frontend without vllm, a
400 naming the field instead of a crash. vLLM's own request classes are covered by
tests/e2e/test_frontend_structured.py."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from messages.request import GuidedDecoding
from tests.unit.test_frontend_routes import answers, app_of, events
from tests.unit.test_frontend_routes import client as client  # noqa: F401  (the fixture)
from tests.unit.test_frontend_shapes import EOS, HELLO, WORLD, frame
from worker.frontend.errors import OpenAIError
from worker.frontend.generate_requests import chat_request, completion_requests
from worker.frontend.prompts import Prompt
from worker.frontend.schemas import ChatCompletionRequest, CompletionRequest
from worker.frontend.vllm_parsers import guided_decoding

CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def http(client: Any) -> Any:
    """An httpx client over an app's ASGI transport (test_frontend_routes' `client`)."""
    return client


VLLM_BLOCKED = sys.modules.get("vllm", "absent") is None
without_vllm = pytest.mark.skipif(
    not VLLM_BLOCKED, reason="vllm importable here (the unit layer run alone blocks it)"
)


def params(**fields: Any) -> SimpleNamespace:
    """A stand-in for vLLM's StructuredOutputsParams (its fields, defaults as vLLM's)."""
    base: dict[str, Any] = dict(
        json=None,
        regex=None,
        choice=None,
        grammar=None,
        json_object=None,
        structural_tag=None,
        whitespace_pattern=None,
        disable_any_whitespace=False,
        disable_additional_properties=False,
    )
    return SimpleNamespace(**(base | fields))


@pytest.mark.parametrize(
    ("fields", "structured"),
    [
        ({}, False),
        ({"response_format": {"type": "text"}}, False),
        ({"response_format": {"type": "json_object"}}, True),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, True),
        ({"structured_outputs": {"choice": ["a", "b"]}}, True),
    ],
)
def test_which_bodies_ask_for_structured_outputs(fields: dict[str, Any], structured: bool) -> None:
    assert ChatCompletionRequest(messages=CHAT, **fields).structured is structured
    assert CompletionRequest(prompt="Hello", **fields).structured is structured


@pytest.mark.parametrize(
    ("fields", "wire"),
    [
        ({"json": {"type": "object"}}, {"json": {"type": "object"}}),
        ({"json": '{"type": "string"}'}, {"json": '{"type": "string"}'}),
        ({"json_object": True}, {"json_object": True}),
        ({"regex": "[a-z]+"}, {"regex": "[a-z]+"}),
        ({"choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        ({"structural_tag": '{"type": "x"}'}, {"structural_tag": '{"type": "x"}'}),
        (
            {"regex": "a", "whitespace_pattern": " "},
            {"regex": "a", "whitespace_pattern": " "},
        ),
    ],
)
def test_vllms_structured_outputs_become_the_wires_guided_decoding(
    fields: dict[str, Any], wire: dict[str, Any]
) -> None:
    guided = guided_decoding(params(**fields))
    assert guided is not None
    assert msgspec.to_builtins(guided) == wire
    assert guided_decoding(None) is None


@pytest.mark.parametrize("option", ["disable_any_whitespace", "disable_additional_properties"])
def test_options_the_wire_cannot_carry_are_refused(option: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        guided_decoding(params(json={}, **{option: True}))
    assert refused.value.status == 400
    assert refused.value.param == f"structured_outputs.{option}"


def test_generate_requests_carry_guided_decoding() -> None:
    guided = GuidedDecoding(choice=["yes", "no"])
    chat = chat_request(ChatCompletionRequest(messages=CHAT), "c-1", [HELLO], guided)
    assert chat.sampling_options.guided_decoding == guided
    body = CompletionRequest(prompt=["Hello", "world"])
    batch = completion_requests(body, "r", [Prompt([HELLO]), Prompt([WORLD])], guided)
    assert [r.sampling_options.guided_decoding for r in batch] == [guided, guided]
    assert chat_request(ChatCompletionRequest(messages=CHAT), "c", [HELLO]).sampling_options
    encoded = msgspec.json.decode(msgspec.json.encode(chat))
    assert encoded["sampling_options"]["guided_decoding"] == {"choice": ["yes", "no"]}


@dataclass
class FakePlan:
    """What the chat route takes of vllm_parsers.ChatPlan."""

    guided: GuidedDecoding | None
    tool_dicts: list[dict[str, Any]] | None = None
    made: Any = None

    def output(self, prompt_ids: list[int]) -> Any:
        return self.made


@pytest.mark.parametrize("stream", [False, True])
async def test_a_structured_chat_request_sends_its_guided_decoding(
    http: Any, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    app = app_of(answers(frame(HELLO), frame(EOS, finish="eos")))
    service = app.state.service
    guided = GuidedDecoding(json={"type": "object"})
    monkeypatch.setattr(service, "chat_plan", lambda body, model: FakePlan(guided))
    body = {"messages": CHAT, "response_format": {"type": "json_object"}, "stream": stream}
    answer = await http(app).post("/v1/chat/completions", json=body)
    assert answer.status_code == 200
    assert service.sent[0].sampling_options.guided_decoding == guided
    if stream:
        assert events(answer)[-1] == "[DONE]"
    else:
        assert answer.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}


async def test_a_structured_completions_batch_sends_guided_decoding_per_prompt(
    http: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = app_of(answers(frame(WORLD, finish="length")))
    service = app.state.service
    guided = GuidedDecoding(regex="[a-z]+")
    monkeypatch.setattr(service, "completion_guided", lambda body: guided)
    body = {"prompt": ["Hello", "Hello world"], "structured_outputs": {"regex": "[a-z]+"}}
    answer = await http(app).post("/v1/completions", json=body)
    assert answer.status_code == 200
    assert [r.sampling_options.guided_decoding for r in service.sent] == [guided, guided]


async def test_a_constraint_the_worker_refuses_is_a_400_with_its_reason(
    http: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = (
        "sampling_options.guided_decoding: refused by xgrammar, this engine's backend: "
        "Failed to transform regex into a grammar"
    )
    app = app_of(answers(frame(error=("invalid_request", reason))))
    monkeypatch.setattr(
        app.state.service, "chat_plan", lambda body, model: FakePlan(GuidedDecoding(regex="(a"))
    )
    body = {"messages": CHAT, "structured_outputs": {"regex": "(a"}}
    for stream in (False, True):
        answer = await http(app).post("/v1/chat/completions", json=body | {"stream": stream})
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert (error["type"], error["code"], error["message"]) == (
            "invalid_request_error",
            "invalid_request",
            reason,
        )


@without_vllm
@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ],
)
async def test_without_vllm_structured_outputs_are_a_400_naming_the_field(
    http: Any, path: str, fields: dict[str, Any], param: str
) -> None:
    app = app_of(answers())
    base = {"messages": CHAT} if "chat" in path else {"prompt": "Hello"}
    answer = await http(app).post(path, json=base | fields)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: needs vllm installed")
    assert app.state.service.sent == []


async def test_a_text_response_format_needs_no_vllm(http: Any) -> None:
    app = app_of(answers(frame(HELLO, finish="length")))
    body = {"messages": CHAT, "response_format": {"type": "text"}}
    answer = await http(app).post("/v1/chat/completions", json=body)
    assert answer.status_code == 200
    assert app.state.service.sent[0].sampling_options.guided_decoding is None


@pytest.mark.parametrize(
    "field",
    ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend"],
)
async def test_the_older_guided_fields_are_refused(http: Any, field: str) -> None:
    """vLLM 0.32's server ignores them (extra fields); refused here, never ignored."""
    app = app_of(answers())
    for path, base in (
        ("/v1/chat/completions", {"messages": CHAT}),
        ("/v1/completions", {"prompt": "Hello"}),
    ):
        answer = await http(app).post(path, json=base | {field: "x"})
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, field)
