"""The frontend's routes over HTTP (httpx's ASGI transport, no server, no NATS): the API key,
refused fields, error statuses, and whole answers from a FrontendService whose `publish` plays
scripted frames instead of sending the request; and its log lines with a hostile value."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import pytest
from fastapi import FastAPI

from messages.frames import ResponseFrame
from messages.request import GenerateRequest
from tests.unit.test_frontend_shapes import BANG, EOS, HELLO, THERE, TOKENIZER, WORLD, frame
from worker.frontend.app import FrontendSettings, create_app
from worker.frontend.catalog import ServedModel
from worker.frontend.service import FrontendService
from worker.shared.log_text import loggable

Script = Callable[[GenerateRequest], list[ResponseFrame]]
HOSTILE = "\r\nPUB x 1\r\n\x00\u202e"


class ScriptedService(FrontendService):
    """Sends nothing: a request's frames are `script(request)`; `sent` holds the requests."""

    def __init__(self, app: FastAPI, script: Script) -> None:
        old = app.state.service
        super().__init__(old.settings, old.catalog.configured.tokenizer, old.metrics)
        self.script = script
        self.sent: list[GenerateRequest] = []

    def publish(
        self, model: ServedModel, request: GenerateRequest
    ) -> tuple[AsyncGenerator[ResponseFrame, None], None]:
        self.sent.append(request)

        async def frames() -> AsyncGenerator[ResponseFrame, None]:
            for scripted in self.script(request):
                yield scripted

        return frames(), None


def app_of(script: Script | None = None, **settings: Any) -> FastAPI:
    """The real app; with `script`, its service plays frames (without, it has no NATS)."""
    app = create_app(FrontendSettings(model_names=("m", "m2"), **settings), TOKENIZER)
    if script is not None:
        app.state.service = ScriptedService(app, script)
    return app


