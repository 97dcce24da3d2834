"""The service core (worker/service.py) without a server: `RequestService` on the fake engines of
worker/dev/fakes.py, each request's frames going to a `MemoryReply`.

Decode errors, each validation rule and admission (drain, max_concurrency, redelivery) end in one
error frame naming the field or the reason; a served request's frames count seq 0..k, carry its
tokens and aligned logprob rows, and end with finish_reason and usage; cancel, a client gone, a
deadline, a drain and a dead engine each end a running request as the wire contract says; big
frames are split to max_payload; the answer's encoding follows the request's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from messages.codec import JSON, MSGPACK, Codec, codec_for
from messages.frames import ResponseFrame, TopLogprob
from messages.request import GenerateRequest
from worker.client.requests import make_request
from worker.config import WorkerConfig
from worker.dev.fakes import (
    AlwaysFailingFakeEngine,
    MemoryReply,
    PacedFakeEngine,
    ScriptedFakeEngine,
)
from worker.engine.contract import ChoiceDelta, Engine, EngineDead, EngineStep
from worker.metrics import WorkerMetrics
from worker.service import Delivery, RequestService
from worker.session import Outcome

SUBJECT = "unit.vllm.generate"
PROMPT = [1, 300, 301, 302]
JSON_HEADERS = {"Content-Type": "application/json"}


def service_on(
    engine: Engine | None = None,
    *,
    max_payload: int = 1 << 20,
    metrics: WorkerMetrics | None = None,
    **config: Any,
) -> RequestService:
    return RequestService(
        engine or PacedFakeEngine(step_s=0.0),
        WorkerConfig(**config),
        metrics,
        max_payload=max_payload,
    )


def delivery(
    payload: bytes | GenerateRequest,
    *,
    reply: MemoryReply | None = None,
    json: bool = False,
    headers: dict[str, str] | None = None,
    redelivers: bool = False,
    attempt: int | None = None,
) -> Delivery:
    if isinstance(payload, GenerateRequest):
        payload = (JSON if json else MSGPACK).encode(payload)
    if headers is None and json:
        headers = JSON_HEADERS
    return Delivery(
        payload,
        headers,
        reply or MemoryReply(),
        SUBJECT,
        time.monotonic_ns(),
        attempt=attempt,
        redelivers=redelivers,
    )


def wire(reply: MemoryReply, *, json: bool = False) -> list[dict[str, Any]]:
    """The published frames as maps, by their wire names."""
    decode = msgspec.json.decode if json else msgspec.msgpack.decode
    return [decode(data) for data in reply.published]


def frames(reply: MemoryReply, codec: Codec = MSGPACK) -> list[ResponseFrame]:
    return [codec.decode_frame(data) for data in reply.published]


async def served(service: RequestService, arrival: Delivery) -> Outcome:
    """Accepts a request that must be admitted and waits for its end."""
    running = await service.accept(arrival)
    assert isinstance(running, asyncio.Task), running
    return await asyncio.wait_for(running, 10)


async def refused(service: RequestService, arrival: Delivery) -> dict[str, Any]:
    """Accepts a request that must be refused; its one frame (seq 0) as a map."""
    code = await service.accept(arrival)
    assert isinstance(code, str), code
    reply = arrival.reply
    assert isinstance(reply, MemoryReply)
    json = codec_for(arrival.headers, arrival.data) is JSON  # as the request came
    (frame,) = wire(reply, json=json)
    assert frame["seq"] == 0 and frame["index"] == 0
    assert frame["finish_reason"] == "error"
    assert frame["error"]["code"] == code
    assert frame["token_ids"] == []
    return frame


def scripted(*deltas: ChoiceDelta, **options: Any) -> ScriptedFakeEngine:
    return ScriptedFakeEngine([EngineStep(None, [delta]) for delta in deltas], **options)


# --- decoding: every unreadable payload is one invalid_request frame ------------------------


def _bad(**fields: Any) -> dict[str, Any]:
    return {"request_id": "bad", "token_ids": [1, 2, 3]} | fields


UNREADABLE = [
    ("garbage-msgpack", b"\xc1\xff\x00garbage", None, "invalid payload", "malformed"),
    ("garbage-json", b"{not json", JSON_HEADERS, "invalid payload", "JSON is malformed"),
    ("not-a-map", msgspec.msgpack.encode([1, 2, 3]), None, "invalid payload", "Expected `object`"),
    (
        "token-ids-a-string",
        msgspec.msgpack.encode(_bad(token_ids="abc")),
        None,
        "$.token_ids",
        "Expected `array`",
    ),
    (
        "empty-token-ids",
        msgspec.msgpack.encode(_bad(token_ids=[])),
        None,
        "$.token_ids",
        "length >= 1",
    ),
    (
        "negative-token-id",
        msgspec.msgpack.encode(_bad(token_ids=[1, -2])),
        None,
        "$.token_ids[1]",
        ">= 0",
    ),
    (
        "logprobs-a-string",
        msgspec.msgpack.encode(_bad(output_options={"logprobs": "abc"})),
        None,
        "$.output_options.logprobs",
        "Expected `int | null`, got `str`",
    ),
    (
        "temperature-a-string-in-json",
        msgspec.json.encode(_bad(sampling_options={"temperature": "hot"})),
        JSON_HEADERS,
        "$.sampling_options.temperature",
        "Expected `float | null`, got `str`",
    ),
    (
        "max-tokens-zero",
        msgspec.msgpack.encode(_bad(stop_conditions={"max_tokens": 0})),
        None,
        "$.stop_conditions.max_tokens",
        ">= 1",
    ),
    (
        "a-bool-is-not-an-int",
        msgspec.msgpack.encode(_bad(sampling_options={"n": True})),
        None,
        "$.sampling_options.n",
        "Expected `int`, got `bool`",
    ),
    (
        "missing-request-id",
        msgspec.msgpack.encode({"token_ids": [1]}),
        None,
        "invalid payload",
        "missing required field `request_id`",
    ),
    (
        "nested-too-deep",
        b'{"request_id": "bad", "token_ids": [1], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        None,
        "invalid payload",
        "nested too deeply to decode",
    ),
]


@pytest.mark.parametrize(
    ("payload", "headers", "field", "rule"),
    [case[1:] for case in UNREADABLE],
    ids=[case[0] for case in UNREADABLE],
)
async def test_an_unreadable_payload_is_one_invalid_request_frame_naming_the_field(
    payload: bytes, headers: dict[str, str] | None, field: str, rule: str
) -> None:
    engine = ScriptedFakeEngine()
    service = service_on(engine)
    frame = await refused(service, delivery(payload, headers=headers))
    assert frame["error"]["code"] == "invalid_request"
    message = frame["error"]["message"]
    assert field in message and rule in message, message
    assert engine.requests == [] and service.in_flight == 0


async def test_a_refused_request_keeps_its_readable_request_id() -> None:
    service = service_on()
    frame = await refused(service, delivery(msgspec.msgpack.encode(_bad(token_ids=[]))))
    assert frame["request_id"] == "bad"
    unreadable = await refused(service, delivery(b"\xc1\xff"))
    assert unreadable["request_id"] == ""
    long_id = msgspec.msgpack.encode({"request_id": "x" * 300, "token_ids": []})
    assert (await refused(service, delivery(long_id)))["request_id"] == "x" * 256


async def test_a_payload_over_max_request_bytes_is_refused_before_decoding() -> None:
    service = service_on(max_request_bytes=64)
    payload = MSGPACK.encode(make_request("big", [300] * 40))
    frame = await refused(service, delivery(payload))
    assert frame["error"]["code"] == "invalid_request"
    assert frame["error"]["message"] == (
        f"payload: {len(payload)} bytes exceeds max_request_bytes 64"
    )
    assert frame["request_id"] == "big"


async def test_an_error_for_a_json_request_is_json() -> None:
    service = service_on()
    reply = MemoryReply()
    await service.accept(delivery(b'{"request_id": "j"}', reply=reply, headers=JSON_HEADERS))
    (frame,) = wire(reply, json=True)
    assert frame["request_id"] == "j" and frame["error"]["code"] == "invalid_request"
    assert "missing required field `token_ids`" in frame["error"]["message"]
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(reply.published[0])


async def test_a_json_body_without_content_type_is_answered_in_json() -> None:
    """`nats req SUBJECT '{...}'` without a header: the body's first byte says JSON."""
    service = service_on()
    reply = MemoryReply()
    body = b' {"request_id": "raw", "token_ids": [5, 6], "stop_conditions": {"max_tokens": 2}}'
    await served(service, delivery(body, reply=reply, headers={}))
    maps = wire(reply, json=True)
    assert [m["seq"] for m in maps] == [0, 1]
    assert maps[-1]["finish_reason"] == "length"


