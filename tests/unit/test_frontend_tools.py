"""Tool calls in the frontend without vLLM: vLLM's rules for the message and `finish_reason`
(named, `required`, `auto`, `parallel_tool_calls`), the tool choice a vLLM request stands for,
vLLM's refusals of a tool choice no parser serves, tool calls and tool results on their way to
the chat template, and whole answers, streamed and not, from scripted frames and a scripted
output parser over the routes. vLLM's own parsers run in tests/e2e/test_frontend_structured.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit.test_frontend_routes import answers, app_of, events
from tests.unit.test_frontend_routes import client as client  # noqa: F401  (the fixture)
from tests.unit.test_frontend_shapes import EOS, HELLO, WORLD, frame
from tests.unit.test_frontend_structured import VLLM_BLOCKED
from worker.frontend import tool_calls
from worker.frontend.errors import OpenAIError
from worker.frontend.prompts import encode_messages
from worker.frontend.schemas import ChatCompletionRequest, ChatMessage
from worker.frontend.tool_calls import ChatOutput, Parsed, ToolChoice
from worker.frontend.vllm_parsers import ParserNames, _tool_choice, _tool_choice_refusal

CHAT = [{"role": "user", "content": "Hello"}]
CALL = {
    "id": "chatcmpl-tool-1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
}
OTHER = {**CALL, "id": "chatcmpl-tool-2", "function": {"name": "get_time", "arguments": "{}"}}
NAMED = ToolChoice(named="get_weather")
REQUIRED = ToolChoice(required=True)
AUTO = ToolChoice(auto=True)


@pytest.fixture
def http(client: Any) -> Any:
    return client


# --- vLLM's rules for the message and finish_reason ------------------------------------------


@pytest.mark.parametrize(
    ("choice", "parsed", "content", "calls", "finish"),
    [
        (NAMED, Parsed(None, None, [CALL]), "", [CALL], "stop"),
        (REQUIRED, Parsed(None, None, [CALL, OTHER]), "", [CALL, OTHER], "tool_calls"),
        (AUTO, Parsed(None, "Sure.", [CALL]), "Sure.", [CALL], "tool_calls"),
        (AUTO, Parsed(None, "No call.", []), "No call.", [], "stop"),
        (ToolChoice(), Parsed(None, "text", [CALL]), "text", [], "stop"),
        (
            ToolChoice(auto=True, parallel=False),
            Parsed(None, None, [CALL, OTHER]),
            None,
            [CALL],
            "tool_calls",
        ),
        (
            ToolChoice(required=True, parallel=False),
            Parsed(None, None, [CALL, OTHER]),
            "",
            [CALL],
            "tool_calls",
        ),
    ],
    ids=["named", "required", "auto", "auto-no-call", "none", "auto-single", "required-single"],
)
def test_a_messages_tool_calls_and_finish_reason_as_vllm_shapes_them(
    choice: ToolChoice, parsed: Parsed, content: str | None, calls: list[Any], finish: str
) -> None:
    message, called = tool_calls.message(choice, parsed)
    assert message == {"role": "assistant", "content": content, "tool_calls": calls}
    assert tool_calls.finish_reason(choice, called, "stop") == finish


def test_a_length_cut_keeps_length_and_reasoning_has_its_field() -> None:
    message, called = tool_calls.message(REQUIRED, Parsed(None, None, []))
    assert tool_calls.finish_reason(REQUIRED, called, "length") == "length"
    shaped, _ = tool_calls.message(ToolChoice(reasoning=True), Parsed("hmm", "yes"))
    assert shaped == {"role": "assistant", "content": "yes", "tool_calls": [], "reasoning": "hmm"}


@pytest.mark.parametrize(
    ("choice", "streamed_calls", "finish", "expected"),
    [
        (REQUIRED, True, "stop", "tool_calls"),
        (AUTO, True, "stop", "tool_calls"),
        (NAMED, True, "stop", "stop"),
        (AUTO, False, "stop", "stop"),
        (AUTO, True, "length", "length"),
    ],
)
def test_a_streamed_finish_reason_as_vllm_gives_it(
    choice: ToolChoice, streamed_calls: bool, finish: str, expected: str
) -> None:
    assert tool_calls.streamed_finish_reason(choice, streamed_calls, finish) == expected


def test_parallel_tool_calls_false_keeps_index_0_of_a_delta() -> None:
    delta = {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}, {"index": 1}]}
    single = ToolChoice(auto=True, parallel=False)
    assert tool_calls.filter_delta(single, delta) == {
        "tool_calls": [{"index": 0, "function": {"arguments": "{"}}]
    }
    assert tool_calls.filter_delta(AUTO, delta) == delta
    assert tool_calls.filter_delta(single, {"content": "x"}) == {"content": "x"}


# --- the tool choice a vLLM request stands for, and vLLM's refusals --------------------------


def vllm_request(choice: Any, tools: bool = True, parallel: bool | None = True) -> Any:
    """A stand-in for vLLM's ChatCompletionRequest (what the frontend reads of it)."""
    return SimpleNamespace(
        tool_choice=choice, tools=[object()] if tools else None, parallel_tool_calls=parallel
    )


