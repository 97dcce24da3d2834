"""Faults lose nothing: poison messages, broker outages and blips, reconnecting clients, misfiled
errors, cancels that cross publishers. Real nats-server; the real vLLM engine wherever the engine
is involved (a paced fake engine only for probe counting)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import msgspec
import nats
import pytest
from hypothesis import given
from prometheus_client import CollectorRegistry

from messages.codec import MSGPACK
from messages.request import CancelRequest
from messages.subjects import REPLY_HEADER, Subjects
from tests.fuzzing import fuzz_settings, hostile_payloads, locally_valid
from tests.helpers import Tally, frame_maps, raw_frames, tally
from worker.client import is_probe, jetstream_complete
from worker.client.requests import make_request
from worker.config import JetStreamSettings, NatsConfig, WorkerConfig
from worker.dev.embedded import NatsServer
from worker.metrics import WorkerMetrics
from worker.nats.intake.jetstream import JetStreamIntake, stream_name
from worker.nats.runtime import WorkerRuntime, open_worker
from worker.service import Delivery

PROMPT = [1, 300, 301, 302]

# A valid request whose unknown field nests ~1,000 maps deep (3 KB): msgspec raises
# RecursionError while skipping it.
DEEP_JSON = (
    b'{"request_id":"deep-1","token_ids":[1,2,3],"junk":'
    + b'{"a":' * 1000
    + b"1"
    + b"}" * 1000
    + b"}"
)
DEEP_MSGPACK = (
    b"\x83"
    + MSGPACK.encode("request_id")
    + MSGPACK.encode("deep-1")
    + MSGPACK.encode("token_ids")
    + MSGPACK.encode([1, 2, 3])
    + MSGPACK.encode("junk")
    + b"\x81\xa1a" * 1000
    + b"\x01"
)


def _json_request(**sampling: int) -> bytes:
    fields = ",".join(f'"{name}":{value}' for name, value in sampling.items())
    return (
        b'{"request_id":"big-int","token_ids":[1,2,3],"stop_conditions":{"max_tokens":4},'
        b'"sampling_options":{' + fields.encode() + b"}}"
    )


# (payload, as_json, the field the error must name)
OUT_OF_RANGE = [
    (_json_request(seed=2**70), True, "sampling_options.seed"),
    (_json_request(seed=2**64 - 1), True, "sampling_options.seed"),
    (_json_request(seed=-(2**63) - 1), True, "sampling_options.seed"),
    (_json_request(top_k=2**70), True, "sampling_options.top_k"),
    (_json_request(top_k=2**40), True, "sampling_options.top_k"),
    (
        MSGPACK.encode(
            {"request_id": "big-int", "token_ids": [1], "sampling_options": {"seed": 2**64 - 1}}
        ),
        False,
        "sampling_options.seed",
    ),
    (
        MSGPACK.encode(
            {"request_id": "big-int", "token_ids": [1], "sampling_options": {"top_k": 2**63}}
        ),
        False,
        "sampling_options.top_k",
    ),
    (
        MSGPACK.encode({"request_id": "big-int", "token_ids": [1], "timeout_ms": 2**62}),
        False,
        "timeout_ms",
    ),
    (
        MSGPACK.encode(
            {
                "request_id": "big-int",
                "token_ids": [1],
                "sampling_options": {"temperature": float("inf")},
            }
        ),
        False,
        "sampling_options.temperature",
    ),
]


async def _core_exchange(nc, subject: str, payload: bytes, as_json: bool) -> list[dict]:
    return [f async for f in frame_maps(nc, subject, payload, json=as_json, timeout=30)]


async def _queue_exchange(nc, subjects: Subjects, payload: bytes, as_json: bool) -> list[dict]:
    frames = frame_maps(nc, subjects.queue, payload, json=as_json, timeout=30, jetstream=True)
    return [f async for f in frames]


async def _rest_of(subscription) -> list[dict]:
    return [msgspec.msgpack.decode(data) async for data in raw_frames(subscription, timeout=30)]


@pytest.fixture
async def js_worker(engine, nats_server):
    """A JetStream-mode worker on the session's real engine; stopped after the test."""
    made = []

    async def start(subjects: Subjects, settings: JetStreamSettings, **config) -> WorkerRuntime:
        worker_config = WorkerConfig(
            nats=NatsConfig(servers=[nats_server.url]),
            subjects=subjects,
            max_concurrency=8,
            **config,
        )
        worker_config.jetstream = dataclasses.replace(settings, capacity=8)
        worker = await open_worker(engine, worker_config)
        made.append(worker)
        return worker

    yield start
    for worker in made:
        await worker.stop()