async def test_a_msgpack_content_type_wins_over_a_json_looking_body() -> None:
    service = service_on()
    reply = MemoryReply()
    await service.accept(
        delivery(
            b'{"request_id": "x"}', reply=reply, headers={"Content-Type": "application/msgpack"}
        )
    )
    (frame,) = wire(reply)  # msgpack: the body was read as msgpack and refused
    assert frame["error"]["code"] == "invalid_request"
    assert "invalid payload" in frame["error"]["message"]


# --- engine-dependent rules through the service ------------------------------------------


RULES = [
    ({"sampling_options": {"n": 3}}, "sampling_options.n: must be <= 2, got 3"),
    ({"output_options": {"logprobs": 21}}, "output_options.logprobs: must be <= 20"),
    ({"output_options": {"prompt_logprobs": 99}}, "output_options.prompt_logprobs: must be <= 20"),
    ({"stop_conditions": {"max_tokens": 9}}, "the worker's max_tokens limit), got 9"),
    ({"token_ids": [1, 5000]}, "token_ids[1]: token id 5000 is outside the vocabulary"),
    (
        {"sampling_options": {"logit_bias": {3: 1.0, 5000: 2.0}}},
        "sampling_options.logit_bias: token id 5000 is outside the vocabulary (must be < 1024)",
    ),
    ({"stop_conditions": {"stop_token_ids": [99999]}}, "stop_conditions.stop_token_ids[0]"),
    ({"eos_token_ids": [1024]}, "eos_token_ids[0]: token id 1024 is outside"),
    ({"token_ids": [5] * 600}, "token_ids: prompt of 600 tokens leaves no room to generate"),
    ({"sampling_options": {"use_beam_search": True}}, "sampling_options.use_beam_search"),
    (
        {"stop_conditions": {"max_tokens": 4, "min_tokens": 5}},
        "stop_conditions.min_tokens: must be <= max_tokens (4), got 5",
    ),
]