def parser_class(tool: bool = True, reasoning: bool = False) -> Any:
    return SimpleNamespace(
        tool_parser_cls=object() if tool else None,
        reasoning_parser_cls=object() if reasoning else None,
    )


HERMES = ParserNames("hermes", True, None)


def test_the_tool_choice_of_a_vllm_request() -> None:
    named = SimpleNamespace(function=SimpleNamespace(name="get_weather"))
    assert _tool_choice(vllm_request(named), parser_class(), HERMES) == NAMED
    assert _tool_choice(vllm_request("required"), parser_class(), HERMES) == REQUIRED
    assert _tool_choice(vllm_request("auto"), parser_class(), HERMES) == AUTO
    assert _tool_choice(vllm_request("auto"), None, ParserNames()) == ToolChoice()
    assert _tool_choice(vllm_request("none"), parser_class(), HERMES) == ToolChoice()
    single = _tool_choice(vllm_request("auto", parallel=False), parser_class(True, True), HERMES)
    assert single == ToolChoice(auto=True, parallel=False, reasoning=True)


@pytest.mark.parametrize(
    ("choice", "names", "message"),
    [
        (
            "auto",
            ParserNames(),
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set",
        ),
        ("required", ParserNames(), 'tool_choice="required" requires --tool-call-parser to be set'),
        (
            SimpleNamespace(function=SimpleNamespace(name="f")),
            ParserNames(reasoning_parser="r"),
            'tool_choice=function "f" requires --tool-call-parser to be set',
        ),
    ],
)
def test_a_tool_choice_no_parser_serves_is_refused_in_vllms_words(
    choice: Any, names: ParserNames, message: str
) -> None:
    parser = parser_class(tool=False, reasoning=True) if names.reasoning_parser else None
    with pytest.raises(OpenAIError) as refused:
        _tool_choice_refusal(vllm_request(choice), parser, names)
    assert (refused.value.status, refused.value.param) == (400, "tool_choice")
    assert refused.value.message == message
    _tool_choice_refusal(vllm_request("none"), None, names)
    _tool_choice_refusal(vllm_request("required"), parser_class(), HERMES)


# --- tool calls and results on their way to the chat template --------------------------------


@pytest.mark.parametrize(
    ("arguments", "parsed"),
    [
        ('{"city": "paris"}', {"city": "paris"}),
        ("", {}),
        ("not json", {}),
        ("[1]", {}),
        ({"a": 1}, {"a": 1}),
    ],
)
def test_tool_call_arguments_reach_the_template_as_objects(arguments: Any, parsed: Any) -> None:
    call = {**CALL, "function": {"name": "get_weather", "arguments": arguments}}
    message = ChatMessage(role="assistant", content=None, tool_calls=[call])
    assert message.for_template() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": parsed}}],
    }


def test_tool_results_and_names_reach_the_template() -> None:
    result = ChatMessage(role="tool", content="sunny", tool_call_id="chatcmpl-tool-1")
    assert result.for_template() == {
        "role": "tool",
        "content": "sunny",
        "tool_call_id": "chatcmpl-tool-1",
    }
    empty = ChatMessage(role="assistant", content="Hi", tool_calls=[])
    assert empty.for_template() == {"role": "assistant", "content": "Hi"}
    assert ChatMessage(role="user", content="x", name="ann").for_template()["name"] == "ann"


@dataclass
class RecordingTokenizer:
    seen: list[dict[str, Any]] = field(default_factory=list)

    def encode_chat(self, messages: Any, **options: Any) -> list[int]:
        self.seen.append({"messages": messages, **options})
        return [HELLO]


