"""The OpenAI-compatible frontend (worker/frontend) on the real nats-server, the session's real
vLLM engine and worker: the official `openai` package against it, side by side with vLLM's own
OpenAI server on the same tiny model, validation, and cancellation end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import nats
import openai
import pytest

from tests.helpers import TEST_SUBJECTS, free_port, serving
from worker.frontend.app import FrontendSettings, create_app
from worker.frontend.tokenizer import ModelTokenizer

ROOT = Path(__file__).resolve().parents[2]
CHAT = [{"role": "user", "content": "Hello there"}]
CHAT_PROMPTS = [
    CHAT,
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me about the sea, please!"},
    ],
    [{"role": "user", "content": "Sto lai mourn tra é?"}],
]
COMPLETION_PROMPTS: list[str | list[int]] = [
    "Hello there",
    "Stai bou ren, vi mail.",
    [1, 300, 301, 302],
]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
async def frontend(worker, nats_server, tiny_model: Path) -> AsyncIterator[str]:
    """The frontend served by uvicorn on a free loopback port, in this event loop."""
    nc = await nats.connect(nats_server.url)
    settings = FrontendSettings(model_names=(str(tiny_model),), subject=TEST_SUBJECTS.generate)
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    async with serving(app) as base:
        yield base + "/v1"
    await nc.close()


def api(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)


async def wait_engine_idle(engine, worker, within: float) -> float:
    started = time.monotonic()
    while engine.num_unfinished_requests() != 0 or worker.service.in_flight != 0:
        assert time.monotonic() - started < within, (
            f"engine holds {engine.num_unfinished_requests()} requests, worker "
            f"{worker.service.in_flight} after {within}s"
        )
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def gauge(metrics, name: str) -> float:
    return next(
        sample.value
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name == name
    )


# --- the official openai package against the frontend ---------------------------------------


async def test_openai_chat_with_logprobs_streamed_and_not(frontend, tiny_model) -> None:
    client = api(frontend)
    asked = dict(
        model=str(tiny_model),
        messages=CHAT,
        max_tokens=12,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    answer = await client.chat.completions.create(**asked)
    choice = answer.choices[0]
    assert answer.object == "chat.completion"
    assert choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 12
    content = choice.logprobs.content
    assert len(content) == 12
    for entry in content:
        assert isinstance(entry.logprob, float) and entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - TOLERANCE
        assert bytes(entry.bytes).decode() == entry.token
    assert "".join(entry.token for entry in content) == choice.message.content
    assert choice.message.content

    stream = await client.chat.completions.create(
        **asked, stream=True, stream_options={"include_usage": True}
    )
    text, entries, finish, usage = "", [], None, None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for part in chunk.choices:
            text += part.delta.content or ""
            if part.logprobs is not None:
                entries += part.logprobs.content
            finish = part.finish_reason or finish
    assert text == choice.message.content
    assert finish == "length" and usage.completion_tokens == 12
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in content]


async def test_openai_completions_with_logprobs_streamed_and_not(frontend, tiny_model) -> None:
    client = api(frontend)
    asked = dict(
        model=str(tiny_model),
        prompt="Hello there",
        max_tokens=10,
        temperature=0.0,
        logprobs=4,
        extra_body={"ignore_eos": True},
    )
    answer = await client.completions.create(**asked)
    choice = answer.choices[0]
    assert answer.object == "text_completion" and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 10
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 10
    for token, value, top, offset in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset,
        strict=True,
    ):  # fmt: skip
        assert value <= 0.0
        # The top 4, plus the chosen token when it is not among them (OpenAI's "logprobs + 1").
        assert len(top) in (4, 5) and top[token] == value
        assert choice.text[offset:].startswith(token)
    assert "".join(logprobs.tokens) == choice.text

    stream = await client.completions.create(**asked, stream=True)
    text, tokens, offsets = "", [], []
    async for chunk in stream:
        for part in chunk.choices:
            text += part.text
            if part.logprobs is not None:
                tokens += part.logprobs.tokens
                offsets += part.logprobs.text_offset
    assert text == choice.text and tokens == logprobs.tokens and offsets == logprobs.text_offset


async def test_completions_echo_returns_prompt_logprobs(frontend, tiny_model) -> None:
    answer = await api(frontend).completions.create(
        model=str(tiny_model),
        prompt="Hello there",
        max_tokens=4,
        temperature=0.0,
        logprobs=2,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    choice = answer.choices[0]
    prompt_tokens = answer.usage.prompt_tokens
    assert choice.text.startswith("Hello there")
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == prompt_tokens + 4
    # Position 0 has nothing before it: null logprob and null top_logprobs, as OpenAI's.
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(v is not None and v <= 0.0 for v in logprobs.token_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[prompt_tokens] == len("Hello there")


async def test_models_lists_the_served_model(frontend, tiny_model) -> None:
    models = await api(frontend).models.list()
    assert [m.id for m in models.data] == [str(tiny_model)]


# --- side by side with vLLM's own OpenAI server ---------------------------------------------


def assert_close(ours: list[float | None], theirs: list[float | None]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert (a is None and b is None) or abs(a - b) <= TOLERANCE, (a, b)


async def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=120) as http:
        answer = await http.post(url + path, json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()


async def sse(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", url + path, json={**body, "stream": True}) as answer:
            assert answer.status_code == 200
            async for line in answer.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def token_strings_comparable(theirs: str, ours: str, ours_bytes: bytes) -> bool:
    """Where vLLM's token string can be compared with ours: vLLM shows '' (or U+FFFD) for a
    byte-fallback token, where ours is the true UTF-8 of its bytes (or its `<0xNN>` piece)."""
    return theirs != "" and "\ufffd" not in theirs and len(ours_bytes) > 0


@pytest.mark.parametrize("messages", CHAT_PROMPTS, ids=["hello", "system", "accents"])
async def test_chat_matches_vllm_server(frontend, vllm_server, tiny_model, messages) -> None:
    body = {
        "model": str(tiny_model),
        "messages": messages,
        "max_tokens": 24,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 5,
    }
    ours = (await post(frontend, "/chat/completions", body))["choices"][0]
    theirs = (await post(vllm_server.base_url, "/chat/completions", body))["choices"][0]
    assert ours["message"]["content"] == theirs["message"]["content"]
    assert ours["finish_reason"] == theirs["finish_reason"]
    our_entries, their_entries = ours["logprobs"]["content"], theirs["logprobs"]["content"]
    assert_close([e["logprob"] for e in our_entries], [e["logprob"] for e in their_entries])
    for a, b in zip(our_entries, their_entries, strict=True):
        assert_close(
            [t["logprob"] for t in a["top_logprobs"]], [t["logprob"] for t in b["top_logprobs"]]
        )
        if token_strings_comparable(b["token"], a["token"], bytes(a["bytes"])):
            assert a["token"] == b["token"] and a["bytes"] == b["bytes"]
    # Streamed: the same text and logprobs as the non-streamed answer.
    chunks = await sse(frontend, "/chat/completions", body)
    streamed = [
        e for c in chunks for ch in c["choices"] for e in (ch["logprobs"] or {}).get("content", [])
    ]
    assert (
        "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
        == (theirs["message"]["content"])
    )
    assert_close([e["logprob"] for e in streamed], [e["logprob"] for e in their_entries])


@pytest.mark.parametrize("prompt", COMPLETION_PROMPTS, ids=["hello", "sentence", "token-ids"])
@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
async def test_completions_match_vllm_server(
    frontend, vllm_server, tiny_model, prompt, echo
) -> None:
    body = {
        "model": str(tiny_model),
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0.0,
        "logprobs": 3,
        "echo": echo,
    }
    ours = (await post(frontend, "/completions", body))["choices"][0]
    theirs = (await post(vllm_server.base_url, "/completions", body))["choices"][0]
    if isinstance(prompt, str) or not echo:
        # (vLLM's echo of a token-id prompt is its decode, with the prompt's special tokens.)
        assert ours["text"] == theirs["text"]
    assert ours["finish_reason"] == theirs["finish_reason"]
    a, b = ours["logprobs"], theirs["logprobs"]
    assert_close(a["token_logprobs"], b["token_logprobs"])
    for our_top, their_top in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
        if their_top is None:
            assert our_top is None
            continue
        # Maps keyed by token string: vLLM shows '' for byte-fallback tokens, so several of
        # them collapse into one '' key there. Every other key must match, value for value.
        if "" not in their_top:
            assert len(our_top) == len(their_top)
            assert_close(sorted(our_top.values()), sorted(their_top.values()))
        for token, value in their_top.items():
            if token != "":
                assert_close([our_top[token]], [value])
    for position, (ours_token, their_token) in enumerate(
        zip(a["tokens"], b["tokens"], strict=True)
    ):
        if position == 0 and echo:
            continue  # vLLM decodes the first prompt token alone, dropping its "▁" space
        if token_strings_comparable(their_token, ours_token, ours_token.encode()):
            assert ours_token == their_token, position
    # vLLM's text_offset adds up the lengths of its token strings; ours is where each token's
    # text starts in `text`. They agree up to the first token whose strings differ.
    start = 1 if echo else 0  # vLLM's position-0 echo token has no "▁" space
    same = start
    while same < len(a["tokens"]) and a["tokens"][same] == b["tokens"][same]:
        same += 1
    if isinstance(prompt, str) or not echo:
        assert a["text_offset"][start : same + 1] == b["text_offset"][start : same + 1]
        if same < len(a["tokens"]):  # only a byte-fallback token, '' in vLLM, stops them
            assert b["tokens"][same] == "" and a["tokens"][same].startswith("<0x")
    streamed = await sse(frontend, "/completions", body)
    assert "".join(ch["text"] for c in streamed for ch in c["choices"]) == ours["text"]
    assert_close(
        [
            v
            for c in streamed
            for ch in c["choices"]
            for v in (ch["logprobs"] or {}).get("token_logprobs", [])
        ],
        a["token_logprobs"],
    )


# --- validation ---------------------------------------------------------------------------


def _stop_string_of(text: str) -> str:
    """3 characters a third of the way into a greedy answer: a stop string it will meet."""
    end = len(text) // 3
    stop = text[max(0, end - 3) : end]
    assert len(stop.strip()) == len(stop) == 3, text
    return stop


@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
async def test_stop_strings_match_vllm_server(
    frontend, vllm_server, tiny_model, path: str, include: bool
) -> None:
    """Same text, finish_reason and stop_reason as vLLM's server, streamed and not; the
    streamed text (held back while it may start a match) adds up to the whole answer."""
    chat = path == "/chat/completions"
    body: dict[str, Any] = {"model": str(tiny_model), "max_tokens": 40, "temperature": 0.0}
    body |= {"messages": CHAT} if chat else {"prompt": "Hello there", "logprobs": 2}

    def text_of(choice: dict[str, Any]) -> str:
        return choice["message"]["content"] if chat else choice["text"]

    free = (await post(vllm_server.base_url, path, body))["choices"][0]
    stop = _stop_string_of(text_of(free))
    body |= {"stop": [stop, "no such stop string"], "include_stop_str_in_output": include}
    theirs = (await post(vllm_server.base_url, path, body))["choices"][0]
    ours = (await post(frontend, path, body))["choices"][0]
    assert (theirs["finish_reason"], theirs["stop_reason"]) == ("stop", stop)
    assert (ours["finish_reason"], ours["stop_reason"]) == ("stop", stop)
    assert text_of(ours) == text_of(theirs)
    assert text_of(ours).endswith(stop) == include
    if not chat:  # logprobs cut at the same token as vLLM's: the one that completed the match
        for a, b in zip(ours["logprobs"]["tokens"], theirs["logprobs"]["tokens"], strict=True):
            assert a == b or not token_strings_comparable(b, a, a.encode())
        assert_close(ours["logprobs"]["token_logprobs"], theirs["logprobs"]["token_logprobs"])
    chunks = await sse(frontend, path, body)
    pieces = [
        (ch["delta"].get("content") or "") if chat else ch["text"]
        for c in chunks
        for ch in c["choices"]
    ]
    assert "".join(pieces) == text_of(ours)
    final = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert [(ch["finish_reason"], ch["stop_reason"]) for ch in final] == [("stop", stop)]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "says"),
    [
        ("/chat/completions", {"messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs",
         "only allowed when logprobs is true"),
        ("/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400,
         "top_logprobs", "less than or equal to 20"),
        ("/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, 400,
         "top_logprobs", "greater than or equal to 0"),
        ("/chat/completions", {"messages": []}, 400, "messages", "at least 1 item"),
        ("/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
         "messages.0.role", "'system'"),
        ("/chat/completions", {"messages": CHAT, "stop": ["\n", ""]}, 400, "stop",
         "stop strings must not be empty"),
        ("/chat/completions", {"messages": CHAT, "temperature": 3}, 400, "temperature",
         "less than or equal to 2"),
        ("/completions", {"prompt": "Hi", "logprobs": 21}, 400, None,
         "output_options.logprobs: must be <= 20"),
        ("/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens",
         "must be >= 1 (0 only with echo: prompt scoring)"),
        ("/completions", {"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens",
         "greater than or equal to 0"),
        ("/completions", {"prompt": []}, 400, "prompt", "must not be empty"),
        ("/completions", {"prompt": "Hi", "logit_bias": {"hello": 1}}, 400, "logit_bias",
         "keys must be token ids"),
        ("/completions", {"prompt": "Hi", "n": "two"}, 400, "n", "valid integer"),
        ("/completions", {"prompt": [1, 5000]}, 400, None, "vocab"),
        ("/completions", {"prompt": "Hi", "max_tokens": 600}, 400, None, "max_model_len"),
        ("/completions", {"model": "gpt-4", "prompt": "Hi"}, 404, "model", "does not exist"),
        # Never silently ignored: what cannot be honoured is a 400 naming the field.
        ("/chat/completions", {"messages": CHAT, "guided_json": {"type": "object"}}, 400,
         "guided_json", "guided_json: not supported by this frontend"),
        ("/chat/completions", {"messages": CHAT, "structured_outputs": {"json": {}, "regex": "a"}},
         400, "structured_outputs", "You can only use one kind of constraints"),
        ("/completions", {"prompt": "Hi", "prompt_logprobs": 2}, 400, "prompt_logprobs",
         "echo with logprobs"),
        ("/completions", {"prompt": "Hi", "skip_special_tokens": False}, 400,
         "skip_special_tokens", "only true is supported"),
        ("/completions", {"prompt": "Hi", "made_up_field": 1}, 400, "made_up_field",
         "not supported by this frontend"),
        ("/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
         400, "chat_template_kwargs", "tokenize are set by the frontend"),
    ],
    ids=lambda value: value if isinstance(value, str) and not value.startswith("/") else None,
)  # fmt: skip
async def test_bad_requests_get_openai_errors(
    frontend, tiny_model, path, body, status, param, says
) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(frontend + path, json={"model": str(tiny_model), **body})
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert error["param"] == param
        assert says in error["message"], error["message"]
        assert error["type"] in ("invalid_request_error", "NotFoundError")
        # Still serving.
        ok = await http.post(
            frontend + "/completions",
            json={"model": str(tiny_model), "prompt": "Hi", "max_tokens": 2},
        )
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


async def test_vllm_extras_are_honoured_not_ignored(frontend, tiny_model) -> None:
    """stop_token_ids ends the answer at that token (finish_reason stop), chat_template_kwargs
    reach the template, OpenAI's bookkeeping fields are accepted."""
    body = {"model": str(tiny_model), "prompt": [1, 300, 301], "max_tokens": 8}
    body["ignore_eos"] = True
    body["logprobs"] = 1
    plain = await post(frontend, "/completions", body)
    tokens = plain["choices"][0]["logprobs"]["tokens"]
    assert plain["choices"][0]["finish_reason"] == "length" and len(tokens) == 8
    # Every id a stop token: the first generated token ends the answer, whatever it is (two
    # greedy runs of this random model need not agree token for token: near-ties, prefix cache).
    vocab = len(ModelTokenizer.load(tiny_model).table)
    stopped = await post(frontend, "/completions", {**body, "stop_token_ids": list(range(vocab))})
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["tokens"]) == 1
    assert stopped["usage"]["completion_tokens"] == 1
    chat = await post(
        frontend,
        "/chat/completions",
        {
            "model": str(tiny_model),
            "messages": CHAT,
            "max_tokens": 2,
            "chat_template_kwargs": {"unused_variable": True},
            "user": "u-1",
            "metadata": {"run": "eval"},
            "store": False,
        },
    )
    assert chat["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize(
    "pieces",
    [
        ["<0xFF>", "a"],  # a byte no later byte completes, then text
        ["<0xE2>", "<0x82>", "a"],  # a character cut short, then text
        ["a", "<0xE2>", "<0x82>", "<0xAC>"],  # a character over three byte tokens
        ["a", "<0xE2>", "<0x82>"],  # the answer ends inside a character
    ],
)
def test_text_decoding_matches_vllms_detokenizer(tiny_model, pieces) -> None:
    """Text from byte-fallback tokens as vLLM's fast incremental detokenizer makes it
    (tokenizers' DecodeStream primed with the prompt, stepped once per token): held back while
    it ends in bytes that are not yet UTF-8, a U+FFFD for each byte once other text follows them,
    dropped at the end."""
    from tokenizers.decoders import DecodeStream

    tokenizer = ModelTokenizer.load(tiny_model)
    fast = tokenizer.tokenizer.backend_tokenizer
    vocab = fast.get_vocab()
    ids = [vocab[p] if p.startswith("<0x") else fast.encode(p, add_special_tokens=False).ids[0]
           for p in pieces]  # fmt: skip
    stream = DecodeStream(ids=[1, 300, 301], skip_special_tokens=True)  # vLLM primes it so
    vllm_text = "".join(stream.step(fast, i) or "" for i in ids)
    decoder = tokenizer.text_decoder()
    ours = "".join(decoder.feed(i) for i in ids) + decoder.finish()
    assert ours == vllm_text, (pieces, ours, vllm_text)