@pytest.mark.parametrize(
    ("fields", "message"),
    RULES,
    ids=[
        "n-above-the-operators-max_n",
        "logprobs-above-max_logprobs",
        "prompt-logprobs-above-max_logprobs",
        "max-tokens-above-the-operators-cap",
        "token-out-of-vocab",
        "logit-bias-out-of-vocab",
        "stop-token-out-of-vocab",
        "eos-token-out-of-vocab",
        "prompt-fills-the-context",
        "beam-search",
        "min-tokens-above-max-tokens",
    ],
)
async def test_each_rule_is_an_invalid_request_frame_and_costs_no_engine_time(
    fields: dict[str, Any], message: str
) -> None:
    engine = ScriptedFakeEngine()  # vocabulary 1024, context 512, max_logprobs 20
    service = service_on(engine, max_n=2, max_tokens_limit=8)
    payload = msgspec.msgpack.encode({"request_id": "rule", "token_ids": [1, 2, 3]} | fields)
    frame = await refused(service, delivery(payload))
    assert frame["error"]["code"] == "invalid_request"
    assert message in frame["error"]["message"], frame["error"]["message"]
    assert frame["request_id"] == "rule"
    assert engine.requests == []
    stats = service.stats[SUBJECT]
    assert (stats.num_requests, stats.num_errors) == (1, 1)
    assert stats.last_error.startswith("invalid_request: ")


async def test_an_invalid_request_is_answered_even_when_the_intake_would_redeliver() -> None:
    """Redelivery is for retryable refusals: a request that breaks a rule breaks it again."""
    service = service_on()
    arrival = delivery(make_request("r", [1, 5000]), redelivers=True)
    frame = await refused(service, arrival)
    assert frame["error"]["code"] == "invalid_request"


async def test_the_operators_cap_fills_in_a_missing_max_tokens() -> None:
    engine = PacedFakeEngine(step_s=0.0)
    service = service_on(engine, max_tokens_limit=5)
    request = make_request("capped", PROMPT)
    request.stop_conditions.max_tokens = None
    reply = MemoryReply()
    outcome = await served(service, delivery(request, reply=reply))
    assert outcome.completion_tokens == 5
    assert wire(reply)[-1]["completion_usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 5,
        "total_tokens": 9,
    }


# --- admission --------------------------------------------------------------------------


