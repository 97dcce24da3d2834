"""Request lifecycle and reliability on the real nats-server and the real vLLM engine:
cancel, deadline, abandoned clients, backpressure, drain, fuzzing, scale-out, broker restart,
cluster failover and auth."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import msgspec
import nats
import nats.errors
import pytest
from hypothesis import given
from prometheus_client import REGISTRY

from messages.codec import MSGPACK
from messages.request import CancelRequest
from messages.subjects import Subjects
from tests.fuzzing import fuzz_settings, hostile_payloads, locally_valid
from tests.helpers import TEST_SUBJECTS, complete_all, exchange, frame_maps
from worker.client import complete, generate
from worker.client.requests import make_request
from worker.config import NatsConfig, WorkerConfig
from worker.dev.embedded import NatsServer
from worker.nats.runtime import open_worker

SUBJECT = TEST_SUBJECTS.generate
PROMPT = [1, 300, 301, 302]


def vllm_gauge(name: str) -> float:
    """vLLM's own scheduler gauge (e.g. vllm:num_requests_running), summed over its labels."""
    total = 0.0
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return total


async def wait_engine_idle(engine, within: float) -> float:
    """Seconds until the engine holds no request (its output processor's count), or fail."""
    started = time.monotonic()
    while engine.num_unfinished_requests() != 0:
        assert time.monotonic() - started < within, (
            f"engine still holds {engine.num_unfinished_requests()} requests after {within}s"
        )
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def test_fifty_streams_cancelled_mid_generation_free_the_engine(
    worker, client, engine
) -> None:
    started = asyncio.Event()
    got_first = 0
    inboxes = [client.new_inbox() for _ in range(50)]

    async def stream(i: int) -> list[dict]:
        nonlocal got_first
        frames = []
        request = make_request(f"cancel-{i}", [1, 10 + i, 300, 301], max_tokens=400)
        payload = MSGPACK.encode(request)
        async for frame in frame_maps(client, SUBJECT, payload, inbox=inboxes[i]):
            frames.append(frame)
            if len(frames) == 1:
                got_first += 1
                if got_first == 50:
                    started.set()
        return frames

    tasks = [asyncio.create_task(stream(i)) for i in range(50)]
    await asyncio.wait_for(started.wait(), 120)
    assert engine.num_unfinished_requests() == 50
    for i in range(50):
        cancel = CancelRequest(request_id=f"cancel-{i}", reply_subject=inboxes[i])
        await client.publish(TEST_SUBJECTS.cancel, MSGPACK.encode(cancel))
    await client.flush()
    freed_after = await wait_engine_idle(engine, within=1.0)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    for frames in results:
        final = frames[-1]
        assert final["finish_reason"] == "cancelled"
        assert "error" not in final
        generated = sum(len(f["token_ids"]) for f in frames)
        assert 0 < generated < 400
        assert final["completion_usage"]["completion_tokens"] == generated
    # vLLM's scheduler agrees (its gauges are updated on the engine's next stats report).
    deadline = time.monotonic() + 5
    while (
        vllm_gauge("vllm:num_requests_running") + vllm_gauge("vllm:num_requests_waiting")
        and time.monotonic() < deadline
    ):
        await asyncio.sleep(0.1)
    assert (
        vllm_gauge("vllm:num_requests_running") == 0
        and vllm_gauge("vllm:num_requests_waiting") == 0
    )
    assert freed_after < 1.0


async def test_client_that_stops_iterating_cancels_its_request(worker, client, engine) -> None:
    count = 0
    async for _frame in generate(
        client, make_request("break-1", PROMPT, max_tokens=400), subject=SUBJECT
    ):
        count += 1
        if count == 3:
            break
    await wait_engine_idle(engine, within=1.0)


async def test_deadline_aborts_the_request(worker, client, engine) -> None:
    request = make_request("deadline-1", PROMPT, max_tokens=400)
    request.timeout_ms = 300
    started = time.monotonic()
    frames = [f async for f in frame_maps(client, SUBJECT, MSGPACK.encode(request))]
    elapsed = time.monotonic() - started
    final = frames[-1]
    assert final["finish_reason"] == "cancelled"
    assert final["error"]["code"] == "deadline_exceeded"
    assert sum(len(f["token_ids"]) for f in frames) < 400
    assert elapsed < 2.0
    await wait_engine_idle(engine, within=1.0)