async def _settled(client, stream: str, durable: str) -> tuple[int, int]:
    js = client.jetstream()
    deadline = time.monotonic() + 5
    while True:
        state = (await js.stream_info(stream)).state
        pending = (await js.consumer_info(stream, durable)).num_ack_pending
        if (state.messages == 0 and pending == 0) or time.monotonic() > deadline:
            return state.messages, pending
        await asyncio.sleep(0.05)


# --- 1. poison messages ------------------------------------------------------------------------


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "msgpack"])
async def test_poison_message_in_jetstream_is_terminated_and_the_next_five_served(
    js_worker, client, as_json: bool
) -> None:
    subjects = Subjects("poison", "json" if as_json else "msgpack", "generate")
    settings = JetStreamSettings()
    worker = await js_worker(subjects, settings)
    frames = await _queue_exchange(
        client, subjects, DEEP_JSON if as_json else DEEP_MSGPACK, as_json
    )
    assert len(frames) == 1
    assert frames[0]["finish_reason"] == "error"
    assert frames[0]["error"]["code"] == "invalid_request"
    assert "nested too deeply" in frames[0]["error"]["message"]
    assert frames[0]["attempt"] == 1  # terminated at once: retrying cannot help
    for i in range(5):
        completion, attempts = await jetstream_complete(
            client, make_request(f"after-poison-{i}", PROMPT, max_tokens=4), subjects=subjects
        )
        assert completion.choices[0].finish_reason == "length", completion.error
        assert attempts == [1]
    stream = stream_name(subjects, settings)
    assert await _settled(client, stream, settings.durable) == (0, 0)
    assert not worker.intake.failed.is_set()


async def test_a_failure_while_taking_a_message_settles_it_and_the_pull_goes_on(
    js_worker, client, monkeypatch
) -> None:
    subjects = Subjects("takefail", "vllm", "generate")
    settings = JetStreamSettings(max_deliver=3)
    worker = await js_worker(subjects, settings)
    accept = worker.service.accept
    seen: list[int] = []

    async def failing_accept(delivery: Delivery):
        if b"boom" in delivery.data:
            seen.append(delivery.attempt or 0)
            raise RuntimeError("a bug while taking the message")
        return await accept(delivery)

    monkeypatch.setattr(worker.service, "accept", failing_accept)
    completion, attempts = await jetstream_complete(
        client, make_request("boom", PROMPT, max_tokens=4), subjects=subjects, timeout=30
    )
    # Retryable (a worker bug, not the request's fault): NAKed twice, answered and TERMed on the
    # last attempt, never left "in progress".
    assert seen == [1, 2, 3]
    assert attempts == [3]
    assert completion.error is not None and completion.error.code == "internal_error"
    assert "RuntimeError: a bug while taking the message" in completion.error.message
    after, _ = await jetstream_complete(
        client, make_request("after-fail", PROMPT, max_tokens=4), subjects=subjects
    )
    assert after.choices[0].finish_reason == "length"
    assert await _settled(client, stream_name(subjects, settings), settings.durable) == (0, 0)


async def test_a_pull_loop_that_dies_anyway_marks_the_intake_failed(
    js_worker, client, monkeypatch
) -> None:
    subjects = Subjects("pulldies", "vllm", "generate")
    worker = await js_worker(subjects, JetStreamSettings())
    intake: JetStreamIntake = worker.intake

    async def broken(msg) -> None:
        raise RuntimeError("the guard itself failed")

    monkeypatch.setattr(intake, "_take_guarded", broken)
    inbox = client.new_inbox()
    await client.jetstream().publish(
        subjects.queue,
        MSGPACK.encode(make_request("kills-loop", PROMPT)),
        headers={REPLY_HEADER: inbox},
    )
    await asyncio.wait_for(intake.failed.wait(), 10)
    # The lifecycle then drains and ends non-zero (the process exits 1), although nobody asked
    # it to stop.
    assert await asyncio.wait_for(worker.run(asyncio.Event()), 30) == 1


