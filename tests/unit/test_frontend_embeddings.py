"""`POST /v1/embeddings` over HTTP (httpx's ASGI transport, no server, no NATS): a frontend
without `--model` whose catalog knows an embedding model and a generator (fleet Members set by
hand), and whose `embed` answers from the request instead of a worker. Every form of `input`
is tokenized as vLLM's server does, each vector comes back as floats or base64, and each broken
rule is a 400 naming the field; a generator's name is a 400, an unknown one a 404."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from messages.embeddings import EmbedRequest, pack, unpack
from tests.unit.test_frontend_shapes import BOS, HELLO, TOKENIZER, WORLD
from worker.client import Embeddings
from worker.client.fleet import Member
from worker.frontend.app import FrontendSettings, create_app
from worker.frontend.catalog import ServedModel

EMBED = Member("e1", {}, "llm.vllm.embed", False, "emb", "embed", "/m/emb", 64)
CHAT = Member("g1", {}, "llm.vllm.generate", False, "chat", "generate", "/m/chat", 64)


@pytest.fixture
async def http() -> AsyncIterator[tuple[httpx.AsyncClient, list[EmbedRequest]]]:
    app = create_app(FrontendSettings(), None)
    service = app.state.service
    service.catalog.members = [EMBED, CHAT]
    service.catalog._tokenizers = {"/m/emb": TOKENIZER, "/m/chat": TOKENIZER}
    sent: list[EmbedRequest] = []

    async def embed(model: ServedModel, request: EmbedRequest) -> Embeddings:
        assert model.subject == "llm.vllm.embed"
        sent.append(request)
        vectors = [pack([float(len(tokens)), float(tokens[-1]), 0.5]) for tokens in request.inputs]
        tokens = sum(len(t) for t in request.inputs)
        return Embeddings(request.request_id, vectors, 3, tokens)

    service.embed = embed
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
        yield client, sent


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("Hello world", [[BOS, HELLO, WORLD]]),
        (["Hello", "Hello world"], [[BOS, HELLO], [BOS, HELLO, WORLD]]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
async def test_every_form_of_input_is_one_vector_per_input(
    http: tuple[httpx.AsyncClient, list[EmbedRequest]], given: Any, inputs: list[list[int]]
) -> None:
    client, sent = http
    answer = await client.post("/v1/embeddings", json={"model": "emb", "input": given})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert sent[-1].inputs == inputs
    assert sent[-1].model is None and sent[-1].request_id.startswith("embd-")
    assert body["id"] == sent[-1].request_id
    assert body["object"] == "list" and body["model"] == "emb"
    assert body["data"] == [
        {"index": i, "object": "embedding", "embedding": [float(len(t)), float(t[-1]), 0.5]}
        for i, t in enumerate(inputs)
    ]
    tokens = sum(len(t) for t in inputs)
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


async def test_base64_dimensions_and_vllms_extras_reach_the_wire(
    http: tuple[httpx.AsyncClient, list[EmbedRequest]],
) -> None:
    client, sent = http
    body = {
        "input": "Hello",
        "encoding_format": "base64",
        "dimensions": 3,
        "use_activation": False,
        "add_special_tokens": False,
    }
    answer = await client.post("/v1/embeddings", json=body)  # no model: the first embedder
    assert answer.status_code == 200, answer.text
    (item,) = answer.json()["data"]
    assert unpack(base64.b64decode(item["embedding"])) == [1.0, float(HELLO), 0.5]
    assert (sent[-1].inputs, sent[-1].dimensions, sent[-1].use_activation) == ([[HELLO]], 3, False)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 400, "input"),
        ({"input": [[5], []]}, 400, "input.1"),
        ({"input": "Hi", "dimensions": 0}, 400, "dimensions"),
        ({"input": "Hi", "encoding_format": "bytes"}, 400, "encoding_format"),
        ({"input": "Hi", "truncate_prompt_tokens": 4}, 400, "truncate_prompt_tokens"),
        ({"input": "Hi", "model": "chat"}, 400, "model"),
        ({"input": "Hi", "model": "nope"}, 404, "model"),
    ],
)
async def test_broken_rules_name_the_field_and_nothing_is_sent(
    http: tuple[httpx.AsyncClient, list[EmbedRequest]],
    body: dict[str, Any],
    status: int,
    param: str,
) -> None:
    client, sent = http
    answer = await client.post("/v1/embeddings", json={"model": "emb", **body})
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
    assert sent == []