async def test_abandoned_streams_are_detected_and_aborted(
    extra_worker, client, engine, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="worker.service")
    subjects = Subjects("liveness", "vllm", "generate")
    # Detection must beat the streams' end, however fast the host: a tight probe cycle (0.1 s,
    # grace 0.2 s) and 4 x 500 tokens per request with logprobs 5 (the tiny model's context
    # allows 509), which outlast several cycles.
    worker = await extra_worker(
        subjects, liveness_interval_s=0.1, liveness_timeout_s=0.1, client_gone_grace_s=0.2
    )
    config = worker.config
    # A miss of the client's probe, a round probing each of its requests, misses spanning the
    # grace, then one round trip.
    bound = (
        2 * config.liveness_interval_s
        + config.client_gone_grace_s
        + config.liveness_timeout_s
        + 0.5
    )
    subscriptions = []
    for i in range(8):
        inbox = client.new_inbox()
        subscription = await client.subscribe(inbox)
        request = make_request(
            f"abandoned-{i}",
            [1, 40 + i, 300],
            max_tokens=500,
            n=4,
            logprobs=5,
            temperature=1.0,
            seed=i,
        )
        await client.publish(subjects.generate, MSGPACK.encode(request), reply=inbox)
        subscriptions.append(subscription)
    for subscription in subscriptions:
        while not (await subscription.next_msg(timeout=30)).data:
            pass
    for subscription in subscriptions:  # the clients vanish: no cancel, nobody listens any more
        await subscription.unsubscribe()
    await client.flush()
    took = await wait_engine_idle(engine, within=bound)
    assert took < bound
    for i in range(8):
        assert f"request abandoned-{i}: client gone, aborting" in caplog.text
        assert f"request abandoned-{i} cancelled,cancelled,cancelled,cancelled" in caplog.text


async def test_above_max_concurrency_requests_get_overloaded_at_once(extra_worker, client) -> None:
    subjects = Subjects("ovl", "vllm", "generate")
    await extra_worker(subjects, max_concurrency=2)

    async def one(i: int) -> list[dict]:
        return [
            f
            async for f in frame_maps(
                client,
                subjects.generate,
                MSGPACK.encode(make_request(f"ovl-{i}", PROMPT, max_tokens=60)),
            )
        ]

    results = await asyncio.gather(*(one(i) for i in range(5)))
    finals = [frames[-1] for frames in results]
    overloaded = [f for f in finals if f["finish_reason"] == "error"]
    assert len(overloaded) == 3
    assert all(
        f["error"]["code"] == "overloaded" and len(r) == 1
        for f, r in zip(finals, results, strict=True)
        if f in overloaded
    )
    assert "max_concurrency 2" in overloaded[0]["error"]["message"]
    assert sorted(f["finish_reason"] for f in finals if f not in overloaded) == ["length", "length"]
    # Capacity is back once they finished.
    again = await complete(
        nats_client := client,
        make_request("ovl-again", PROMPT, max_tokens=3),
        subject=subjects.generate,
    )
    assert again.choices[0].finish_reason == "length" and nats_client.is_connected


async def test_drain_lets_requests_finish_then_ends_the_rest(extra_worker, client, engine) -> None:
    subjects = Subjects("drain", "vllm", "generate")
    worker = await extra_worker(subjects)
    short = asyncio.create_task(
        complete(
            client, make_request("drain-short", PROMPT, max_tokens=5), subject=subjects.generate
        )
    )
    first = asyncio.Event()
    long_frames: list[dict] = []

    async def long_one() -> None:
        async for frame in frame_maps(
            client,
            subjects.generate,
            MSGPACK.encode(
                make_request("drain-long", PROMPT, max_tokens=450, n=8, temperature=1.0, seed=3)
            ),
        ):
            long_frames.append(frame)
            first.set()

    long_task = asyncio.create_task(long_one())
    await asyncio.wait_for(first.wait(), 30)
    await worker.drain(timeout_s=0.3)
    assert (await short).choices[0].finish_reason == "length"
    await asyncio.wait_for(long_task, 10)
    final = long_frames[-1]
    assert final["finish_reason"] == "error" and final["error"]["code"] == "worker_shutdown"
    await wait_engine_idle(engine, within=1.0)
    with pytest.raises(nats.errors.NoRespondersError):
        await client.request(
            subjects.generate, MSGPACK.encode(make_request("late", PROMPT)), timeout=2
        )


# --- fuzzing: hostile payloads, each must get exactly one invalid_request error frame ---


@pytest.fixture(scope="module")
def fuzz_seen() -> dict[str, int]:
    """How many fuzzed payloads were invalid (sent) and valid (skipped), for the check after."""
    return {"invalid": 0, "valid": 0}


