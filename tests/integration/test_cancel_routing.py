"""Cancels on a real nats-server, workers on the paced fake engine: a client that stops reading
cancels its request and the engine is freed; a cancel binds to its publisher (the request's
reply subject), so an equal request id of another publisher runs on. (Fifty cancels freeing the
real engine's scheduler: tests/e2e/test_lifecycle.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS

from messages.codec import MSGPACK
from messages.request import CancelRequest
from messages.subjects import Subjects
from tests.helpers import raw_frames, wait_engine_idle
from tests.integration.conftest import paced
from worker.client import generate, is_probe
from worker.client.requests import make_request

PROMPT = [1, 300, 301, 302]


@pytest.fixture
async def publishers(nats_server) -> AsyncIterator[tuple[NATS, NATS]]:
    """Two client connections, two publishers of requests with the same id."""
    first = await nats.connect(nats_server.url)
    second = await nats.connect(nats_server.url)
    yield first, second
    await first.close()
    await second.close()


async def _rest_of(subscription) -> list[dict]:
    return [msgspec.msgpack.decode(data) async for data in raw_frames(subscription, timeout=30)]


async def test_client_that_stops_iterating_cancels_its_request(fake_worker, client) -> None:
    subjects = Subjects("break", "vllm", "generate")
    worker = await fake_worker(subjects)
    count = 0
    async for _frame in generate(
        client, make_request("break-1", PROMPT, max_tokens=400), subject=subjects.generate
    ):
        count += 1
        if count == 3:
            break
    await wait_engine_idle(worker.service.engine, within=1.0)


async def test_a_cancel_does_not_reach_another_publishers_request_of_the_same_id(
    fake_worker, publishers
) -> None:
    subjects = Subjects("sameid", "vllm", "generate")
    await fake_worker(subjects, paced(0.005))  # 300 tokens: 1.5 s
    first, second = publishers
    request = make_request("same-id", PROMPT, max_tokens=300, logprobs=5)
    subs = []
    for nc in (first, second):
        inbox = nc.new_inbox()
        subs.append((inbox, await nc.subscribe(inbox)))
        await nc.publish(subjects.generate, MSGPACK.encode(request), reply=inbox)
    for _, sub in subs:  # both are running
        while is_probe(await sub.next_msg(timeout=30)):
            pass
    cancel = CancelRequest(request_id="same-id", reply_subject=subs[0][0])
    await first.publish(subjects.cancel, MSGPACK.encode(cancel))
    cancelled = await _rest_of(subs[0][1])
    kept = await _rest_of(subs[1][1])
    assert cancelled[-1]["finish_reason"] == "cancelled"
    assert kept[-1]["finish_reason"] == "length"
    assert kept[-1]["completion_usage"]["completion_tokens"] == 300
    # A cancel without the reply subject is refused by the decoder, not applied to all.
    with pytest.raises(msgspec.ValidationError, match="reply_subject"):
        MSGPACK.decode_cancel(MSGPACK.encode({"request_id": "same-id"}))


async def test_the_client_library_cancels_only_its_own_request(fake_worker, publishers) -> None:
    subjects = Subjects("libsameid", "vllm", "generate")
    await fake_worker(subjects, paced(0.005))  # 300 tokens: 1.5 s
    first, second = publishers
    request = make_request("lib-same-id", PROMPT, max_tokens=300, logprobs=5)

    async def stop_early() -> None:
        async for frame in generate(first, request, subject=subjects.generate):
            if frame.token_ids:
                break  # leaving early publishes the cancel

    async def read_all():
        return [f async for f in generate(second, request, subject=subjects.generate)]

    kept, _ = await asyncio.gather(read_all(), stop_early())
    assert kept[-1].finish_reason == "length"
    assert kept[-1].completion_usage.completion_tokens == 300
