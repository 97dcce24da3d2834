"""Structured outputs, tool calls and the tools' prompts through the frontend (with vLLM's
`hermes` tool-call parser, `--enable-auto-tool-choice`), side by side with vLLM's own server on
the same tiny model and flags (the session's `vllm_server`): the same greedy requests give the
same text, `tool_calls` and `finish_reason`, streamed and not; a run that stops on its own gives
JSON that validates against the schema; the official `openai` client's `parse` and streaming
helpers work against the frontend."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import nats
import openai
import pydantic
import pytest

from tests.e2e.test_frontend import api, post, sse
from tests.helpers import TEST_SUBJECTS, serving
from worker.frontend.app import FrontendSettings, create_app
from worker.frontend.tokenizer import ModelTokenizer

CHAT = [{"role": "user", "content": "Hello there"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
# Forces a hermes tool call out of the random model, for tool_choice auto.
HERMES_CALL = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}"\}\}</tool_call>'
)


@pytest.fixture(scope="module")
async def frontend(worker, nats_server, tiny_model: Path) -> AsyncIterator[str]:
    """The frontend with the flags of the session's vLLM server: hermes tool calls, auto."""
    nc = await nats.connect(nats_server.url)
    settings = FrontendSettings(
        model_names=(str(tiny_model),),
        subject=TEST_SUBJECTS.generate,
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    async with serving(app) as base:
        yield base + "/v1"
    await nc.close()


def greedy(tiny_model: Path, **fields: Any) -> dict[str, Any]:
    return {"model": str(tiny_model), "temperature": 0.0, "max_tokens": 48, **fields}


@functools.cache
def no_whitespace(tiny_model: Path) -> dict[str, float]:
    """`logit_bias` against the whitespace-only tokens: the random model, left to a JSON
    grammar, fills the space between tokens with whitespace until the length limit; biased
    away (-100, the most either server takes: it makes them rarer, not impossible), its JSON
    closes sooner."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    special = set(tokenizer.all_special_ids)
    return {
        str(i): -100.0
        for i in range(len(tokenizer))
        if i not in special and (text := tokenizer.decode([i])) and not text.strip()
    }


def tight(tiny_model: Path, **fields: Any) -> dict[str, Any]:
    """A greedy request whose JSON closes (see no_whitespace)."""
    return greedy(tiny_model, logit_bias=no_whitespace(tiny_model), **fields)


def calls_of(message: dict[str, Any]) -> list[tuple[str, str, str]]:
    """A message's tool calls without their (random) ids."""
    return [
        (c["type"], c["function"]["name"], c["function"]["arguments"])
        for c in message.get("tool_calls") or []
    ]


def assembled(chunks: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """A streamed chat answer put together: content, tool calls (OpenAI's streamed shape:
    index, then id/type/name once, then argument fragments), finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"type": None, "name": "", "args": ""})
                if call.get("id"):
                    assert call.get("type") == "function"
                    entry["type"] = "function"
                function = call.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["args"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    shaped = [(c["type"], c["name"], c["args"]) for _, c in sorted(calls.items())]
    return content, shaped, finish


async def both_chat(frontend: str, vllm_server: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The request non-streamed and streamed on both servers: every view equal; vLLM's
    non-streamed choice returned."""
    ours = (await post(frontend, "/chat/completions", body))["choices"][0]
    theirs = (await post(vllm_server.base_url, "/chat/completions", body))["choices"][0]
    assert ours["message"]["content"] == theirs["message"]["content"]
    assert calls_of(ours["message"]) == calls_of(theirs["message"])
    assert ours["finish_reason"] == theirs["finish_reason"]
    our_stream = assembled(await sse(frontend, "/chat/completions", body))
    their_stream = assembled(await sse(vllm_server.base_url, "/chat/completions", body))
    assert our_stream == their_stream
    return theirs


async def test_response_format_json_schema_matches_vllm(frontend, vllm_server, tiny_model) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    body = tight(tiny_model, messages=CHAT, response_format=response_format, max_tokens=64)
    theirs = await both_chat(frontend, vllm_server, body)
    assert theirs["finish_reason"] == "stop"  # stopped on its own: the JSON is whole
    jsonschema.validate(json.loads(theirs["message"]["content"]), SCHEMA)
    loose = await both_chat(frontend, vllm_server, body | {"logit_bias": None})
    if loose["finish_reason"] == "stop":
        jsonschema.validate(json.loads(loose["message"]["content"]), SCHEMA)


async def test_response_format_json_object_matches_vllm_on_both_endpoints(
    frontend, vllm_server, tiny_model
) -> None:
    fields = {"response_format": {"type": "json_object"}, "max_tokens": 32}
    theirs = await both_chat(frontend, vllm_server, greedy(tiny_model, messages=CHAT, **fields))
    if theirs["finish_reason"] == "stop":
        assert isinstance(json.loads(theirs["message"]["content"]), dict)
    body = greedy(tiny_model, prompt="Hello there", **fields)
    ours = (await post(frontend, "/completions", body))["choices"][0]
    vllm = (await post(vllm_server.base_url, "/completions", body))["choices"][0]
    assert (ours["text"], ours["finish_reason"]) == (vllm["text"], vllm["finish_reason"])


@pytest.mark.parametrize(
    "constraint",
    [{"choice": ["sunny", "rainy", "cloudy"]}, {"regex": "[a-z]{3,8}( [0-9]{1,3})?"}],
    ids=["choice", "regex"],
)
async def test_structured_outputs_match_vllm(frontend, vllm_server, tiny_model, constraint) -> None:
    body = greedy(tiny_model, messages=CHAT, structured_outputs=constraint)
    theirs = await both_chat(frontend, vllm_server, body)
    content = theirs["message"]["content"]
    if "choice" in constraint:
        assert content in constraint["choice"]
    completion = greedy(tiny_model, prompt="Hello there", structured_outputs=constraint)
    ours = (await post(frontend, "/completions", completion))["choices"][0]
    vllm = (await post(vllm_server.base_url, "/completions", completion))["choices"][0]
    assert (ours["text"], ours["finish_reason"]) == (vllm["text"], vllm["finish_reason"])
    chunks = await sse(frontend, "/completions", completion)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == vllm["text"]


@pytest.mark.parametrize("strict", [False, True], ids=["loose", "strict"])
async def test_a_named_tool_choice_matches_vllm(frontend, vllm_server, tiny_model, strict) -> None:
    """A tool without `strict` constrains the call's frame, not its arguments (vLLM's default
    strict level: any JSON value, `null` from the random model); a strict one its schema."""
    weather = WEATHER
    if strict:
        weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = tight(
        tiny_model, messages=CHAT, tools=[weather, TIME], tool_choice=choice, max_tokens=96
    )
    theirs = await both_chat(frontend, vllm_server, body)
    if theirs["finish_reason"] == "stop":  # a named choice's, as OpenAI's
        (call,) = theirs["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert theirs["message"]["content"] == ""
        arguments = json.loads(call["function"]["arguments"])
        if strict:
            jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    else:
        assert (theirs["finish_reason"], theirs["message"]["tool_calls"]) == ("length", [])
    await both_chat(frontend, vllm_server, body | {"logit_bias": None})


async def test_tool_choice_required_matches_vllm(frontend, vllm_server, tiny_model) -> None:
    body = tight(tiny_model, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=64)
    theirs = await both_chat(frontend, vllm_server, body)
    if theirs["finish_reason"] == "tool_calls":
        assert theirs["message"]["tool_calls"]
        assert {c["function"]["name"] for c in theirs["message"]["tool_calls"]} <= {
            "get_weather",
            "get_time",
        }
    await both_chat(frontend, vllm_server, body | {"logit_bias": None})


@pytest.mark.parametrize("parallel", [None, False], ids=["parallel", "single"])
async def test_auto_tool_calls_are_parsed_as_vllm_parses_them(
    frontend, vllm_server, tiny_model, parallel
) -> None:
    """tool_choice auto: the output forced into hermes' format (a regex), then parsed."""
    regex = f"{HERMES_CALL}( ?{HERMES_CALL})?"
    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    body = greedy(
        tiny_model, messages=CHAT, tools=TOOLS, structured_outputs={"regex": regex}, **fields
    )
    theirs = await both_chat(frontend, vllm_server, body)
    if theirs["finish_reason"] == "tool_calls":
        assert theirs["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert theirs["message"]["tool_calls"][0]["id"]


async def test_tool_choice_none_and_plain_auto_match_vllm(
    frontend, vllm_server, tiny_model
) -> None:
    """No call: the text is the content. (Constrained to words: unconstrained, the random model
    emits byte tokens after a tools prompt, whose text vLLM's detokenizer and the frontend's
    decoder differ on: a known difference of the frontend's decoding, not of tool calls.)"""
    words = {"regex": "[a-z]{2,8}( [a-z]{2,8}){0,3}"}
    for choice in ("none", "auto"):
        body = greedy(
            tiny_model, messages=CHAT, tools=TOOLS, tool_choice=choice, structured_outputs=words
        )
        theirs = await both_chat(frontend, vllm_server, body)
        assert theirs["message"].get("tool_calls") in ([], None)


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
]


async def test_tools_and_tool_messages_reach_the_template_as_in_vllm(
    frontend, vllm_server, tiny_model
) -> None:
    """/tokenize with tools, a call and its result: the same prompt tokens; and the chat
    continues the same."""
    base = frontend.removesuffix("/v1")
    body = {"model": str(tiny_model), "messages": CONVERSATION, "tools": [WEATHER]}
    ours = await post(base, "/tokenize", body)
    theirs = await post(vllm_server.base_url.removesuffix("/v1"), "/tokenize", body)
    assert ours["tokens"] == theirs["tokens"]
    plain = await post(base, "/tokenize", {"model": str(tiny_model), "messages": CONVERSATION})
    assert len(plain["tokens"]) < len(ours["tokens"])
    chat = greedy(tiny_model, messages=CONVERSATION, tools=[WEATHER], tool_choice="none")
    await both_chat(frontend, vllm_server, chat)


async def test_refusals_match_vllms(frontend, vllm_server, tiny_model) -> None:
    unknown = {"type": "function", "function": {"name": "nope"}}
    for fields in (
        {"tools": TOOLS, "tool_choice": unknown},
        {"tool_choice": "required"},
        {"response_format": {"type": "json_schema"}},
    ):
        body = greedy(tiny_model, messages=CHAT, **fields)
        async with httpx.AsyncClient(timeout=60) as http:
            mine = await http.post(frontend + "/chat/completions", json=body)
            vllm = await http.post(vllm_server.base_url + "/chat/completions", json=body)
        assert (mine.status_code, vllm.status_code) == (400, 400), (mine.text, vllm.text)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    mood: Literal["happy", "sad"]


async def test_the_openai_clients_parse_helper(frontend, tiny_model) -> None:
    client = api(frontend)
    try:
        answer = await client.chat.completions.parse(
            model=str(tiny_model),
            messages=CHAT,
            response_format=Person,
            temperature=0.0,
            max_tokens=200,
            logit_bias=no_whitespace(tiny_model),
        )
    except openai.LengthFinishReasonError:
        pytest.skip("the random model ran to the length limit inside the JSON")
    message = answer.choices[0].message
    assert isinstance(message.parsed, Person)
    assert Person.model_validate_json(message.content) == message.parsed


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)


async def test_the_openai_clients_tool_call_stream_helper(frontend, tiny_model) -> None:
    client = api(frontend)
    tool = openai.pydantic_function_tool(GetWeather)
    names, argument_deltas = [], []
    try:
        async with client.chat.completions.stream(
            model=str(tiny_model),
            messages=CHAT,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "GetWeather"}},
            temperature=0.0,
            max_tokens=200,
            logit_bias=no_whitespace(tiny_model),
        ) as stream:
            async for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    argument_deltas.append(event.arguments_delta)
                elif event.type == "tool_calls.function.arguments.done":
                    names.append(event.name)
            final = await stream.get_final_completion()
    except openai.LengthFinishReasonError:
        pytest.skip("the random model ran to the length limit inside the call")
    choice = final.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "GetWeather" and call.id
    assert "".join(argument_deltas) == call.function.arguments
    assert names == ["GetWeather"]
    assert isinstance(call.function.parsed_arguments, GetWeather)