@pytest.fixture
async def client() -> AsyncIterator[Callable[[FastAPI], httpx.AsyncClient]]:
    opened: list[httpx.AsyncClient] = []

    def open_(app: FastAPI) -> httpx.AsyncClient:
        opened.append(httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t"))
        return opened[-1]

    yield open_
    for each in opened:
        await each.aclose()


def events(response: httpx.Response) -> list[Any]:
    """The SSE stream's payloads, `[DONE]` as the string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    parts = [p for p in response.content.split(b"\n\n") if p]
    assert all(p.startswith(b"data: ") for p in parts)
    return [
        "[DONE]" if p == b"data: [DONE]" else msgspec.json.decode(p[len(b"data: ") :])
        for p in parts
    ]


def answers(*frames_: ResponseFrame) -> Script:
    return lambda _: list(frames_)


async def test_v1_needs_the_api_key_and_the_other_routes_do_not(client: Any) -> None:
    http = client(app_of(answers(), api_key="sk-1"))
    for headers in ({}, {"authorization": "Bearer sk-2"}):
        refused = await http.get("/v1/models", headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        assert refused.json()["error"]["code"] == "invalid_api_key"
    assert (await http.get("/v1/models", headers={"authorization": "Bearer sk-1"})).is_success
    assert (await http.get("/version")).json() == {"version": "0.1.0"}
    assert (await http.post("/tokenize", json={"prompt": "Hello"})).is_success


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hello", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "Hello", "suffix": "!"}, "suffix"),
        ("/v1/completions", {"prompt": "Hello", "guided_json": {}}, "guided_json"),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "tools": "all"}, "tools"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}], "response_format": "json"},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages"),
    ],
)
async def test_refused_fields_are_400s_and_nothing_is_sent(
    client: Any, path: str, body: dict[str, Any], param: str
) -> None:
    app = app_of(answers())
    answer = await client(app).post(path, json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert error["message"].startswith(f"{param}: ")
    assert app.state.service.sent == []


async def test_an_unknown_model_is_a_404_and_no_nats_a_503(client: Any) -> None:
    http = client(app_of())
    unknown = await http.post("/v1/completions", json={"model": "other", "prompt": "Hello"})
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": "The model `other` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    unconnected = await http.post("/v1/completions", json={"prompt": "Hello"})
    assert unconnected.status_code == 503
    assert unconnected.json()["error"]["message"] == "not connected to NATS"
    health = await http.get("/health")
    assert health.status_code == 503
    assert health.json() == {"status": "unavailable", "reason": "not connected to NATS"}


async def test_completions_answer_and_token_metrics(client: Any) -> None:
    app = app_of(answers(frame(WORLD), frame(BANG, finish="length")))
    answer = await client(app).post("/v1/completions", json={"model": "m2", "prompt": "Hello"})
    assert answer.status_code == 200
    body = answer.json()
    assert body["id"].startswith("cmpl-") and body["model"] == "m2"
    assert body["choices"] == [
        {
            "index": 0,
            "text": " world!",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    [sent] = app.state.service.sent
    assert sent.request_id == body["id"] and sent.token_ids == [0, HELLO]
    registry = app.state.service.metrics.registry
    assert registry.get_sample_value("nats_frontend_tokens_total", {"kind": "completion"}) == 2


async def test_a_streamed_batch_numbers_choices_and_ends_with_usage_and_done(client: Any) -> None:
    def script(request: GenerateRequest) -> list[ResponseFrame]:
        j = int(request.request_id.rsplit("-", 1)[1])  # the prompt's index
        return [frame(WORLD if j == 0 else THERE, index=i, finish="eos") for i in range(2)]

    app = app_of(script)
    body = {
        "prompt": ["Hello", "Hello"],
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payloads = events(await client(app).post("/v1/completions", json=body))
    assert payloads[-1] == "[DONE]"
    *chunks, usage = payloads[:-1]
    texts = {c["choices"][0]["index"]: c["choices"][0]["text"] for c in chunks}
    assert texts == {0: " world", 1: " world", 2: " there", 3: " there"}
    assert {c["choices"][0]["finish_reason"] for c in chunks} == {"stop"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert sorted(r.request_id[-2:] for r in app.state.service.sent) == ["-0", "-1"]


async def test_a_refusal_before_any_output_is_an_http_error_streaming_or_not(client: Any) -> None:
    http = client(app_of(answers(frame(error=("overloaded", "at its limit")))))
    for stream in (False, True):
        answer = await http.post("/v1/completions", json={"prompt": "Hello", "stream": stream})
        assert answer.status_code == 503
        assert answer.json()["error"] == {
            "message": "at its limit",
            "type": "service_unavailable",
            "param": None,
            "code": "overloaded",
        }


async def test_an_error_mid_stream_is_an_error_event_then_done(client: Any) -> None:
    app = app_of(answers(frame(WORLD), frame(error=("engine_error", "engine died"))))
    payloads = events(
        await client(app).post("/v1/completions", json={"prompt": "Hello", "stream": True})
    )
    assert payloads[0]["choices"][0]["text"] == " world"
    assert payloads[1] == {
        "error": {
            "message": "engine died",
            "type": "internal_error",
            "param": None,
            "code": "engine_error",
        }
    }
    assert payloads[2:] == ["[DONE]"]


async def test_chat_streams_the_role_first(client: Any) -> None:
    app = app_of(answers(frame(HELLO), frame(EOS, finish="eos")))
    body = {"messages": [{"role": "user", "content": "Hello"}], "stream": True}
    payloads = events(await client(app).post("/v1/chat/completions", json=body))
    assert [p["choices"][0]["delta"] for p in payloads[:-1]] == [
        {"role": "assistant", "content": ""},
        {"content": "Hello"},
        {"content": ""},
    ]
    assert payloads[-2]["choices"][0]["finish_reason"] == "stop"
    assert {p["object"] for p in payloads[:-1]} == {"chat.completion.chunk"}
    assert payloads[-1] == "[DONE]"


async def test_tokenize_and_detokenize(client: Any) -> None:
    http = client(app_of())
    tokens = await http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert tokens.json() == {
        "count": 3,
        "max_model_len": None,
        "tokens": [0, HELLO, WORLD],
        "token_strs": ["<s>", "Hello", " world"],
    }
    chat = await http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]})
    assert chat.json()["tokens"] == [HELLO]
    text = await http.post("/detokenize", json={"tokens": [0, HELLO, WORLD]})
    assert text.json() == {"prompt": "Hello world"}
    outside = await http.post("/detokenize", json={"tokens": [HELLO, 99]})
    assert (outside.status_code, outside.json()["error"]["param"]) == (400, "tokens.1")


async def test_hostile_strings_in_the_frontends_log_lines_are_escaped(
    client: Any, caplog: Any
) -> None:
    """A `model` and a `user` with CR/LF, NUL and U+202E: each log line that quotes them stays
    one line, the value escaped."""
    caplog.set_level(logging.DEBUG, logger="worker.frontend")
    http = client(app_of(answers(frame(WORLD, finish="length"))))
    refused = await http.post("/v1/completions", json={"model": HOSTILE, "prompt": "Hello"})
    assert refused.status_code == 404
    served = await http.post("/v1/completions", json={"prompt": "Hello", "user": HOSTILE})
    assert served.status_code == 200
    quoting = [r.getMessage() for r in caplog.records if "PUB x 1" in r.getMessage()]
    assert len(quoting) == 2
    for line in quoting:
        assert not any(c in line for c in "\r\n\x00\u202e")
        assert loggable(HOSTILE) in line
        assert "\\x0d\\x0aPUB x 1\\x0d\\x0a\\x00\\u202e" in line


async def test_a_one_prompt_request_is_published_in_its_handlers_task(client: Any) -> None:
    """The first token's way through the frontend takes no turn of the event loop that it need
    not: the service dependency is a coroutine (FastAPI runs a plain function in its thread
    pool), and one prompt's request is published in the handler's own task (a task of its own
    would first wait behind every stream's frames); a batch's prompts still go out together."""
    import asyncio
    import inspect

    from worker.frontend.routes.common import service_of

    assert inspect.iscoroutinefunction(service_of)
    app = app_of(answers(frame(WORLD), frame(BANG, finish="length")))
    service = app.state.service
    tasks: list[asyncio.Task[Any] | None] = []
    publish = service.publish

    def recording(model: ServedModel, request: GenerateRequest) -> Any:
        tasks.append(asyncio.current_task())
        return publish(model, request)

    service.publish = recording
    http = client(app)  # httpx's ASGI transport runs the app in the caller's task
    for stream in (False, True):
        answer = await http.post(
            "/v1/completions", json={"model": "m", "prompt": "Hello", "stream": stream}
        )
        assert answer.status_code == 200, answer.text
    assert tasks == [asyncio.current_task()] * 2
    batch = await http.post("/v1/completions", json={"model": "m", "prompt": ["Hello", "Hello"]})
    assert batch.status_code == 200 and len(batch.json()["choices"]) == 2
    assert len(tasks) == 4 and asyncio.current_task() not in tasks[2:]