@fuzz_settings(2000)
@given(case=hostile_payloads())
async def test_fuzz_hostile_payloads_each_get_an_error_frame(
    worker, client, engine, fuzz_seen, case
) -> None:
    data, as_json = case
    if locally_valid(data, as_json, engine.limits):
        fuzz_seen["valid"] += 1
        return  # a legitimate request by chance: not what this test is about
    fuzz_seen["invalid"] += 1
    room = client.max_payload - 512  # the server counts headers too; more is a protocol error
    if len(data) > room:
        data = data[:room]
    try:
        raw = await exchange(client, SUBJECT, data, json=as_json, timeout=5)
    except Exception as error:
        raise AssertionError(f"no answer to {data[:300]!r} (json={as_json})") from error
    assert len(raw) == 1
    frame = (msgspec.json.decode if as_json else msgspec.msgpack.decode)(raw[0])
    assert frame["finish_reason"] == "error"
    assert frame["error"]["code"] == "invalid_request", frame


async def test_fuzz_ran_enough_and_worker_still_serves(worker, client, engine, fuzz_seen) -> None:
    assert fuzz_seen["invalid"] >= 2000 * 0.9, fuzz_seen
    good = await complete(
        client, make_request("after-fuzz", PROMPT, max_tokens=4, logprobs=2), subject=SUBJECT
    )
    assert good.choices[0].finish_reason == "length"
    assert engine.num_unfinished_requests() == 0


async def test_three_workers_share_sixty_requests(extra_worker, client) -> None:
    subjects = Subjects("scale", "vllm", "generate")
    workers = [await extra_worker(subjects) for _ in range(3)]
    results = await complete_all(
        client,
        subjects.generate,
        [make_request(f"scale-{i}", [1, 20 + i, 300], max_tokens=4) for i in range(60)],
    )
    assert all(
        r.choices[0].finish_reason == "length" and len(r.choices[0].token_ids) == 4 for r in results
    )
    served = [w.service.served for w in workers]
    assert sum(served) == 60 and all(count > 0 for count in served), served


async def test_nats_server_restart_mid_load(engine) -> None:
    server = NatsServer().start()
    try:
        subjects = Subjects("restart", "vllm", "generate")
        config = WorkerConfig(
            nats=NatsConfig(servers=[server.url], reconnect_wait_s=0.2), subjects=subjects
        )
        worker = await open_worker(engine, config)
        worker_nc = worker.nc
        client = await nats.connect(server.url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)
        outcomes: list[str] = []
        first = asyncio.Event()

        async def one(i: int) -> None:
            request = make_request(
                f"restart-{i}", [1, 30 + i, 300], max_tokens=450, n=4, temperature=1.0, seed=i
            )
            request.timeout_ms = 15000
            finals = []
            try:
                async for frame in generate(client, request, subject=subjects.generate, timeout=5):
                    first.set()
                    if frame.finish_reason is not None:
                        finals.append(frame.finish_reason)
                outcomes.append(",".join(finals))
            except Exception as error:  # frames lost in the outage: the client's deadline ends it
                outcomes.append(type(error).__name__)

        tasks = [asyncio.create_task(one(i)) for i in range(6)]
        await asyncio.wait_for(first.wait(), 30)
        assert worker.service.in_flight == 6  # the outage hits mid-generation
        server.kill()
        await asyncio.sleep(0.5)
        server.start()
        # Every in-flight request ends by its deadline: nothing hangs.
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert len(outcomes) == 6
        for _ in range(100):
            if worker_nc.is_connected and client.is_connected:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # resubscriptions reach the restarted server
        after = await complete(
            client, make_request("after-restart", PROMPT, max_tokens=4), subject=subjects.generate
        )
        assert after.choices[0].finish_reason == "length"
        await wait_engine_idle(engine, within=20)
        assert worker.service.in_flight == 0
        await client.close()
        await worker.stop()
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_cluster_node_dies_worker_fails_over(engine) -> None:
    route_ports = [_free_port() for _ in range(3)]
    routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in route_ports)
    nodes = [
        NatsServer(
            jetstream=False,
            extra_config=(
                f"server_name: n{i}\n"
                f"cluster {{ name: c1, listen: 127.0.0.1:{port}, routes: [{routes}] }}"
            ),
        ).start()
        for i, port in enumerate(route_ports)
    ]
    try:
        subjects = Subjects("cluster", "vllm", "generate")
        config = WorkerConfig(
            nats=NatsConfig(servers=[n.url for n in nodes], reconnect_wait_s=0.2), subjects=subjects
        )
        worker = await open_worker(engine, config)
        worker_nc = worker.nc
        victim = next(n for n in nodes if n.port == worker_nc.connected_url.port)
        survivor = next(n for n in nodes if n is not victim)
        client = await nats.connect(survivor.url)
        await asyncio.sleep(0.5)  # route interest settles
        outcomes: list[str] = []
        first = asyncio.Event()

        async def one() -> None:
            request = make_request(
                "cluster-1", PROMPT, max_tokens=450, n=8, temperature=1.0, seed=1
            )
            request.timeout_ms = 15000
            finals = []
            try:
                async for frame in generate(client, request, subject=subjects.generate, timeout=5):
                    first.set()
                    if frame.finish_reason is not None:
                        finals.append(frame.finish_reason)
                outcomes.append(",".join(finals))
            except Exception as error:  # frames lost in the outage: the client's deadline ends it
                outcomes.append(type(error).__name__)

        streaming = asyncio.create_task(one())
        await asyncio.wait_for(first.wait(), 30)
        assert worker.service.in_flight == 1  # the node dies mid-generation
        victim.kill()
        await asyncio.wait_for(streaming, 30)  # ended (final frame or the client's deadline)
        assert len(outcomes) == 1
        for _ in range(100):
            if worker_nc.is_connected and worker_nc.connected_url.port != victim.port:
                break
            await asyncio.sleep(0.1)
        assert worker_nc.connected_url.port != victim.port
        await asyncio.sleep(0.5)
        after = await complete(
            client, make_request("cluster-2", PROMPT, max_tokens=4), subject=subjects.generate
        )
        assert after.choices[0].finish_reason == "length"
        await wait_engine_idle(engine, within=20)
        await client.close()
        await worker.stop()
    finally:
        for node in nodes:
            node.stop()