@pytest.fixture(scope="module")
async def reasoning_frontend(worker, nats_server, tiny_model: Path) -> AsyncIterator[str]:
    """The frontend with vLLM's `qwen3` reasoning parser (one the tiny tokenizer can serve: its
    `<think>` tags are plain text here)."""
    nc = await nats.connect(nats_server.url)
    settings = FrontendSettings(
        model_names=(str(tiny_model),), subject=TEST_SUBJECTS.generate, reasoning_parser="qwen3"
    )
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    async with serving(app) as base:
        yield base + "/v1"
    await nc.close()


async def test_a_reasoning_parser_splits_reasoning_from_the_answer(
    reasoning_frontend, tiny_model
) -> None:
    """The output forced into `<think>…</think>…` (a regex): vLLM's parser puts the thinking in
    `reasoning` (vLLM 0.32's field) and the rest in `content`, streamed as `delta.reasoning`
    then `delta.content`."""
    regex = "<think>[a-z]{2,8}( [a-z]{2,8})?</think>[a-z]{2,8}( [a-z]{2,8})?"
    body = greedy(tiny_model, messages=CHAT, structured_outputs={"regex": regex})
    answer = (await post(reasoning_frontend, "/chat/completions", body))["choices"][0]
    assert answer["finish_reason"] == "stop"
    message = answer["message"]
    assert message["reasoning"] and message["content"]
    assert re.fullmatch(regex, f"<think>{message['reasoning']}</think>{message['content']}")
    chunks = await sse(reasoning_frontend, "/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed_reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    streamed_content = "".join(d.get("content") or "" for d in deltas)
    assert (streamed_reasoning, streamed_content) == (message["reasoning"], message["content"])
    plain = await post(reasoning_frontend, "/chat/completions", greedy(tiny_model, messages=CHAT))
    assert "reasoning" in plain["choices"][0]["message"]