def test_tools_and_tool_messages_are_handed_to_the_chat_template() -> None:
    recording = RecordingTokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    messages = [
        ChatMessage(role="assistant", tool_calls=[CALL]),
        ChatMessage(role="tool", content="ok", tool_call_id="1"),
    ]
    assert encode_messages(recording, messages, tools=tools) == [HELLO]  # type: ignore[arg-type]
    (seen,) = recording.seen
    assert seen["tools"] == tools
    assert seen["messages"][0]["tool_calls"][0]["function"]["arguments"] == {"city": "paris"}
    bad = [
        ChatMessage(role="user", content="x"),
        ChatMessage(role="assistant", tool_calls=[{"type": "x"}]),
    ]
    with pytest.raises(OpenAIError) as refused:
        encode_messages(recording, bad)  # type: ignore[arg-type]
    assert refused.value.param == "messages.1.tool_calls.0"


# --- whole answers from scripted frames and a scripted parser --------------------------------


class ScriptedParser:
    """An OutputParser whose streamed deltas are scripted, one per call; its final parse says
    the text was a call of get_weather with the text as arguments."""

    def __init__(self, deltas: list[dict[str, Any] | None]) -> None:
        self.deltas = list(deltas)
        self.fed: list[tuple[str, list[int], bool]] = []

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        self.fed.append((text, token_ids, finished))
        return self.deltas.pop(0)

    def final(self, text: str, token_ids: list[int]) -> Parsed:
        self.fed.append((text, token_ids, True))
        call = {**CALL, "function": {"name": "get_weather", "arguments": text}}
        return Parsed(None, None, [call])


@dataclass
class FakePlan:
    choice: ToolChoice
    deltas: list[dict[str, Any] | None] = field(default_factory=list)
    guided: Any = None
    tool_dicts: list[dict[str, Any]] | None = None
    parsers: list[ScriptedParser] = field(default_factory=list)

    def output(self, prompt_ids: list[int]) -> ChatOutput:
        def make() -> ScriptedParser:
            self.parsers.append(ScriptedParser(self.deltas))
            return self.parsers[-1]

        return ChatOutput(self.choice, make)


def planned(monkeypatch: pytest.MonkeyPatch, plan: FakePlan) -> Any:
    app = app_of(answers(frame(HELLO), frame(WORLD), frame(EOS, finish="eos")))
    monkeypatch.setattr(app.state.service, "chat_plan", lambda body, model: plan)
    return app


@pytest.mark.parametrize(
    ("choice", "finish"), [(REQUIRED, "tool_calls"), (NAMED, "stop")], ids=["required", "named"]
)
async def test_a_forced_tool_call_answer(
    http: Any, monkeypatch: pytest.MonkeyPatch, choice: ToolChoice, finish: str
) -> None:
    plan = FakePlan(choice)
    app = planned(monkeypatch, plan)
    body = {"messages": CHAT, "tools": [{}], "tool_choice": "required"}
    answer = (await http(app).post("/v1/chat/completions", json=body)).json()["choices"][0]
    call = {**CALL, "function": {"name": "get_weather", "arguments": "Hello world"}}
    assert answer["message"] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert answer["finish_reason"] == finish
    assert plan.parsers[0].fed == [("Hello world", [HELLO, WORLD, EOS], True)]


@pytest.mark.parametrize(
    ("choice", "finish"), [(AUTO, "tool_calls"), (NAMED, "stop")], ids=["auto", "named"]
)
async def test_a_streamed_tool_call_answer(
    http: Any, monkeypatch: pytest.MonkeyPatch, choice: ToolChoice, finish: str
) -> None:
    opening = {
        "index": 0,
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "get_weather"},
    }
    fragment = {"index": 0, "function": {"arguments": '{"city": "paris"}'}}
    plan = FakePlan(choice, [None, {"tool_calls": [opening]}, {"tool_calls": [fragment]}])
    app = planned(monkeypatch, plan)
    body = {"messages": CHAT, "tools": [{}], "stream": True}
    payloads = events(await http(app).post("/v1/chat/completions", json=body))
    assert [p["choices"][0]["delta"] for p in payloads[:-1]] == [
        {"role": "assistant", "content": ""},
        {"tool_calls": [opening]},
        {"tool_calls": [fragment]},
    ]
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-1]] == [None, None, finish]
    assert plan.parsers[0].fed == [
        ("Hello", [HELLO], False),
        (" world", [WORLD], False),
        ("", [EOS], True),
    ]