async def test_server_requiring_auth_worker_connects_anonymous_refused(engine) -> None:
    server = NatsServer(
        jetstream=False, extra_config='authorization { user: worker, password: "s3cret" }'
    ).start()
    try:
        subjects = Subjects("auth", "vllm", "generate")
        config = WorkerConfig(
            nats=NatsConfig(servers=[server.url], user="worker", password="s3cret"),
            subjects=subjects,
        )
        worker = await open_worker(engine, config)
        with pytest.raises(Exception) as refused:
            await nats.connect(
                server.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2
            )
        assert "authorization" in str(refused.value).lower() or isinstance(
            refused.value, nats.errors.NoServersError
        )
        client = await nats.connect(server.url, user="worker", password="s3cret")
        served = await complete(
            client, make_request("auth-1", PROMPT, max_tokens=3), subject=subjects.generate
        )
        assert served.choices[0].finish_reason == "length"
        await client.close()
        await worker.stop()
    finally:
        server.stop()


async def test_operator_limits_a_publisher_cannot_lift(extra_worker, client) -> None:
    subjects = Subjects("limits", "vllm", "generate")
    await extra_worker(subjects, max_request_bytes=2000, max_tokens_limit=8, max_n=2)

    async def error_of(payload: bytes) -> str:
        raw = await exchange(client, subjects.generate, payload)
        frame = msgspec.msgpack.decode(raw[0])
        assert frame["finish_reason"] == "error" and frame["error"]["code"] == "invalid_request"
        return frame["error"]["message"]

    assert "exceeds max_request_bytes 2000" in await error_of(
        MSGPACK.encode(make_request("big", [300] * 1000))
    )
    assert "must be <= 8 (the worker's max_tokens limit), got 9" in await error_of(
        MSGPACK.encode(make_request("many", PROMPT, max_tokens=9))
    )
    assert "sampling_options.n: must be <= 2" in await error_of(
        MSGPACK.encode(make_request("n3", PROMPT, n=3))
    )
    # Without max_tokens the cap applies instead of the whole context.
    capped = make_request("capped", PROMPT)
    capped.stop_conditions.max_tokens = None
    result = await complete(client, capped, subject=subjects.generate)
    assert result.choices[0].usage.completion_tokens == 8


async def test_a_handler_failure_is_an_internal_error_frame_and_the_worker_serves_on(
    extra_worker, client, monkeypatch
) -> None:
    subjects = Subjects("fails", "vllm", "generate")
    served = await extra_worker(subjects)
    admit = served.service.accept

    async def broken(delivery) -> None:
        raise RuntimeError("accept broke")

    monkeypatch.setattr(served.service, "accept", broken)
    raw = await exchange(client, subjects.generate, MSGPACK.encode(make_request("x", PROMPT)))
    frame = msgspec.msgpack.decode(raw[0])
    assert frame["seq"] == 0 and frame["finish_reason"] == "error"
    assert frame["error"]["code"] == "internal_error"
    assert "accept broke" in frame["error"]["message"]
    monkeypatch.setattr(served.service, "accept", admit)
    after = await complete(
        client, make_request("y", PROMPT, max_tokens=2), subject=subjects.generate
    )
    assert after.choices[0].finish_reason == "length"