# --- 4. misfiled errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload,as_json",
    [(DEEP_JSON, True), (DEEP_MSGPACK, False)],
    ids=["json", "msgpack"],
)
async def test_deep_nesting_in_core_mode_is_invalid_request(
    worker, client, payload: bytes, as_json: bool
) -> None:
    frames = await _core_exchange(client, "test.vllm.generate", payload, as_json)
    assert [f["finish_reason"] for f in frames] == ["error"]
    assert frames[0]["error"]["code"] == "invalid_request"
    assert frames[0]["error"]["message"] == "invalid payload: nested too deeply to decode"


@pytest.mark.parametrize("payload,as_json,field_name", OUT_OF_RANGE)
async def test_out_of_range_integers_are_invalid_request_naming_the_field_in_both_modes(
    worker, js_worker, client, payload: bytes, as_json: bool, field_name: str
) -> None:
    core = await _core_exchange(client, "test.vllm.generate", payload, as_json)
    subjects = Subjects("bigint", "vllm", "generate")
    await js_worker(subjects, JetStreamSettings())
    queued = await _queue_exchange(client, subjects, payload, as_json)
    for frames in (core, queued):
        assert len(frames) == 1 and frames[0]["finish_reason"] == "error"
        error = frames[0]["error"]
        assert error["code"] == "invalid_request", error
        assert field_name in error["message"], error
        assert frames[0]["request_id"] == "big-int"  # readable, so carried
    assert queued[0]["attempt"] == 1


async def test_oversized_payload_error_carries_its_request_id(extra_worker, client) -> None:
    subjects = Subjects("oversize", "vllm", "generate")
    await extra_worker(subjects, max_request_bytes=1000)
    request = make_request("too-big-1", [1] * 1200)
    frames = await _core_exchange(client, subjects.generate, MSGPACK.encode(request), False)
    assert frames[0]["error"]["code"] == "invalid_request"
    assert "exceeds max_request_bytes 1000" in frames[0]["error"]["message"]
    assert frames[0]["request_id"] == "too-big-1"


async def test_a_worker_bug_in_row_building_is_internal_error_not_invalid_request(
    worker, client, engine, monkeypatch
) -> None:
    from worker.engine import logprobs

    def broken_extract(*args, **kwargs):
        raise ValueError("zip() argument 2 is shorter than argument 1")

    monkeypatch.setattr(logprobs, "extract", broken_extract)
    frames = await _core_exchange(
        client,
        "test.vllm.generate",
        MSGPACK.encode(make_request("row-bug", PROMPT, max_tokens=4, logprobs=2)),
        False,
    )
    assert frames[-1]["finish_reason"] == "error"
    assert frames[-1]["error"]["code"] == "internal_error"
    assert frames[-1]["error"]["message"] == (
        "ValueError: zip() argument 2 is shorter than argument 1"
    )


async def test_a_bare_engine_error_still_has_a_message(worker, client, engine, monkeypatch) -> None:
    from vllm.v1.engine.exceptions import EngineGenerateError

    original = engine.llm.generate

    def failing_generate(prompt, params, request_id, **kwargs):
        async def outputs():
            async for out in original(prompt, params, request_id, **kwargs):
                try:
                    raise KeyError("lost state")
                except KeyError as error:
                    raise EngineGenerateError() from error  # what vLLM raises: no text
                yield out

        return outputs()

    monkeypatch.setattr(engine.llm, "generate", failing_generate)
    frames = await _core_exchange(
        client,
        "test.vllm.generate",
        MSGPACK.encode(make_request("bare-error", PROMPT, max_tokens=4)),
        False,
    )
    error = frames[-1]["error"]
    assert error["code"] == "engine_error"
    assert error["message"] == "EngineGenerateError: KeyError: 'lost state'"


# --- 5. cancel binds to the publisher ----------------------------------------------------------