async def test_at_max_concurrency_a_request_is_overloaded_at_once() -> None:
    engine = PacedFakeEngine(step_s=0.005)
    service = service_on(engine, max_concurrency=2)
    replies = [MemoryReply(f"_INBOX.c.{i}") for i in range(3)]
    running = [
        await service.accept(delivery(make_request(f"ovl-{i}", PROMPT, max_tokens=20), reply=r))
        for i, r in enumerate(replies[:2])
    ]
    assert all(isinstance(task, asyncio.Task) for task in running)
    frame = await refused(service, delivery(make_request("ovl-2", PROMPT), reply=replies[2]))
    assert frame["error"]["code"] == "overloaded"
    assert frame["request_id"] == "ovl-2"
    assert "max_concurrency 2" in frame["error"]["message"]
    outcomes = await asyncio.gather(*running)  # type: ignore[arg-type]
    assert [o.finish_reasons for o in outcomes] == [["length"], ["length"]]
    assert service.peak_in_flight == 2
    # Capacity is back once they ended.
    assert (await served(service, delivery(make_request("again", PROMPT)))).label == "length"


async def test_a_retryable_refusal_is_left_to_an_intake_that_redelivers() -> None:
    engine = PacedFakeEngine(step_s=0.005)
    service = service_on(engine, max_concurrency=1)
    first = await service.accept(delivery(make_request("a", PROMPT, max_tokens=10)))
    assert isinstance(first, asyncio.Task)
    reply = MemoryReply()
    code = await service.accept(delivery(make_request("b", PROMPT), reply=reply, redelivers=True))
    assert code == "overloaded"
    assert reply.published == [] and reply.on_gone is None
    await first
    await service.drain(timeout_s=0)
    code = await service.accept(delivery(make_request("c", PROMPT), reply=reply, redelivers=True))
    assert code == "worker_shutdown" and reply.published == []


async def test_a_draining_service_refuses_with_worker_shutdown() -> None:
    service = service_on()
    await service.drain(timeout_s=0)
    assert service.draining
    frame = await refused(service, delivery(make_request("late", PROMPT)))
    assert frame["error"]["code"] == "worker_shutdown"
    assert frame["request_id"] == "late"
    assert "worker is shutting down" in frame["error"]["message"]


async def test_wait_for_capacity_returns_once_a_request_ended() -> None:
    service = service_on(PacedFakeEngine(step_s=0.005))
    task = await service.accept(delivery(make_request("cap", PROMPT, max_tokens=5)))
    assert isinstance(task, asyncio.Task)
    await asyncio.wait_for(service.wait_for_capacity(1), 5)
    assert task.done() and service.in_flight == 0


async def test_refusals_and_outcomes_are_counted_in_metrics() -> None:
    engine = PacedFakeEngine(step_s=0.0)
    metrics = WorkerMetrics(engine.limits.model, CollectorRegistry())
    service = service_on(engine, metrics=metrics)
    await service.accept(delivery(b"\xc1"))
    await served(service, delivery(make_request("m", PROMPT, max_tokens=3, n=2)))
    sample = metrics.registry.get_sample_value
    labels = {"model_name": "paced-fake"}
    assert sample("nats_worker_errors_total", labels | {"code": "invalid_request"}) == 1
    assert sample("nats_worker_requests_total", labels | {"outcome": "invalid_request"}) == 1
    assert sample("nats_worker_requests_total", labels | {"outcome": "length"}) == 2
    assert sample("nats_worker_generated_tokens_total", labels) == 6
    assert sample("nats_worker_in_flight_requests", labels) == 0


# --- a served request's frames ----------------------------------------------------------


async def test_frames_count_seq_from_zero_and_the_last_carries_finish_and_usage() -> None:
    service = service_on()
    reply = MemoryReply()
    outcome = await served(service, delivery(make_request("ok", PROMPT, max_tokens=6), reply=reply))
    maps = wire(reply)
    assert [m["seq"] for m in maps] == list(range(6))
    assert all(m["request_id"] == "ok" and m["index"] == 0 for m in maps)
    assert [m["finish_reason"] for m in maps] == [None] * 5 + ["length"]
    # The paced fake engine's tokens follow the context position: a 4-token prompt, then 104…
    assert len(PROMPT) == 4
    assert sum((m["token_ids"] for m in maps), []) == [104, 105, 106, 107, 108, 109]
    assert ["completion_usage" in m for m in maps] == [False] * 5 + [True]
    assert maps[-1]["completion_usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 6,
        "total_tokens": 10,
    }
    # Nothing that was not asked for is on the wire.
    for absent in ("log_probs", "top_logprobs", "prompt_log_probs", "error", "attempt"):
        assert all(absent not in m for m in maps), absent
    assert (outcome.finish_reasons, outcome.completion_tokens, outcome.error_code) == (
        ["length"],
        6,
        None,
    )
    assert service.served == 1 and service.in_flight == 0


