"""Embeddings on the real engine: the tiny embedding model (a pooling run of a second tiny causal
LM, `--runner pooling --convert embed`) served by the worker in both intake modes, side by side
with vLLM's own `/v1/embeddings` on the same model and flags: the same vectors within 1e-4,
shortened (`dimensions`, a Matryoshka model) and unnormalized (`use_activation` false) alike."""

from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from bench.vllm_server import VllmOpenAIServer
from messages.embeddings import EmbedRequest, unpack
from messages.subjects import Subjects
from tests.helpers import frame_list
from worker.client import RequestError, embed, jetstream_embed
from worker.config import JetStreamSettings, NatsConfig, WorkerConfig
from worker.nats.runtime import WorkerRuntime, open_worker

TOLERANCE = 1e-4
# Token-id inputs of several lengths (vLLM's server takes them as `input` too).
INPUTS = [[1, 300, 301, 302, 303], [1, 50], [1, 400, 12, 77, 91, 5, 600, 33], [7]]
CORE = Subjects("e2eembed", "vllm", "embed")
QUEUED = Subjects("e2eembedjs", "vllm", "embed")


@pytest.fixture
async def embedding_workers(embedding_engine, nats_server) -> AsyncIterator[list[WorkerRuntime]]:
    """Two workers on the session's embedding engine: the core queue group and a work queue."""
    nats = NatsConfig(servers=[nats_server.url])
    core = await open_worker(embedding_engine, WorkerConfig(nats=nats, subjects=CORE))
    queued = await open_worker(
        embedding_engine,
        WorkerConfig(
            nats=nats,
            subjects=QUEUED,
            max_concurrency=8,
            jetstream=JetStreamSettings(capacity=8),
        ),
    )
    yield [core, queued]
    for runtime in (core, queued):
        await runtime.stop()


async def vllm_embeddings(server: VllmOpenAIServer, **body: Any) -> list[list[float]]:
    async with httpx.AsyncClient(timeout=120) as http:
        answer = await http.post(
            server.base_url + "/embeddings", json={"model": server.models[0], **body}
        )
    assert answer.status_code == 200, answer.text
    data = sorted(answer.json()["data"], key=lambda item: item["index"])
    if body.get("encoding_format") == "base64":
        return [unpack(base64.b64decode(item["embedding"])) for item in data]
    return [item["embedding"] for item in data]


def assert_close(ours: list[list[float]], theirs: list[list[float]]) -> None:
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs, strict=True):
        assert len(mine) == len(other)
        worst = max(abs(a - b) for a, b in zip(mine, other, strict=True))
        assert worst <= TOLERANCE, worst


async def test_the_vectors_equal_vllm_servers(
    embedding_workers, client, vllm_embed_server: VllmOpenAIServer
) -> None:
    ours = await embed(
        client, EmbedRequest(request_id="e2e-1", inputs=INPUTS), subject=CORE.generate
    )
    assert ours.dimensions == 64  # the model's hidden size
    assert ours.prompt_tokens == sum(len(tokens) for tokens in INPUTS)
    vectors = ours.floats()
    assert_close(vectors, await vllm_embeddings(vllm_embed_server, input=INPUTS))
    assert_close(
        vectors,
        await vllm_embeddings(vllm_embed_server, input=INPUTS, encoding_format="base64"),
    )
    for vector in vectors:  # the pooler normalizes by default
        assert math.isclose(math.fsum(x * x for x in vector), 1.0, abs_tol=1e-5)
    # Different inputs, different vectors: the comparison is not of constants.
    assert max(abs(a - b) for a, b in zip(vectors[0], vectors[1], strict=True)) > 0.05

    short = await embed(
        client,
        EmbedRequest(request_id="e2e-2", inputs=INPUTS, dimensions=8),
        subject=CORE.generate,
    )
    assert short.dimensions == 8
    assert_close(
        short.floats(), await vllm_embeddings(vllm_embed_server, input=INPUTS, dimensions=8)
    )

    raw = await embed(
        client,
        EmbedRequest(request_id="e2e-3", inputs=INPUTS[:2], use_activation=False),
        subject=CORE.generate,
    )
    assert_close(
        raw.floats(),
        await vllm_embeddings(vllm_embed_server, input=INPUTS[:2], use_activation=False),
    )
    assert math.fsum(x * x for x in raw.floats()[0]) > 2.0  # not normalized

    # The work queue's worker, on the same engine, answers the same.
    queued = await jetstream_embed(
        client, EmbedRequest(request_id="e2e-4", inputs=INPUTS), subjects=QUEUED
    )
    assert queued.vectors == ours.vectors


async def test_the_engine_refusals_name_the_field(embedding_workers, client) -> None:
    with pytest.raises(RequestError) as refused:
        await embed(
            client,
            EmbedRequest(request_id="e2e-bad", inputs=[[1, 2]], dimensions=100),
            subject=CORE.generate,
        )
    assert refused.value.code == "invalid_request"
    assert refused.value.message.startswith("dimensions: ")
    # A generation request on an embedding worker's subject is refused, naming the field.
    (frame,) = await frame_list(
        client, CORE.generate, b'{"request_id": "g", "token_ids": [1, 2]}', json=True
    )
    assert frame["finish_reason"] == "error"
    assert frame["error"]["code"] == "invalid_request"
    assert "inputs" in frame["error"]["message"]
