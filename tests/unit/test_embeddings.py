"""Embedding requests without a server: the wire structs (messages/embeddings.py), their rules
(worker/validation.py `check_embed`), and the service core serving them on a fake embedder
(worker/embedding_session.py), each answer going to a `MemoryReply`.

A served request ends with one frame: `finish_reason` "stop", the packed vectors in input order
and `usage`; a refusal, a deadline, a drain and an engine failure with one error frame that
decodes as an EmbedResult too; a result larger than max_payload is split by input.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from messages.codec import JSON, MSGPACK
from messages.embeddings import EmbedRequest, EmbedResult, pack, unpack
from messages.subjects import EMBED_ENDPOINT, Subjects
from worker.config import WorkerConfig
from worker.dev.fakes import FakeEmbedder, MemoryReply, fake_embedding_engine
from worker.engine.contract import EngineFailure, EngineLimits, InvalidRequest
from worker.service import Delivery, RequestService
from worker.validation import MAX_EMBED_INPUTS, check_embed

SUBJECT = "unit.vllm.embed"
JSON_HEADERS = {"Content-Type": "application/json"}


def service_on(embedder: FakeEmbedder | None = None, **config: Any) -> RequestService:
    max_payload = config.pop("max_payload", 1 << 20)
    return RequestService(
        fake_embedding_engine(embedder), WorkerConfig(**config), max_payload=max_payload
    )


def delivery(payload: bytes, reply: MemoryReply, *, redelivers: bool = False) -> Delivery:
    headers = JSON_HEADERS if payload[:1] == b"{" else None
    return Delivery(payload, headers, reply, SUBJECT, time.monotonic_ns(), redelivers=redelivers)


async def answer(service: RequestService, payload: bytes) -> list[dict[str, Any]]:
    """The frames of one request, as maps by their wire names."""
    reply = MemoryReply()
    task = await service.accept(delivery(payload, reply))
    if isinstance(task, asyncio.Task):
        await task
    decode = msgspec.json.decode if payload[:1] == b"{" else msgspec.msgpack.decode
    return [decode(data) for data in reply.published]


def test_pack_is_little_endian_float32() -> None:
    assert pack([1.0, -2.5]) == b"\x00\x00\x80\x3f\x00\x00\x20\xc0"
    assert unpack(pack([0.25, 3.0, -1.0])) == [0.25, 3.0, -1.0]
    with pytest.raises(ValueError, match="divisible by 4"):
        unpack(b"\x00\x00\x00")


def test_embed_endpoint_is_its_own_subject() -> None:
    subjects = Subjects(endpoint=EMBED_ENDPOINT)
    assert subjects.generate == "llm.vllm.embed"
    assert subjects.queue == "llm.vllm.queue.embed"
    assert subjects.cancel == "llm.vllm.embed.cancel"


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b'{"request_id": "r", "inputs": []}', "$.inputs"),
        (b'{"request_id": "r", "inputs": [[1], []]}', "$.inputs[1]"),
        (b'{"request_id": "r", "inputs": [[1, -3]]}', "$.inputs[0][1]"),
        (b'{"request_id": "r", "inputs": [[1]], "dimensions": 0}', "$.dimensions"),
        (b'{"request_id": "r", "inputs": [[1]], "use_activation": 1}', "$.use_activation"),
        (b'{"request_id": "", "inputs": [[1]]}', "$.request_id"),
        (b'{"request_id": "r"}', "inputs"),
    ],
)
def test_decode_errors_name_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(
        msgspec.ValidationError, match=field.replace("[", r"\[").replace("$", r"\$")
    ):
        JSON.decode_as(payload, EmbedRequest)


def limits(**overrides: Any) -> EngineLimits:
    settings: dict[str, Any] = dict(
        model="m", max_logprobs=0, vocab_size=100, max_model_len=8, kind="embed"
    )
    settings.update(overrides)
    return EngineLimits(**settings)


@pytest.mark.parametrize(
    ("request_", "limit", "field", "rule"),
    [
        (EmbedRequest(request_id="r", inputs=[[1], [2, 100]]), limits(), "inputs[1][1]", "< 100"),
        (EmbedRequest(request_id="r", inputs=[[1] * 9]), limits(), "inputs[0]", "max_model_len 8"),
        (
            EmbedRequest(request_id="r", inputs=[[1]], dimensions=4),
            limits(),
            "dimensions",
            "does not support Matryoshka",
        ),
        (
            EmbedRequest(request_id="r", inputs=[[1]] * (MAX_EMBED_INPUTS + 1)),
            limits(),
            "inputs",
            f"at most {MAX_EMBED_INPUTS}",
        ),
        (EmbedRequest(request_id="r", inputs=[[1]]), limits(kind="generate"), "request", "embed"),
    ],
)
def test_engine_rules_name_the_field(
    request_: EmbedRequest, limit: EngineLimits, field: str, rule: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_embed(request_, limit)
    assert refused.value.field == field
    assert rule in refused.value.rule
    check_embed(
        EmbedRequest(request_id="r", inputs=[[1, 99]], dimensions=4), limits(matryoshka=True)
    )


async def test_a_served_request_is_one_frame_with_vectors_in_input_order() -> None:
    embedder = FakeEmbedder(dimensions=4)
    request = EmbedRequest(request_id="e1", inputs=[[5, 6, 7], [8], [9, 10]])
    for codec in (MSGPACK, JSON):
        (frame,) = await answer(service_on(embedder), codec.encode(request))
        assert frame["request_id"] == "e1"
        assert frame["seq"] == 0
        assert frame["index"] == 0
        assert frame["finish_reason"] == "stop"
        assert frame["dimensions"] == 4
        assert frame["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
        assert "error" not in frame
        vectors = [codec.decode_as(codec.encode(frame), EmbedResult).embeddings]
        floats = [unpack(v) for v in vectors[0]]
        assert floats == [[3.0, 5.0, 7.0, 0.0], [1.0, 8.0, 8.0, 0.0], [2.0, 9.0, 10.0, 0.0]]
    assert embedder.embedded == 6


async def test_dimensions_shorten_the_vectors() -> None:
    request = EmbedRequest(request_id="e2", inputs=[[5, 6]], dimensions=2)
    (frame,) = await answer(service_on(), MSGPACK.encode(request))
    assert frame["dimensions"] == 2
    assert unpack(frame["embeddings"][0]) == [2.0, 5.0]


async def test_refusals_are_one_error_frame_that_decodes_as_a_result() -> None:
    service = service_on()
    cases = [
        (b'{"request_id": "bad", "inputs": [[1], []]}', "invalid_request", "$.inputs[1]"),
        (b'{"request_id": "gen", "token_ids": [1, 2]}', "invalid_request", "inputs"),
        (b'{"request_id": "v", "inputs": [[1, 5000]]}', "invalid_request", "inputs[0][1]"),
        (b"\xc1 not msgpack", "invalid_request", "invalid payload"),
    ]
    for payload, code, named in cases:
        (frame,) = await answer(service, payload)
        assert frame["finish_reason"] == "error"
        assert frame["error"]["code"] == code
        assert named in frame["error"]["message"]
        codec = JSON if payload[:1] == b"{" else MSGPACK
        result = codec.decode_as(codec.encode(frame), EmbedResult)
        assert result.error and result.error.code == code
        assert result.embeddings == []


async def test_a_big_result_is_split_by_input_below_max_payload() -> None:
    service = service_on(FakeEmbedder(dimensions=64), max_payload=700)
    request = EmbedRequest(request_id="big", inputs=[[i + 1] for i in range(10)])
    reply = MemoryReply()
    task = await service.accept(delivery(MSGPACK.encode(request), reply))
    assert isinstance(task, asyncio.Task)
    await task
    assert len(reply.published) > 1
    assert all(len(data) <= 700 for data in reply.published)
    results = [MSGPACK.decode_as(data, EmbedResult) for data in reply.published]
    assert [r.seq for r in results] == list(range(len(results)))
    assert [r.finish_reason for r in results] == [None] * (len(results) - 1) + ["stop"]
    position = 0
    for result in results:
        assert result.index == position
        position += len(result.embeddings)
    assert position == 10
    assert results[-1].usage and results[-1].usage.prompt_tokens == 10
    firsts = [unpack(v)[1] for r in results for v in r.embeddings]
    assert firsts == [float(i + 1) for i in range(10)]


async def test_deadline_drain_and_engine_failure_end_with_their_error_frame() -> None:
    slow = FakeEmbedder(delay_s=5.0)
    service = service_on(slow)
    request = EmbedRequest(request_id="late", inputs=[[1]], timeout_ms=50)
    (frame,) = await answer(service, MSGPACK.encode(request))
    assert frame["error"] == {"code": "deadline_exceeded", "message": "timeout_ms 50 passed"}
    assert frame["finish_reason"] == "error"

    reply = MemoryReply()
    task = await service.accept(
        delivery(MSGPACK.encode(EmbedRequest(request_id="d", inputs=[[1]])), reply)
    )
    assert isinstance(task, asyncio.Task)
    await asyncio.sleep(0.05)
    await service.drain(timeout_s=0)
    (drained,) = [msgspec.msgpack.decode(data) for data in reply.published]
    assert drained["error"]["code"] == "worker_shutdown"
    assert drained["request_id"] == "d"

    class Failing(FakeEmbedder):
        async def embed(self, request: EmbedRequest, engine_request_id: str) -> list[bytes]:
            raise EngineFailure("the pooler failed")

    failing = service_on(Failing())
    (failed,) = await answer(failing, MSGPACK.encode(EmbedRequest(request_id="f", inputs=[[1]])))
    assert failed["error"] == {"code": "engine_error", "message": "the pooler failed"}
    # On a work queue with attempts left, a retryable failure sends nothing: it is redelivered.
    reply = MemoryReply()
    task = await failing.accept(
        delivery(
            MSGPACK.encode(EmbedRequest(request_id="f2", inputs=[[1]])), reply, redelivers=True
        )
    )
    assert isinstance(task, asyncio.Task)
    outcome = await task
    assert outcome.requeue and reply.published == []
