"""The durable work-queue intake (worker/nats/intake/jetstream.py) on a real JetStream server,
workers on fake engines: queued requests outliving workers, the attempt on the wire, in-progress
acks past ack_wait, poison messages terminated, redelivery to max_deliver, load-aware pulls, a
failing pull loop, malformed payloads (fuzz), and the stream left empty after each."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import given
from nats.js import api

from messages.codec import MSGPACK
from messages.subjects import REPLY_HEADER, Subjects
from tests.fuzzing import (
    DEEP_JSON,
    DEEP_MSGPACK,
    fuzz_settings,
    hostile_payloads,
    locally_valid,
)
from tests.helpers import frame_list, raw_frames, settled_state, stream_state
from tests.integration.conftest import paced, queue_settings, worker_config
from worker.client import jetstream_complete
from worker.client.requests import make_request
from worker.config import JetStreamSettings
from worker.dev.fakes import AlwaysFailingFakeEngine
from worker.nats.intake.jetstream import (
    JetStreamConfigError,
    JetStreamIntake,
    ensure_stream_and_consumer,
    stream_name,
)
from worker.nats.runtime import WorkerRuntime, open_worker
from worker.service import Delivery

PROMPT = [1, 300, 301, 302]


async def queue_frames(nc, subjects: Subjects, payload: bytes, as_json: bool) -> list[dict]:
    """The frames of one request published to the work queue (with the Reply-To header)."""
    return await frame_list(nc, subjects.queue, payload, json=as_json, jetstream=True)


async def settled(nc, subjects: Subjects, settings: JetStreamSettings) -> tuple[int, int]:
    """(messages left in the stream, messages pending an ack) once the acks landed."""
    state, consumer = await settled_state(nc, subjects, settings)
    return state.messages, consumer.num_ack_pending


# --- queued requests, attempts, acks ----------------------------------------------------------


async def test_requests_queued_while_no_worker_runs_are_served_later(client, queue_worker) -> None:
    subjects = Subjects("jsq", "vllm", "generate")
    settings = JetStreamSettings()
    worker = await queue_worker(subjects, settings)
    await worker.stop()  # stream and durable consumer outlive the worker

    tasks = [
        asyncio.create_task(
            jetstream_complete(
                client,
                make_request(f"q-{i}", [1, 50 + i, 300], max_tokens=6, logprobs=2),
                subjects=subjects,
            )
        )
        for i in range(8)
    ]
    await asyncio.sleep(1.0)
    state, _ = await stream_state(client, subjects, settings)
    assert state.messages == 8 and not any(t.done() for t in tasks)
    await queue_worker(subjects, settings)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for completion, attempts in results:
        assert attempts == [1]
        choice = completion.choices[0]
        assert choice.finish_reason == "length" and len(choice.token_ids) == 6 == len(
            choice.log_probs
        )
    state, consumer = await settled_state(client, subjects, settings)
    assert state.messages == 0 and consumer.num_ack_pending == 0


async def test_frames_carry_the_attempt_on_the_wire(client, queue_worker) -> None:
    subjects = Subjects("jsw", "vllm", "generate")
    await queue_worker(subjects, JetStreamSettings())
    inbox = client.new_inbox()
    subscription = await client.subscribe(inbox)
    request = make_request("wire-1", PROMPT, max_tokens=3)
    ack = await client.jetstream().publish(
        subjects.queue, MSGPACK.encode(request), headers={REPLY_HEADER: inbox}
    )
    assert ack.stream == "JSW_VLLM_GENERATE"
    frames = [msgspec.msgpack.decode(d) async for d in raw_frames(subscription, timeout=30)]
    await subscription.unsubscribe()
    assert [f["attempt"] for f in frames] == [1] * len(frames)
    assert [f["seq"] for f in frames] == list(range(len(frames)))


async def test_generation_longer_than_ack_wait_is_not_redelivered(client, queue_worker) -> None:
    subjects = Subjects("jsl", "vllm", "generate")
    settings = JetStreamSettings(ack_wait_s=2.0)
    # 450 tokens at 5 ms: 2.25 s a request at least, and 10 requests over 8 slots are two
    # rounds, so the work outlasts 2 ack waits however fast the host (the real engine needed
    # n=16 to be slow enough; n=4 here keeps the fake's rows cheap).
    await queue_worker(subjects, settings, paced(0.005))
    started = time.monotonic()
    requests = [
        make_request(f"long-{i}", PROMPT, max_tokens=450, n=4, temperature=1.0, seed=i, logprobs=5)
        for i in range(10)
    ]
    results = await asyncio.gather(
        *(jetstream_complete(client, r, subjects=subjects) for r in requests)
    )
    elapsed = time.monotonic() - started
    assert elapsed > 2 * settings.ack_wait_s, (
        "the generation must outlast ack_wait to show anything"
    )
    for completion, attempts in results:
        assert attempts == [1]
        assert all(
            c.finish_reason == "length" and len(c.token_ids) == 450 for c in completion.choices
        )
    state, consumer = await settled_state(client, subjects, settings)
    assert consumer.num_redelivered == 0 and state.messages == 0


async def test_load_aware_pull_never_gives_a_busy_worker_a_second_request(
    client, queue_worker
) -> None:
    subjects = Subjects("jsa", "vllm", "generate")
    settings = JetStreamSettings()
    workers = [await queue_worker(subjects, settings, paced(0.005), capacity=1) for _ in range(2)]
    results = await asyncio.gather(
        *(
            jetstream_complete(
                client, make_request(f"la-{i}", [1, 60 + i, 300], max_tokens=80), subjects=subjects
            )
            for i in range(8)
        )
    )
    assert all(c.choices[0].finish_reason == "length" for c, _ in results)
    assert [w.service.peak_in_flight for w in workers] == [1, 1]
    assert (
        all(w.service.served > 0 for w in workers) and sum(w.service.served for w in workers) == 8
    )


async def test_messages_delivered_past_a_busy_workers_room_go_to_an_idle_peer_once(
    client, queue_worker, caplog: pytest.LogCaptureFixture
) -> None:
    """A pull request that outlives its fetch (a busy event loop flushed it after the fetch
    gave up) makes the server deliver a worker more than it has room for. Emulated here: a pull
    request for 4 messages, alive a fetch timeout (the longest a real one outlives its fetch),
    for worker A's inbox (nats-py keeps the inbox private: `PullSubscription._deliver`), while A
    and B have one slot each and every request outlasts ack_wait. Each extra is handed back at
    once, after that pull request is gone, and served once by whichever worker has room. Left
    in A's buffer they waited past ack_wait and went out again: answered at attempt 3, or
    served twice (attempts [1, 3]) with a pull request alive longer."""
    import json

    caplog.set_level(logging.INFO, logger="worker.service")
    subjects = Subjects("jsorphan", "vllm", "generate")
    settings = JetStreamSettings(ack_wait_s=2.0)
    a = await queue_worker(subjects, settings, paced(0.01), capacity=1)
    b = await queue_worker(subjects, settings, paced(0.01), capacity=1)
    assert isinstance(a.intake, JetStreamIntake) and a.intake._subscription is not None
    inbox = a.intake._subscription._deliver
    expires = int(settings.fetch_timeout_s * 1e9)
    pull = json.dumps({"batch": 4, "expires": expires}).encode()
    await client.publish(
        f"$JS.API.CONSUMER.MSG.NEXT.{stream_name(subjects, settings)}.{settings.durable}",
        pull,
        reply=inbox.decode() if isinstance(inbox, bytes) else inbox,
    )
    await client.flush()  # the server holds it now; the requests come within its second
    # 300 tokens at 10 ms: 3 s a request, past ack_wait.
    results = await asyncio.gather(
        *(
            jetstream_complete(
                client,
                make_request(f"o-{i}", [1, 60 + i, 300], max_tokens=300, logprobs=5),
                subjects=subjects,
            )
            for i in range(4)
        )
    )
    for completion, attempts in results:
        # One attempt answered (none served twice), at most the one after A's hand-back: a busy
        # worker takes nothing more from the queue only to hand it back.
        assert len(attempts) == 1 and attempts[0] <= 2, attempts
        choice = completion.choices[0]
        assert choice.finish_reason == "length" and len(choice.token_ids) == 300
        assert len(choice.log_probs) == 300 and len(choice.top_logprobs) == 300
    assert a.service.served + b.service.served == 4
    state, consumer = await settled_state(client, subjects, settings)
    assert state.messages == 0 and consumer.num_ack_pending == 0
    handed_back = [
        r.getMessage() for r in caplog.records if "left to a redelivery" in r.getMessage()
    ]
    assert handed_back and all(" overloaded, " in line for line in handed_back), handed_back


async def test_incompatible_existing_stream_is_refused_with_a_clear_message(client) -> None:
    subjects = Subjects("jsx", "vllm", "generate")
    js = client.jetstream()
    await js.add_stream(
        api.StreamConfig(
            name="JSX_VLLM_GENERATE",
            subjects=[subjects.queue],
            retention=api.RetentionPolicy.LIMITS,
        )
    )
    with pytest.raises(JetStreamConfigError) as info:
        await ensure_stream_and_consumer(js, subjects, JetStreamSettings())
    message = str(info.value)
    assert "stream JSX_VLLM_GENERATE exists but retention is limits, not workqueue" in message
    # A consumer with other settings is refused too.
    other = Subjects("jsy", "vllm", "generate")
    await ensure_stream_and_consumer(js, other, JetStreamSettings(max_deliver=3))
    with pytest.raises(JetStreamConfigError, match="max_deliver is 3, wanted 5"):
        await ensure_stream_and_consumer(js, other, JetStreamSettings(max_deliver=5))


# --- poison messages and failures ---------------------------------------------------------------


async def test_poison_request_terminated_after_max_deliver_with_error_frame(
    client, queue_worker
) -> None:
    subjects = Subjects("jsp", "vllm", "generate")
    settings = JetStreamSettings(max_deliver=3)
    fake = AlwaysFailingFakeEngine()
    await queue_worker(subjects, settings, fake)
    completion, attempts = await jetstream_complete(
        client, make_request("poison-1", PROMPT), subjects=subjects, timeout=30
    )
    assert fake.calls == 3
    assert attempts == [3]  # earlier attempts were NAKed silently; the last one answers
    assert completion.error is not None and completion.error.code == "engine_error"
    assert "always fails" in completion.error.message
    state, consumer = await settled_state(client, subjects, settings)
    assert state.messages == 0 and consumer.num_ack_pending == 0  # terminated, not left behind


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "msgpack"])
async def test_poison_message_in_jetstream_is_terminated_and_the_next_five_served(
    queue_worker, client, as_json: bool
) -> None:
    subjects = Subjects("poison", "json" if as_json else "msgpack", "generate")
    settings = JetStreamSettings()
    worker = await queue_worker(subjects, settings)
    frames = await queue_frames(client, subjects, DEEP_JSON if as_json else DEEP_MSGPACK, as_json)
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
    assert await settled(client, subjects, settings) == (0, 0)
    assert not worker.intake.failed.is_set()


async def test_a_failure_while_taking_a_message_settles_it_and_the_pull_goes_on(
    queue_worker, client, monkeypatch
) -> None:
    subjects = Subjects("takefail", "vllm", "generate")
    settings = JetStreamSettings(max_deliver=3)
    worker = await queue_worker(subjects, settings)
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
    assert await settled(client, subjects, settings) == (0, 0)


async def test_a_pull_loop_that_dies_anyway_marks_the_intake_failed(
    queue_worker, client, monkeypatch
) -> None:
    subjects = Subjects("pulldies", "vllm", "generate")
    worker = await queue_worker(subjects, JetStreamSettings())
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


# --- malformed payloads through the JetStream intake --------------------------------------------


@dataclass
class FuzzQueue:
    subjects: Subjects
    settings: JetStreamSettings
    worker: WorkerRuntime
    invalid: int = 0
    valid: int = 0


@pytest.fixture(scope="module")
async def fuzz_queue(nats_server):
    subjects = Subjects("fuzzq", "vllm", "generate")
    settings = JetStreamSettings()
    # The tiny model's limits, no pace: a payload valid by chance is never sent (it is skipped).
    config = worker_config(nats_server.url, subjects, **queue_settings(settings))
    worker = await open_worker(paced(0.0), config)
    yield FuzzQueue(subjects, settings, worker)
    await worker.stop()


@fuzz_settings(300)
@given(case=hostile_payloads())
async def test_fuzz_the_jetstream_intake_each_gets_invalid_request_and_is_terminated(
    fuzz_queue: FuzzQueue, client, case
) -> None:
    data, as_json = case
    # The fake engine refuses nothing of its own (vLLM also refuses huge temperatures): what the
    # worker admits is served, so only what the worker itself must refuse is sent.
    if locally_valid(data, as_json, fuzz_queue.worker.service.limits, engine_checks=False):
        fuzz_queue.valid += 1
        return
    fuzz_queue.invalid += 1
    room = client.max_payload - 1024  # headers count too
    frames = await queue_frames(client, fuzz_queue.subjects, data[:room], as_json)
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
    assert await settled(client, fuzz_queue.subjects, fuzz_queue.settings) == (0, 0)
    completion, attempts = await jetstream_complete(
        client, make_request("after-fuzz", PROMPT, max_tokens=4), subjects=fuzz_queue.subjects
    )
    assert completion.choices[0].finish_reason == "length" and attempts == [1]