async def test_malformed_json_is_a_400(frontend) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        answer = await http.post(
            frontend + "/completions",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
        )
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"


async def test_no_worker_on_the_subject_is_an_immediate_503(nats_server, tiny_model) -> None:
    """Nothing subscribes to the frontend's subject (no worker up, or a wrong --subject): NATS
    says "no responders" and the frontend answers 503 at once, streamed or not."""
    nc = await nats.connect(nats_server.url)
    settings = FrontendSettings(model_names=(str(tiny_model),), subject="nobody.vllm.generate")
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://frontend") as http:
            for stream in (False, True):
                started = time.monotonic()
                answer = await http.post(
                    "/v1/completions",
                    json={
                        "model": str(tiny_model),
                        "prompt": "Hi",
                        "max_tokens": 4,
                        "stream": stream,
                    },
                )
                assert time.monotonic() - started < 5
                assert answer.status_code == 503, answer.text
                error = answer.json()["error"]
                assert error["type"] == "service_unavailable"
                assert error["code"] == "no_workers"
                assert error["message"] == (
                    "no worker listens on nobody.vllm.generate (NATS: no responders)"
                )
    finally:
        await nc.close()


# --- cancellation end to end --------------------------------------------------------------


async def test_http_client_leaving_mid_stream_frees_the_engine(
    frontend, worker, engine, worker_metrics, tiny_model
) -> None:
    body = {
        "model": str(tiny_model),
        "prompt": "Hello there",
        "max_tokens": 450,
        "stream": True,
        "logprobs": 5,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", frontend + "/completions", json=body) as answer:
            assert answer.status_code == 200
            seen = 0
            async for line in answer.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 5:
                    break
            assert engine.num_unfinished_requests() == 1 and worker.service.in_flight == 1
    # The connection is closed here, mid-stream (450 tokens take seconds on this CPU).
    took = await wait_engine_idle(engine, worker, within=2.0)
    assert took < 2.0
    assert gauge(worker_metrics, "nats_worker_in_flight_requests") == 0


async def test_http_client_leaving_a_non_streamed_request_frees_the_engine(
    frontend, worker, engine, tiny_model
) -> None:
    """No chunk is sent while a non-streamed answer is made: only the disconnect watcher can
    notice the client leave, and it ends the frames' wait (a cancel to the worker)."""
    body = {
        "model": str(tiny_model),
        "prompt": "Hello there",
        "max_tokens": 450,
        "logprobs": 5,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(timeout=60) as http:
        posting = asyncio.create_task(http.post(frontend + "/completions", json=body))
        deadline = time.monotonic() + 30
        while worker.service.in_flight == 0:
            assert time.monotonic() < deadline, "the request never reached the worker"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        assert engine.num_unfinished_requests() == 1
        posting.cancel()  # the HTTP client gives up: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await posting
    took = await wait_engine_idle(engine, worker, within=2.0)
    assert took < 2.0


async def test_openai_client_breaking_out_frees_the_engine(frontend, worker, engine, tiny_model):
    stream = await api(frontend).chat.completions.create(
        model=str(tiny_model),
        messages=CHAT,
        max_tokens=450,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    count = 0
    async for _chunk in stream:
        count += 1
        if count == 4:
            break
    await stream.close()
    await wait_engine_idle(engine, worker, within=2.0)


async def test_killed_frontend_process_frees_the_engine(
    worker, engine, nats_server, tiny_model, worker_metrics
) -> None:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "worker.frontend", "--nats-url", nats_server.url,
            "--model", str(tiny_model), "--subject", TEST_SUBJECTS.generate,
            "--port", str(port), "--log-level", "warning",
        ],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}/v1"
        async with httpx.AsyncClient(timeout=60) as http:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, "frontend exited"
                assert time.monotonic() < deadline, "frontend not ready in 60 s"
                try:
                    if (await http.get(base + "/models")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.2)
            body = {
                "model": str(tiny_model),
                "messages": CHAT,
                "max_tokens": 450,
                "stream": True,
                "ignore_eos": True,
            }
            async with http.stream("POST", base + "/chat/completions", json=body) as answer:
                seen = 0
                async for line in answer.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 5:
                        break
                assert worker.service.in_flight == 1
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=10)
        # No cancel was sent: the worker's liveness probe (every 2 s) finds the inbox gone.
        bound = (
            worker.config.liveness_interval_s + worker.config.liveness_timeout_s + 6.0
        )  # a loaded host
        took = await wait_engine_idle(engine, worker, within=bound)
        assert took < bound
        assert gauge(worker_metrics, "nats_worker_in_flight_requests") == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_frontend_processes_share_one_port_and_stop_as_one(
    worker, nats_server, tiny_model
) -> None:
    """--processes 2: both processes answer on the one port (the kernel spreads connections over
    their SO_REUSEPORT sockets), SIGTERM stops both with exit 0, and a dead process ends the
    whole frontend non-zero."""
    import psutil

    from tests.helpers import collect, read_until

    async def start() -> tuple[asyncio.subprocess.Process, str, list[str]]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker.frontend", "--nats-url", nats_server.url,
            "--model", str(tiny_model), "--subject", TEST_SUBJECTS.generate,
            "--port", "0", "--processes", "2", "--log-level", "info",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        lines: list[str] = []
        found = await read_until(process.stdout, r"frontend: 2 processes on (\S+)", lines, 60)
        # Both listening: until then the kernel gives every connection to the one that is.
        for _ in range(2):
            await read_until(process.stdout, r"Application startup complete", lines, 60)
        return process, found.group(1), lines

    async def complete(base: str, i: int) -> dict[str, Any]:
        # A client of its own per request: a new connection each, as many users would open.
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"model": str(tiny_model), "prompt": [1, 300 + i], "max_tokens": 8}
            body["ignore_eos"] = True
            answer = await http.post(base + "/completions", json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()

    process, base, lines = await start()
    output = asyncio.create_task(collect(process.stdout, lines))
    try:
        answers = await asyncio.gather(*(complete(base, i) for i in range(24)))
        assert [a["choices"][0]["finish_reason"] for a in answers] == ["length"] * 24
        assert all(a["usage"]["completion_tokens"] == 8 for a in answers)
        served = {
            line.split()[2]
            for line in lines
            if "uvicorn.access" in line and "POST /v1/completions" in line
        }
        assert served == {"frontend-0", "frontend-1"}, "".join(lines[-20:])
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 40) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await output

    # A dead process ends the whole frontend, never half of it.
    process, base, lines = await start()
    output = asyncio.create_task(collect(process.stdout, lines))
    try:
        children = psutil.Process(process.pid).children()
        frontends = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
        assert len(frontends) == 2, [c.cmdline() for c in children]
        frontends[0].kill()
        assert await asyncio.wait_for(process.wait(), 40) == 1
        gone, alive = psutil.wait_procs(frontends, timeout=10)
        assert alive == []
        await output
        assert "died with exit code -9" in "".join(lines)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
