"""A request's lifecycle on a real nats-server, workers on the paced fake engine (a token every
10 ms, logprob rows when asked, so a request is in flight for a known time on any host):
deadlines, abandoned streams found by the liveness prober, max_concurrency refusals, drain."""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import pytest

from messages.codec import MSGPACK
from messages.subjects import Subjects
from tests.helpers import frame_maps, wait_engine_idle
from worker.client import complete
from worker.client.requests import make_request
from worker.nats.liveness import Liveness

PROMPT = [1, 300, 301, 302]


async def test_deadline_aborts_the_request(fake_worker, client) -> None:
    subjects = Subjects("deadline", "vllm", "generate")
    worker = await fake_worker(subjects)
    request = make_request("deadline-1", PROMPT, max_tokens=400)
    request.timeout_ms = 300
    started = time.monotonic()
    frames = [f async for f in frame_maps(client, subjects.generate, MSGPACK.encode(request))]
    elapsed = time.monotonic() - started
    final = frames[-1]
    assert final["finish_reason"] == "cancelled"
    assert final["error"]["code"] == "deadline_exceeded"
    assert sum(len(f["token_ids"]) for f in frames) < 400
    assert elapsed < 2.0
    await wait_engine_idle(worker.service.engine, within=1.0)


async def test_abandoned_streams_are_detected_and_aborted(fake_worker, client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="worker.service")
    subjects = Subjects("liveness", "vllm", "generate")
    # Detection must beat the streams' end: a tight probe cycle (0.1 s, grace 0.2 s) and
    # 4 x 500 tokens per request with logprobs 5 at the fake's 10 ms a token (5 s), which
    # outlast several cycles.
    worker = await fake_worker(
        subjects,
        liveness_interval_s=0.1,
        liveness_timeout_s=0.1,
        client_gone_grace_s=0.2,
        log_requests=True,  # each request's outcome line (`--enable-log-requests`)
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
    took = await wait_engine_idle(worker.service.engine, within=bound)
    assert took < bound
    for i in range(8):
        assert f"request abandoned-{i}: client gone, aborting" in caplog.text
        assert f"request abandoned-{i} cancelled,cancelled,cancelled,cancelled" in caplog.text


async def test_a_probe_held_up_past_its_timeout_never_answers_that_someone_listens(
    client,
) -> None:
    """The positive answer rests on the broker's order (worker/nats/liveness.py): a worker whose
    event loop is held while "no responders" waits unread in its socket must not take the
    silence for a listener, or it publishes a client's frames to nobody after an outage."""
    liveness = Liveness(
        client, interval_s=1.0, probe_timeout_s=0.05, grace_s=1.0, outage_wait_s=1.0
    )
    listening = await client.subscribe(client.new_inbox())
    await client.flush()
    answers: dict[tuple[bool, float], bool | None] = {}
    for listens, reply in ((False, client.new_inbox()), (True, listening.subject)):
        for hold_s in (0.0, 0.2):
            probe = asyncio.ensure_future(liveness.listened(reply))
            await asyncio.sleep(0)  # the probe is sent...
            time.sleep(hold_s)  # ...and the loop is held past the probe's timeout
            answers[listens, hold_s] = await probe
    # Nobody listens: "nobody", or no answer when held; never "someone". And the reverse.
    assert answers[False, 0.0] is False and answers[False, 0.2] in (False, None), answers
    assert answers[True, 0.0] is True and answers[True, 0.2] in (True, None), answers
    await listening.unsubscribe()


async def test_above_max_concurrency_requests_get_overloaded_at_once(fake_worker, client) -> None:
    subjects = Subjects("ovl", "vllm", "generate")
    await fake_worker(subjects, max_concurrency=2)

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


async def test_drain_lets_requests_finish_then_ends_the_rest(fake_worker, client) -> None:
    subjects = Subjects("drain", "vllm", "generate")
    worker = await fake_worker(subjects)
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
    await wait_engine_idle(worker.service.engine, within=1.0)
    with pytest.raises(nats.errors.NoRespondersError):
        await client.request(
            subjects.generate, MSGPACK.encode(make_request("late", PROMPT)), timeout=2
        )