@pytest.mark.parametrize("k", [0, 1, 5])
async def test_logprob_rows_align_with_the_tokens_of_every_frame(k: int) -> None:
    service = service_on()
    reply = MemoryReply()
    await served(
        service, delivery(make_request("lp", PROMPT, max_tokens=4, logprobs=k), reply=reply)
    )
    for frame in frames(reply):
        assert isinstance(frame.log_probs, list) and isinstance(frame.top_logprobs, list)
        assert len(frame.token_ids) == len(frame.log_probs) == len(frame.top_logprobs) == 1
        (row,) = frame.top_logprobs
        # The sampled token first (the fake engine samples the top one), then the rest of top k.
        assert row[0].token_id == frame.token_ids[0] and row[0].logprob == frame.log_probs[0]
        assert [entry.rank for entry in row] == list(range(1, max(k, 1) + 1))


async def test_each_of_n_choices_ends_with_its_own_final_frame() -> None:
    service = service_on()
    reply = MemoryReply()
    outcome = await served(
        service, delivery(make_request("n3", PROMPT, max_tokens=3, n=3), reply=reply)
    )
    maps = wire(reply)
    assert [m["seq"] for m in maps] == list(range(9))  # one count over all the choices
    for index in range(3):
        mine = [m for m in maps if m["index"] == index]
        assert [m["finish_reason"] for m in mine] == [None, None, "length"]
        assert mine[-1]["completion_usage"]["completion_tokens"] == 3
    assert outcome.finish_reasons == ["length"] * 3 and outcome.completion_tokens == 9
    assert outcome.label == "length,length,length"


async def test_a_json_request_is_served_in_json() -> None:
    service = service_on()
    reply = MemoryReply()
    request = make_request("js", PROMPT, max_tokens=3, logprobs=2)
    await served(service, delivery(request, reply=reply, json=True))
    decoded = frames(reply, JSON)
    assert [f.seq for f in decoded] == [0, 1, 2]
    assert decoded[-1].finish_reason == "length"
    assert decoded[0].top_logprobs != [] and decoded[0].top_logprobs[0][0].bytes == b"t"
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(reply.published[0])


async def test_the_delivery_attempt_is_on_every_frame() -> None:
    service = service_on()
    reply = MemoryReply()
    await served(
        service, delivery(make_request("att", PROMPT, max_tokens=3), reply=reply, attempt=2)
    )
    assert [m["attempt"] for m in wire(reply)] == [2, 2, 2]


async def test_every_request_gets_its_own_engine_request_id() -> None:
    engine = scripted(ChoiceDelta(0, [7], None, None, "length"))
    service = service_on(engine)
    for _ in range(2):
        await served(service, delivery(make_request("same", PROMPT)))
    ids = [engine_request_id for _, engine_request_id in engine.requests]
    assert len(set(ids)) == 2 and all(i.startswith("same-") for i in ids)


async def test_the_reply_is_watched_while_the_request_runs_and_released_after() -> None:
    service = service_on(PacedFakeEngine(step_s=0.005))
    reply = MemoryReply()
    task = await service.accept(delivery(make_request("w", PROMPT, max_tokens=5), reply=reply))
    assert isinstance(task, asyncio.Task)
    assert reply.on_gone is not None and not reply.released
    await task
    assert reply.released
    reply.go_away()  # too late: nothing more happens
    assert [m["finish_reason"] for m in wire(reply)][-1] == "length"


async def test_stats_count_requests_errors_and_time_per_subject() -> None:
    engine = PacedFakeEngine(step_s=0.0)
    service = service_on(engine)
    await served(service, delivery(make_request("s1", PROMPT, max_tokens=2)))
    await service.accept(delivery(b"\xc1"))
    stats = service.stats[SUBJECT]
    assert (stats.num_requests, stats.num_errors) == (2, 1)
    assert stats.processing_time_ns > 0
    assert service.stats_data() == {"in_flight": 0, "served": 1, "engine_unfinished_requests": 0}


# --- ending a running request ------------------------------------------------------------