async def test_a_held_back_delta_at_the_end_is_an_empty_delta(
    http: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = FakePlan(AUTO, [{"content": "Hello"}, None, None])
    app = planned(monkeypatch, plan)
    body = {"messages": CHAT, "tools": [{}], "stream": True}
    payloads = events(await http(app).post("/v1/chat/completions", json=body))
    assert [p["choices"][0]["delta"] for p in payloads[1:-1]] == [{"content": "Hello"}, {}]
    assert payloads[-2]["choices"][0]["finish_reason"] == "stop"


async def test_each_choice_has_its_own_parser(http: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = FakePlan(REQUIRED)
    app = app_of(answers(frame(HELLO, index=0, finish="eos"), frame(WORLD, index=1, finish="eos")))
    monkeypatch.setattr(app.state.service, "chat_plan", lambda body, model: plan)
    body = {"messages": CHAT, "tools": [{}], "n": 2}
    answer = (await http(app).post("/v1/chat/completions", json=body)).json()
    assert [c["message"]["tool_calls"][0]["function"]["arguments"] for c in answer["choices"]] == [
        "Hello",
        " world",
    ]
    assert len(plan.parsers) == 2


@pytest.mark.skipif(not VLLM_BLOCKED, reason="vllm importable here")
async def test_without_vllm_tools_are_a_400_naming_the_field(http: Any) -> None:
    app = app_of(answers())
    for path, body in (
        ("/v1/chat/completions", {"messages": CHAT, "tools": [CALL]}),
        ("/tokenize", {"messages": CHAT, "tools": [CALL]}),
    ):
        answer = await http(app).post(path, json=body)
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, "tools")
    assert app.state.service.sent == []


def test_tool_choice_left_out_is_not_a_tool_request() -> None:
    assert not ChatCompletionRequest(messages=CHAT).uses_tools
    assert ChatCompletionRequest(messages=CHAT, tool_choice="none").uses_tools
    assert ChatCompletionRequest(messages=CHAT, tools=[]).uses_tools


async def test_reasoning_in_the_message_and_the_deltas(
    http: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reasoning parser's split: `reasoning` beside `content` (vLLM 0.32's field names)."""
    plan = FakePlan(
        ToolChoice(reasoning=True), [{"reasoning": "Hello"}, {"content": " world"}, None]
    )
    app = planned(monkeypatch, plan)
    body = {"messages": CHAT, "stream": True}
    payloads = events(await http(app).post("/v1/chat/completions", json=body))
    assert [p["choices"][0]["delta"] for p in payloads[1:-1]] == [
        {"reasoning": "Hello"},
        {"content": " world"},
        {},
    ]

    class Splitting(ScriptedParser):
        def final(self, text: str, token_ids: list[int]) -> Parsed:
            return Parsed("Hello", " world")

    monkeypatch.setattr(
        app.state.service,
        "chat_plan",
        lambda body, model: SimpleNamespace(
            guided=None,
            tool_dicts=None,
            output=lambda ids: ChatOutput(ToolChoice(reasoning=True), lambda: Splitting([])),
        ),
    )
    answer = (await http(app).post("/v1/chat/completions", json={"messages": CHAT})).json()
    assert answer["choices"][0]["message"] == {
        "role": "assistant",
        "content": " world",
        "tool_calls": [],
        "reasoning": "Hello",
    }


def test_the_parser_flags() -> None:
    from worker.frontend.cli import parse_args, settings_of

    args = parse_args(
        ["--model", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--reasoning-parser", "deepseek_r1"]
    )  # fmt: skip
    settings = settings_of(args)
    assert (settings.tool_call_parser, settings.enable_auto_tool_choice) == ("hermes", True)
    assert settings.reasoning_parser == "deepseek_r1"
    assert settings_of(parse_args(["--model", "m"])).tool_call_parser is None
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--enable-auto-tool-choice"])
    assert not ParserNames("hermes").any  # a tool parser without auto: none runs, as in vLLM
    assert ParserNames("hermes", True).any and ParserNames(reasoning_parser="x").any


@pytest.mark.skipif(not VLLM_BLOCKED, reason="vllm importable here")
def test_a_parser_flag_without_vllm_fails_the_start() -> None:
    with pytest.raises(ImportError):
        app_of(tool_call_parser="hermes", enable_auto_tool_choice=True)
    app_of(tool_call_parser="hermes")  # no parser runs without --enable-auto-tool-choice
