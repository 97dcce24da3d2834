"""Request lifecycle under the real vLLM engine's generation, on the real nats-server: fifty
cancels free vLLM's scheduler, and a broker restart mid-generation ends every request (the
one real-engine variant of a broker outage).

The transport's and the worker's own lifecycle on the fake engines (deadlines, abandoned
streams, max_concurrency, drain, queue groups, outages, failover, auth, fuzzing) are the
integration layer's: tests/integration/test_worker_lifecycle.py, test_cancel_routing.py,
test_core_intake.py, test_broker_connection.py and test_malformed_payloads.py."""

from __future__ import annotations

import asyncio
import time

import nats
from prometheus_client import REGISTRY

from messages.codec import MSGPACK
from messages.request import CancelRequest
from messages.subjects import Subjects
from tests.helpers import TEST_SUBJECTS, final_reasons, frame_maps, wait_engine_idle
from worker.client import complete
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
            outcomes.append(await final_reasons(client, request, subjects.generate, first))

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