async def test_a_cancel_does_not_reach_another_publishers_request_of_the_same_id(
    worker, nats_server, engine
) -> None:
    first = await nats.connect(nats_server.url)
    second = await nats.connect(nats_server.url)
    try:
        request = make_request("same-id", PROMPT, max_tokens=300, logprobs=5)
        subs = []
        for nc in (first, second):
            inbox = nc.new_inbox()
            subs.append((inbox, await nc.subscribe(inbox)))
            await nc.publish("test.vllm.generate", MSGPACK.encode(request), reply=inbox)
        for _, sub in subs:  # both are running
            while is_probe(await sub.next_msg(timeout=30)):
                pass
        cancel = CancelRequest(request_id="same-id", reply_subject=subs[0][0])
        await first.publish("test.vllm.generate.cancel", MSGPACK.encode(cancel))
        cancelled = await _rest_of(subs[0][1])
        kept = await _rest_of(subs[1][1])
        assert cancelled[-1]["finish_reason"] == "cancelled"
        assert kept[-1]["finish_reason"] == "length"
        assert kept[-1]["completion_usage"]["completion_tokens"] == 300
        # A cancel without the reply subject is refused by the decoder, not applied to all.
        with pytest.raises(msgspec.ValidationError, match="reply_subject"):
            MSGPACK.decode_cancel(MSGPACK.encode({"request_id": "same-id"}))
    finally:
        await first.close()
        await second.close()


async def test_the_client_library_cancels_only_its_own_request(worker, nats_server) -> None:
    from worker.client import generate

    first = await nats.connect(nats_server.url)
    second = await nats.connect(nats_server.url)
    try:
        request = make_request("lib-same-id", PROMPT, max_tokens=300, logprobs=5)

        async def stop_early() -> None:
            async for frame in generate(first, request, subject="test.vllm.generate"):
                if frame.token_ids:
                    break  # leaving early publishes the cancel

        async def read_all():
            return [f async for f in generate(second, request, subject="test.vllm.generate")]

        kept, _ = await asyncio.gather(read_all(), stop_early())
        assert kept[-1].finish_reason == "length"
        assert kept[-1].completion_usage.completion_tokens == 300
    finally:
        await first.close()
        await second.close()


# --- 2 and 3. broker outages, reconnecting clients, probe cost ---------------------------------


async def _outage(engine, outage_s: float, caplog) -> tuple[list[Tally], list[Tally]]:
    """32 long streams with logprobs 5 from 4 client connections (nats-py's default 2 s
    reconnect wait; the worker's is 0.5 s), plus 4 with a deadline that passes in the outage;
    the broker is SIGKILLed once all are streaming and restarted `outage_s` later."""
    caplog.set_level(logging.INFO, logger="worker")
    server = NatsServer().start()
    subjects = Subjects("outage", "vllm", "generate")
    clients = []
    worker = None
    try:
        config = WorkerConfig(nats=NatsConfig(servers=[server.url]), subjects=subjects)
        worker = await open_worker(
            engine, config, WorkerMetrics(engine.limits.model, CollectorRegistry())
        )
        clients = [await nats.connect(server.url, max_reconnect_attempts=-1) for _ in range(4)]
        long_streams = [Tally(f"outage-{i}") for i in range(32)]
        tasks = [
            asyncio.create_task(
                tally(
                    clients[i % 4],
                    subjects.generate,
                    make_request(
                        s.request_id,
                        [1, 40 + i, 300],
                        max_tokens=500,
                        logprobs=5,
                        temperature=1.0,
                        seed=i,
                    ),
                    s,
                )
            )
            for i, s in enumerate(long_streams)
        ]
        await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in long_streams)), 120)
        deadline_streams = [Tally(f"deadline-{i}") for i in range(4)]
        for i, s in enumerate(deadline_streams):
            request = make_request(s.request_id, [1, 90 + i, 300], max_tokens=500, logprobs=5)
            request.timeout_ms = 1500
            tasks.append(asyncio.create_task(tally(clients[i], subjects.generate, request, s)))
        await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in deadline_streams)), 60)
        # The fault lands mid-stream: every request is running and far from its end.
        assert worker.service.in_flight == 36
        assert all(s.tokens < 250 for s in long_streams)
        server.kill()
        await asyncio.sleep(outage_s)
        server.start()
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
        assert worker.service.in_flight == 0
        return long_streams, deadline_streams
    finally:
        for nc in clients:
            await nc.close()
        if worker is not None:
            await worker.stop()
        server.stop()