async def test_cancel_touches_only_the_request_of_that_reply_subject() -> None:
    engine = PacedFakeEngine(step_s=0.01)
    service = service_on(engine)
    mine, theirs = MemoryReply("_INBOX.mine.1"), MemoryReply("_INBOX.theirs.1")
    request = make_request("dup", PROMPT, max_tokens=30)
    cancelled = await service.accept(delivery(request, reply=mine))
    other = await service.accept(delivery(request, reply=theirs))
    assert isinstance(cancelled, asyncio.Task) and isinstance(other, asyncio.Task)
    await mine.wait_for_frames(2)
    assert service.cancel("dup", "_INBOX.elsewhere") == 0
    assert service.cancel("other-id", "_INBOX.mine.1") == 0
    assert service.cancel("dup", "_INBOX.mine.1") == 1
    outcome = await cancelled
    assert outcome.finish_reasons == ["cancelled"]
    final = wire(mine)[-1]
    assert final["finish_reason"] == "cancelled" and "error" not in final  # a client's cancel
    sent = sum(len(m["token_ids"]) for m in wire(mine))
    assert final["completion_usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": sent,
        "total_tokens": 4 + sent,
    }
    assert [m["seq"] for m in wire(mine)] == list(range(len(mine.published)))
    assert (await other).finish_reasons == ["length"]
    assert sum(len(m["token_ids"]) for m in wire(theirs)) == 30
    assert engine.running == 0


async def test_a_cancel_ends_every_open_choice() -> None:
    service = service_on(PacedFakeEngine(step_s=0.01))
    reply = MemoryReply()
    task = await service.accept(
        delivery(make_request("nc", PROMPT, max_tokens=50, n=2), reply=reply)
    )
    assert isinstance(task, asyncio.Task)
    await reply.wait_for_frames(2)
    assert service.cancel("nc", reply.subject) == 1
    await task
    finals = [m for m in wire(reply) if m["finish_reason"] is not None]
    assert sorted((m["index"], m["finish_reason"]) for m in finals) == [
        (0, "cancelled"),
        (1, "cancelled"),
    ]


async def test_a_client_gone_aborts_its_request_with_client_gone() -> None:
    engine = PacedFakeEngine(step_s=0.01)
    service = service_on(engine)
    reply = MemoryReply()
    task = await service.accept(delivery(make_request("gone", PROMPT, max_tokens=500), reply=reply))
    assert isinstance(task, asyncio.Task)
    await reply.wait_for_frames(1)
    reply.go_away()
    outcome = await asyncio.wait_for(task, 5)
    final = wire(reply)[-1]
    assert final["finish_reason"] == "cancelled"
    assert final["error"] == {
        "code": "client_gone",
        "message": "nobody listens on the reply subject",
    }
    assert outcome.completion_tokens < 500
    assert engine.running == 0 and service.in_flight == 0


async def test_the_deadline_cancels_with_deadline_exceeded() -> None:
    engine = PacedFakeEngine(step_s=0.01)
    service = service_on(engine)
    reply = MemoryReply()
    request = make_request("late", PROMPT, max_tokens=1000)
    request.timeout_ms = 100
    started = time.monotonic()
    outcome = await served(service, delivery(request, reply=reply))
    assert time.monotonic() - started < 5
    final = wire(reply)[-1]
    assert final["finish_reason"] == "cancelled"
    assert final["error"] == {"code": "deadline_exceeded", "message": "timeout_ms 100 passed"}
    assert 0 < outcome.completion_tokens < 1000
    assert engine.running == 0


async def test_a_deadline_of_a_finished_request_does_nothing() -> None:
    service = service_on(PacedFakeEngine(step_s=0.0))
    reply = MemoryReply()
    request = make_request("quick", PROMPT, max_tokens=3)
    request.timeout_ms = 50
    await served(service, delivery(request, reply=reply))
    await asyncio.sleep(0.1)
    assert [m["finish_reason"] for m in wire(reply)] == [None, None, "length"]


