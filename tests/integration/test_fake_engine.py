"""Integration layer: the real nats-server with fake engines (worker.dev.fakes), no vLLM.

Liveness probing cost, time to first token from the message's arrival, the frames of the
synthetic engine on the wire, and how the client reader tells probes from frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import nats
import pytest
from nats.aio.subscription import Subscription
from prometheus_client import CollectorRegistry

from messages.codec import JSON, MSGPACK
from messages.subjects import Subjects
from tests.helpers import Tally, raw_frames, tally
from worker.client import RequestError, generate
from worker.client.requests import make_request
from worker.config import NatsConfig, WorkerConfig
from worker.dev.fakes import PacedFakeEngine, SyntheticFastEngine
from worker.metrics import WorkerMetrics
from worker.nats.liveness import NatsReply
from worker.nats.runtime import open_worker
from worker.service import Delivery

PROMPT = [1, 300, 301, 302]


async def _rest_of(subscription, *, json: bool = False) -> list[dict]:
    decode = msgspec.json.decode if json else msgspec.msgpack.decode
    return [decode(data) async for data in raw_frames(subscription, json=json, timeout=30)]


async def test_probe_cost_is_per_client_not_per_request(nats_server) -> None:
    """256 requests in flight from 2 clients: each round probes 2 reply subjects, not 256."""
    engine = PacedFakeEngine(step_s=0.05)
    subjects = Subjects("probecost", "fake", "generate")
    config = WorkerConfig(
        nats=NatsConfig(servers=[nats_server.url]),
        subjects=subjects,
        liveness_interval_s=0.2,
        liveness_timeout_s=0.1,
    )
    worker = await open_worker(engine, config)
    clients = [await nats.connect(nats_server.url) for _ in range(2)]
    try:
        streams = [Tally(f"probe-{i}") for i in range(256)]
        tasks = [
            asyncio.create_task(
                tally(
                    clients[i % 2],
                    subjects.generate,
                    make_request(s.request_id, PROMPT, max_tokens=60, logprobs=1),
                    s,
                )
            )
            for i, s in enumerate(streams)
        ]
        await asyncio.wait_for(asyncio.gather(*(s.first.wait() for s in streams)), 30)
        assert worker.service.in_flight == 256
        before = worker.liveness.probes_sent
        await asyncio.sleep(1.0)  # five rounds
        sent = worker.liveness.probes_sent - before
        assert worker.liveness.clients == 2
        assert 2 <= sent <= 2 * 6, sent  # before: 256 per round
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert all(s.final["finish_reason"] == "length" for s in streams)
    finally:
        for nc in clients:
            await nc.close()
        await worker.stop()


async def test_time_to_first_token_counts_from_the_messages_arrival(nats_server) -> None:
    engine = PacedFakeEngine(step_s=0.0)
    metrics = WorkerMetrics(engine.limits.model, CollectorRegistry())
    config = WorkerConfig(
        nats=NatsConfig(servers=[nats_server.url]), subjects=Subjects("ttft", "fake", "generate")
    )
    worker = await open_worker(engine, config, metrics)
    worker_nc = worker.nc
    inbox = worker_nc.new_inbox()
    sub = await worker_nc.subscribe(inbox)
    try:
        arrived = time.monotonic_ns() - 3_000_000_000  # taken from NATS 3 s ago
        payload = JSON.encode(make_request("ttft-1", PROMPT, max_tokens=2))
        headers = {"Content-Type": "application/json"}
        delivery = Delivery(payload, headers, NatsReply(worker.liveness, inbox), "ttft", arrived)
        running = await worker.service.accept(delivery)
        assert isinstance(running, asyncio.Task)
        assert (await running).first_token_s >= 3.0
        frames = await _rest_of(sub, json=True)
        assert frames[-1]["finish_reason"] == "length"
        registry = metrics.registry
        name = "nats_worker_time_to_first_token_seconds"
        labels = {"model_name": "paced-fake"}
        assert registry.get_sample_value(f"{name}_count", labels) == 1
        # from the arrival, not later
        assert registry.get_sample_value(f"{name}_sum", labels) >= 3.0
    finally:
        await sub.unsubscribe()
        await worker.stop()


@contextlib.asynccontextmanager
async def synthetic_worker(nats_server, client, subjects: Subjects) -> AsyncIterator[Subscription]:
    """A worker on the synthetic engine serving `subjects`, and a reply subscription of
    `client`'s (its subject is the subscription's); both gone afterwards."""
    config = WorkerConfig(nats=NatsConfig(servers=[nats_server.url]), subjects=subjects)
    worker = await open_worker(SyntheticFastEngine(), config)
    subscription = await client.subscribe(client.new_inbox())
    try:
        yield subscription
    finally:
        await subscription.unsubscribe()
        await worker.stop()


async def test_synthetic_engine_frames_follow_the_wire_contract(nats_server, client) -> None:
    from worker.client.requests import make_request

    subjects = Subjects("synth", "vllm", "generate")
    async with synthetic_worker(nats_server, client, subjects) as subscription:
        inbox = subscription.subject
        request = make_request(None, [5, 6, 7], max_tokens=4, logprobs=5)
        await client.publish(subjects.generate, MSGPACK.encode(request), reply=inbox)
        maps = [msgspec.msgpack.decode(d) async for d in raw_frames(subscription, timeout=10)]
        assert [m["seq"] for m in maps] == [0, 1, 2, 3]
        assert [m["finish_reason"] for m in maps] == [None, None, None, "length"]
        for m in maps:
            assert len(m["token_ids"]) == len(m["log_probs"]) == len(m["top_logprobs"]) == 1
            assert [row["rank"] for row in m["top_logprobs"][0]] == [1, 2, 3, 4, 5]
        assert maps[-1]["completion_usage"]["completion_tokens"] == 4


async def test_a_json_request_without_content_type_is_answered_in_json(nats_server, client) -> None:
    """What `nats req SUBJECT '{...}'` sends without `-H Content-Type:application/json`: the
    worker takes the body as JSON and answers in JSON."""
    subjects = Subjects("rawjson", "vllm", "generate")
    async with synthetic_worker(nats_server, client, subjects) as subscription:
        inbox = subscription.subject
        body = (
            b'{"request_id": "raw-1", "token_ids": [5, 6], '
            b'"stop_conditions": {"max_tokens": 3}, "output_options": {"logprobs": 1}}'
        )
        await client.publish(subjects.generate, body, reply=inbox)
        maps = await _rest_of(subscription, json=True)
        assert [m["seq"] for m in maps] == [0, 1, 2]
        assert [m["finish_reason"] for m in maps] == [None, None, "length"]
        assert all(m["request_id"] == "raw-1" for m in maps)
        # A bad one is answered in JSON too, naming the field.
        await client.publish(subjects.generate, b'{"request_id": "raw-2"}', reply=inbox)
        (error,) = await _rest_of(subscription, json=True)
        assert error["finish_reason"] == "error"
        assert error["error"]["code"] == "invalid_request"
        assert "token_ids" in error["error"]["message"], error


async def test_probes_are_skipped_by_their_header_and_an_empty_reply_is_an_error(
    client,
) -> None:
    """A message marked with the probe header is the worker's liveness probe, never a frame; an
    empty message without it (e.g. a NATS micro responder's error reply) is an error the client
    raises, rather than skip it and wait out its timeout."""
    from nats import micro

    from messages.subjects import PROBE_HEADER

    service = await micro.add_service(client, name="raiser", version="0.0.1")

    async def raises(request) -> None:
        raise ValueError("handler bug")

    await service.add_endpoint(name="gen", subject="raiser.fake.generate", handler=raises)
    try:
        with pytest.raises(RequestError) as failed:
            async for _frame in generate(
                client, make_request("z", PROMPT), subject="raiser.fake.generate", timeout=30
            ):
                pass
        assert failed.value.code == "internal_error"
        assert "empty message that is not a probe or frame" in failed.value.message
    finally:
        await service.stop()

    async def probe_then_answer(msg) -> None:
        await client.publish(msg.reply, b"", headers={PROBE_HEADER: "liveness"})
        frame = {"request_id": "p", "seq": 0, "index": 0, "finish_reason": "length"}
        await client.publish(msg.reply, msgspec.msgpack.encode(frame))

    subscription = await client.subscribe("prober.fake.generate", cb=probe_then_answer)
    try:
        frames = [
            f
            async for f in generate(
                client, make_request("p", PROMPT), subject="prober.fake.generate"
            )
        ]
        assert [(f.seq, f.finish_reason) for f in frames] == [(0, "length")]
    finally:
        await subscription.unsubscribe()