def _check_outage(long_streams: list[Tally], deadline_streams: list[Tally], caplog) -> None:
    # Every request ended, with a final frame its client received after the reconnect.
    for s in long_streams:
        assert s.final is not None, s.request_id
        assert s.final["finish_reason"] == "length", (s.request_id, s.final.get("error"))
        assert s.final["completion_usage"]["completion_tokens"] == 500
    for s in deadline_streams:
        assert s.final is not None, s.request_id
        assert s.final["finish_reason"] == "cancelled"
        assert s.final["error"]["code"] == "deadline_exceeded"
    # Nothing was aborted as client_gone while its client reconnected.
    assert "client gone" not in caplog.text
    gaps = sum(s.gaps for s in long_streams + deadline_streams)
    frames = sum(s.frames for s in long_streams + deadline_streams)
    # Only frames in transit at the instant the broker died can be missing (at most a few per
    # stream); everything published after it waited for the connection and the client.
    assert gaps <= 3 * 36, (gaps, frames)
    print(f"outage: {frames} frames received, {gaps} lost in transit")


async def test_a_3s_broker_outage_ends_every_stream_with_logprobs(engine, caplog) -> None:
    long_streams, deadline_streams = await _outage(engine, 3.0, caplog)
    _check_outage(long_streams, deadline_streams, caplog)


async def test_a_0_3s_broker_blip_ends_every_stream_and_aborts_no_reconnecting_client(
    engine, caplog
) -> None:
    long_streams, deadline_streams = await _outage(engine, 0.3, caplog)
    _check_outage(long_streams, deadline_streams, caplog)


# --- malformed payloads through the JetStream intake --------------------------------------------


@dataclass
class FuzzQueue:
    subjects: Subjects
    settings: JetStreamSettings
    worker: WorkerRuntime
    invalid: int = 0
    valid: int = 0


@pytest.fixture(scope="module")
async def fuzz_queue(engine, nats_server):
    subjects = Subjects("fuzzq", "vllm", "generate")
    settings = JetStreamSettings()
    config = WorkerConfig(
        nats=NatsConfig(servers=[nats_server.url]),
        subjects=subjects,
        max_concurrency=8,
        jetstream=dataclasses.replace(settings, capacity=8),
    )
    worker = await open_worker(engine, config)
    yield FuzzQueue(subjects, settings, worker)
    await worker.stop()


@fuzz_settings(300)
@given(case=hostile_payloads())
async def test_fuzz_the_jetstream_intake_each_gets_invalid_request_and_is_terminated(
    fuzz_queue: FuzzQueue, client, engine, case
) -> None:
    data, as_json = case
    if locally_valid(data, as_json, engine.limits):
        fuzz_queue.valid += 1
        return
    fuzz_queue.invalid += 1
    room = client.max_payload - 1024  # headers count too
    frames = await _queue_exchange(client, fuzz_queue.subjects, data[:room], as_json)
    assert len(frames) == 1, frames
    assert frames[0]["finish_reason"] == "error"
    assert frames[0]["error"]["code"] == "invalid_request", frames[0]
    assert frames[0]["error"]["message"]
    assert frames[0]["attempt"] == 1


async def test_jetstream_fuzz_ran_enough_left_nothing_behind_and_still_serves(
    fuzz_queue: FuzzQueue, client
) -> None:
    # About one hostile payload in ten is a valid request by chance (then skipped).
    assert fuzz_queue.invalid >= 300 * 0.8, (fuzz_queue.invalid, fuzz_queue.valid)
    stream = stream_name(fuzz_queue.subjects, fuzz_queue.settings)
    assert await _settled(client, stream, fuzz_queue.settings.durable) == (0, 0)
    completion, attempts = await jetstream_complete(
        client, make_request("after-fuzz", PROMPT, max_tokens=4), subjects=fuzz_queue.subjects
    )
    assert completion.choices[0].finish_reason == "length" and attempts == [1]