async def test_drain_lets_requests_finish_in_time_and_ends_the_rest_with_worker_shutdown() -> None:
    engine = PacedFakeEngine(step_s=0.01)
    service = service_on(engine)
    short_reply, long_reply = MemoryReply("_INBOX.s.1"), MemoryReply("_INBOX.l.1")
    short = await service.accept(
        delivery(make_request("short", PROMPT, max_tokens=5), reply=short_reply)
    )
    long = await service.accept(
        delivery(make_request("long", PROMPT, max_tokens=1000, n=2), reply=long_reply)
    )
    assert isinstance(short, asyncio.Task) and isinstance(long, asyncio.Task)
    await long_reply.wait_for_frames(1)
    await asyncio.wait_for(service.drain(timeout_s=0.3), 10)
    assert short.result().finish_reasons == ["length"]
    long_frames = wire(long_reply)
    errors = [m for m in long_frames if m["finish_reason"] == "error"]
    assert errors == [long_frames[-1]]  # one error frame ends the request, for every choice
    assert errors[0]["error"]["code"] == "worker_shutdown"
    assert long.result().error_code == "worker_shutdown"
    assert [m["seq"] for m in long_frames] == list(range(len(long_frames)))
    assert service.in_flight == 0 and engine.running == 0


async def test_drain_without_time_ends_every_request_at_once() -> None:
    engine = PacedFakeEngine(step_s=0.01)
    service = service_on(engine)
    reply = MemoryReply()
    task = await service.accept(delivery(make_request("d0", PROMPT, max_tokens=1000), reply=reply))
    assert isinstance(task, asyncio.Task)
    await reply.wait_for_frames(1)
    started = time.monotonic()
    await service.drain(timeout_s=0)
    assert time.monotonic() - started < 1
    assert wire(reply)[-1]["error"]["code"] == "worker_shutdown"


async def test_a_drain_with_nothing_in_flight_returns_at_once() -> None:
    service = service_on()
    started = time.monotonic()
    await service.drain(timeout_s=30)
    assert time.monotonic() - started < 1 and service.draining


# --- engine failures ---------------------------------------------------------------------


async def test_an_engine_failure_is_an_engine_error_frame() -> None:
    engine = AlwaysFailingFakeEngine()
    service = service_on(engine)
    reply = MemoryReply()
    outcome = await served(service, delivery(make_request("f", PROMPT), reply=reply))
    (frame,) = wire(reply)
    assert frame["finish_reason"] == "error" and frame["seq"] == 0
    assert frame["error"] == {
        "code": "engine_error",
        "message": "fake engine: this request always fails",
    }
    assert outcome.error_code == "engine_error" and not outcome.requeue
    assert service.stats[SUBJECT].last_error == (
        "engine_error: fake engine: this request always fails"
    )
    assert not service.engine_dead.is_set()


async def test_a_retryable_failure_with_attempts_left_sends_nothing_and_requeues() -> None:
    service = service_on(AlwaysFailingFakeEngine())
    reply = MemoryReply()
    outcome = await served(
        service, delivery(make_request("f", PROMPT), reply=reply, redelivers=True)
    )
    assert reply.published == []
    assert outcome.requeue and outcome.error_code == "engine_error"


async def test_a_dead_engine_answers_the_request_and_marks_the_service() -> None:
    engine = scripted(
        ChoiceDelta(0, [11, 12], None, None, None),
        then_raise=EngineDead("engine core died"),
    )
    service = service_on(engine)
    reply = MemoryReply()
    outcome = await served(service, delivery(make_request("dead", PROMPT), reply=reply))
    maps = wire(reply)
    assert [m["seq"] for m in maps] == [0, 1]
    assert maps[0]["token_ids"] == [11, 12]
    assert maps[1]["finish_reason"] == "error"
    assert maps[1]["error"] == {"code": "engine_error", "message": "engine core died"}
    assert outcome.error_code == "engine_error" and outcome.completion_tokens == 2
    assert service.engine_dead.is_set()


async def test_a_failed_health_check_marks_the_engine_dead() -> None:
    engine = ScriptedFakeEngine()
    service = service_on(engine, health_interval_s=0.01)
    watcher = asyncio.create_task(service.watch_engine())
    await asyncio.sleep(0.05)
    assert not watcher.done()  # healthy: it keeps checking
    engine.dead = EngineDead("health check failed")
    await asyncio.wait_for(watcher, 5)
    assert service.engine_dead.is_set()


async def test_a_bug_in_the_engine_is_an_internal_error_frame() -> None:
    engine = scripted(ChoiceDelta(0, [3], None, None, None), then_raise=KeyError("lost"))
    service = service_on(engine)
    reply = MemoryReply()
    outcome = await served(service, delivery(make_request("bug", PROMPT), reply=reply))
    final = wire(reply)[-1]
    assert final["error"] == {"code": "internal_error", "message": "KeyError: 'lost'"}
    assert outcome.error_code == "internal_error"


async def test_answer_error_sends_the_intakes_error_as_frame_zero() -> None:
    service = service_on()
    reply = MemoryReply()
    arrival = delivery(make_request("x", PROMPT), reply=reply)
    await service.answer_error(arrival, "internal_error", "RuntimeError: accept broke")
    (frame,) = wire(reply)
    assert (frame["seq"], frame["finish_reason"]) == (0, "error")
    assert frame["error"] == {"code": "internal_error", "message": "RuntimeError: accept broke"}
    assert service.stats[SUBJECT].num_errors == 1


# --- max_payload ------------------------------------------------------------------------


def _row(token_id: int, k: int, text: str = "tok") -> list[TopLogprob]:
    return [
        TopLogprob(rank, token_id + rank - 1, f"{text}{rank}", -0.1 * rank, b"x" * 4)
        for rank in range(1, k + 1)
    ]


async def test_a_frame_over_max_payload_is_split_in_order_with_rows_aligned() -> None:
    ids = list(range(10, 50))
    engine = scripted(
        ChoiceDelta(0, ids, [-0.5] * len(ids), [_row(i, 5) for i in ids], "length"),
    )
    service = service_on(engine, max_payload=600)
    reply = MemoryReply()
    request = make_request("split", PROMPT, max_tokens=40, logprobs=5)
    await served(service, delivery(request, reply=reply))
    assert len(reply.published) > 2
    assert all(len(data) <= 600 for data in reply.published)
    pieces = frames(reply)
    assert [f.seq for f in pieces] == list(range(len(pieces)))
    assert sum((f.token_ids for f in pieces), []) == ids
    assert sum((f.top_logprobs for f in pieces), []) == [_row(i, 5) for i in ids]  # type: ignore[arg-type]
    for piece in pieces:
        assert len(piece.token_ids) == len(piece.log_probs) == len(piece.top_logprobs)  # type: ignore[arg-type]
    assert [f.finish_reason for f in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert ["completion_usage" in m for m in wire(reply)][-1] is True
    assert all("completion_usage" not in m for m in wire(reply)[:-1])


async def test_one_position_over_max_payload_is_an_engine_error_frame() -> None:
    engine = scripted(ChoiceDelta(0, [5], [-0.1], [_row(5, 20, "x" * 40)], "length"))
    service = service_on(engine, max_payload=400)
    reply = MemoryReply()
    outcome = await served(
        service, delivery(make_request("huge", PROMPT, max_tokens=1, logprobs=20), reply=reply)
    )
    (frame,) = wire(reply)
    assert frame["seq"] == 0 and frame["error"]["code"] == "engine_error"
    assert "one generated position exceeds max_payload" in frame["error"]["message"]
    assert outcome.error_code == "engine_error"


async def test_a_split_that_fails_halfway_leaves_no_gap_before_the_error_frame() -> None:
    small, big = _row(5, 1), _row(6, 20, "x" * 40)
    engine = scripted(ChoiceDelta(0, [5, 6], [-0.1, -0.2], [small, big], "length"))
    service = service_on(engine, max_payload=400)
    reply = MemoryReply()
    await served(
        service, delivery(make_request("gap", PROMPT, max_tokens=2, logprobs=20), reply=reply)
    )
    assert [m["seq"] for m in wire(reply)] == list(range(len(reply.published)))


async def test_a_request_reaches_the_engine_before_accept_returns() -> None:
    """Admission first (worker/eager.py): the request's task runs up to its first wait inside
    `accept`, so the engine has it before the event loop runs anything already queued (other
    streams' frames); it then streams as ever."""
    engine = ScriptedFakeEngine(
        [EngineStep(None, [ChoiceDelta(0, [7], None, None, finish_reason="length")])], step_s=0.05
    )
    service = service_on(engine)
    reply = MemoryReply()
    queued_first: list[int] = []
    asyncio.get_running_loop().call_soon(lambda: queued_first.append(len(engine.requests)))
    running = await service.accept(delivery(make_request("early", PROMPT), reply=reply))
    assert [request.request_id for request, _ in engine.requests] == ["early"]
    assert isinstance(running, asyncio.Task)
    outcome = await asyncio.wait_for(running, 10)
    assert queued_first == [1], "the engine had the request before queued work ran"
    assert outcome.finish_reasons == ["length"]
    assert [f["token_ids"] for f in wire(reply)] == [[7]]
    assert service.in_flight == 0
