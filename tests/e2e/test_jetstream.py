"""Durable work-queue mode on a real JetStream server (real vLLM engine where it matters)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time

import msgspec
import pytest
from nats.js import api

from messages.codec import MSGPACK
from messages.subjects import REPLY_HEADER, Subjects
from tests.helpers import collect, raw_frames, read_until, run_client_cli, start_cli_worker
from worker.client import jetstream_complete, jetstream_generate
from worker.client.requests import make_request
from worker.config import JetStreamSettings, NatsConfig, WorkerConfig
from worker.dev.fakes import AlwaysFailingFakeEngine
from worker.nats.intake.jetstream import (
    JetStreamConfigError,
    ensure_stream_and_consumer,
    stream_name,
)
from worker.nats.runtime import WorkerRuntime, open_worker

PROMPT = [1, 300, 301, 302]


@pytest.fixture
async def js_workers(nats_server):
    """Starts JetStream-mode workers (own connections); stops them after the test."""
    made = []

    async def start(
        engine, subjects: Subjects, settings: JetStreamSettings, capacity: int = 8
    ) -> WorkerRuntime:
        config = WorkerConfig(
            nats=NatsConfig(servers=[nats_server.url]),
            subjects=subjects,
            max_concurrency=capacity,
            jetstream=dataclasses.replace(settings, capacity=capacity),
        )
        worker = await open_worker(engine, config)
        made.append(worker)
        return worker

    async def stop(worker: WorkerRuntime) -> None:
        if worker in made:
            made.remove(worker)
            await worker.stop()

    start.stop = stop  # type: ignore[attr-defined]
    yield start
    for worker in made:
        await worker.stop()


async def stream_state(client, subjects: Subjects, settings: JetStreamSettings):
    js = client.jetstream()
    name = stream_name(subjects, settings)
    return (await js.stream_info(name)).state, await js.consumer_info(name, settings.durable)


async def settled_state(client, subjects: Subjects, settings: JetStreamSettings):
    """Stream state once the last acks landed: a worker acks just after the final frame, so the
    client may see its answer a moment before the stream does."""
    deadline = time.monotonic() + 5.0
    while True:
        state, consumer = await stream_state(client, subjects, settings)
        if (state.messages == 0 and consumer.num_ack_pending == 0) or time.monotonic() > deadline:
            return state, consumer
        await asyncio.sleep(0.05)


async def test_requests_queued_while_no_worker_runs_are_served_later(
    engine, client, js_workers
) -> None:
    subjects = Subjects("jsq", "vllm", "generate")
    settings = JetStreamSettings()
    worker = await js_workers(engine, subjects, settings)
    await js_workers.stop(worker)  # stream and durable consumer outlive the worker

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
    await js_workers(engine, subjects, settings)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for completion, attempts in results:
        assert attempts == [1]
        choice = completion.choices[0]
        assert choice.finish_reason == "length" and len(choice.token_ids) == 6 == len(
            choice.log_probs
        )
    state, consumer = await settled_state(client, subjects, settings)
    assert state.messages == 0 and consumer.num_ack_pending == 0


async def test_frames_carry_the_attempt_on_the_wire(engine, client, js_workers) -> None:
    subjects = Subjects("jsw", "vllm", "generate")
    await js_workers(engine, subjects, JetStreamSettings())
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


async def test_generation_longer_than_ack_wait_is_not_redelivered(
    engine, client, js_workers
) -> None:
    subjects = Subjects("jsl", "vllm", "generate")
    settings = JetStreamSettings(ack_wait_s=2.0)
    await js_workers(engine, subjects, settings)
    started = time.monotonic()
    requests = [
        make_request(f"long-{i}", PROMPT, max_tokens=450, n=16, temperature=1.0, seed=i, logprobs=5)
        for i in range(10)  # enough work to outlast 2 ack waits even on a fast host
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


async def test_poison_request_terminated_after_max_deliver_with_error_frame(
    client, js_workers
) -> None:
    subjects = Subjects("jsp", "vllm", "generate")
    settings = JetStreamSettings(max_deliver=3)
    fake = AlwaysFailingFakeEngine()
    await js_workers(fake, subjects, settings)
    completion, attempts = await jetstream_complete(
        client, make_request("poison-1", PROMPT), subjects=subjects, timeout=30
    )
    assert fake.calls == 3
    assert attempts == [3]  # earlier attempts were NAKed silently; the last one answers
    assert completion.error is not None and completion.error.code == "engine_error"
    assert "always fails" in completion.error.message
    state, consumer = await settled_state(client, subjects, settings)
    assert state.messages == 0 and consumer.num_ack_pending == 0  # terminated, not left behind


async def test_load_aware_pull_never_gives_a_busy_worker_a_second_request(
    engine, client, js_workers
) -> None:
    subjects = Subjects("jsa", "vllm", "generate")
    settings = JetStreamSettings()
    workers = [await js_workers(engine, subjects, settings, capacity=1) for _ in range(2)]
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


async def test_sigkilled_worker_requests_complete_on_the_survivor(
    engine, nats_server, tiny_model, client, js_workers
) -> None:
    subjects = Subjects("jsk", "vllm", "generate")
    settings = JetStreamSettings(ack_wait_s=3.0)
    proc = await start_cli_worker(
        nats_server.url,
        tiny_model,
        "--mode",
        "jetstream",
        "--namespace",
        "jsk",
        "--js-ack-wait",
        "3",
        "--max-concurrency",
        "4",
        own_session=True,  # its own process group: the worker and vLLM's engine process
    )
    lines: list[str] = []
    try:
        await read_until(proc.stdout, r"vllm-nats-worker ready: .* \(jetstream\)", lines, 300)
        rest = asyncio.create_task(collect(proc.stdout, lines))
        seen: dict[str, list[int]] = {}
        first_frames = asyncio.Event()
        killed = asyncio.Event()
        ends: list[tuple] = []  # (request_id, attempt, index, finish_reason): a failure's message

        async def one(i: int):
            request_id = f"kill-{i}"
            request = make_request(
                request_id,
                [1, 70 + i, 300],
                max_tokens=450,
                n=8,
                temperature=1.0,
                seed=i,
                logprobs=5,
            )
            frames = []
            async for frame in jetstream_generate(client, request, subjects=subjects, timeout=60):
                if frame.attempt not in seen.setdefault(request_id, []):
                    seen[request_id].append(frame.attempt)
                    frames = []  # the new attempt replaces what the old one sent
                frames.append(frame)
                if frame.finish_reason is not None:
                    ends.append((request_id, frame.attempt, frame.index, frame.finish_reason))
                if len(seen) == 4:
                    first_frames.set()
                if not killed.is_set():
                    # Read no further until the kill: a reader that drains buffered frames
                    # without yielding would delay it past the end of a stream on a slow host.
                    await killed.wait()
            return frames

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.wait_for(first_frames.wait(), 120)
        # The host dies mid-generation (nothing acked): every process of the group, since
        # vLLM's engine process outlives a killed parent. Stopped first, so that the stream
        # shows what it had acked at the moment of death.
        os.killpg(proc.pid, signal.SIGSTOP)
        _, consumer = await stream_state(client, subjects, settings)
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        killed.set()
        rest.cancel()
        assert consumer.num_ack_pending == 4, "a stream ended before the kill"
        await js_workers(engine, subjects, settings)  # the survivor
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for i, frames in enumerate(results):
            assert seen[f"kill-{i}"] == [1, 2], (seen, ends, "".join(lines[-40:]))
            tokens = {c: 0 for c in range(8)}
            finals = {}
            for frame in frames:
                assert frame.attempt == 2
                assert len(frame.log_probs) == len(frame.top_logprobs) == len(frame.token_ids)
                tokens[frame.index] += len(frame.token_ids)
                if frame.finish_reason is not None:
                    finals[frame.index] = frame.finish_reason
            assert finals == {c: "length" for c in range(8)}
            assert tokens == {c: 450 for c in range(8)}  # one complete answer per choice
        state, consumer = await settled_state(client, subjects, settings)
        assert state.messages == 0 and consumer.num_ack_pending == 0  # 0 lost, 0 left
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


async def test_jetstream_mode_seen_from_outside(
    engine, client, js_workers, nats_server, tiny_model, caplog
) -> None:
    """Discovery says a worker takes requests from a work queue (and which), the log line
    names the stream instead of "no subject", and the client CLI and the frontend can publish
    to the queue (--jetstream)."""
    import json
    import logging

    import httpx

    from worker.frontend.app import FrontendSettings, create_app
    from worker.frontend.tokenizer import ModelTokenizer

    subjects = Subjects("jsseen", "vllm", "generate")
    settings = JetStreamSettings()
    with caplog.at_level(logging.INFO, logger="worker.nats.runtime"):
        worker = await js_workers(engine, subjects, settings)
    assert (
        "serving JetStream stream JSSEEN_VLLM_GENERATE (consumer vllm-workers, "
        "jsseen.vllm.queue.generate) as vllm-nats-worker" in caplog.text
    )
    infos = []
    inbox = client.new_inbox()
    subscription = await client.subscribe(inbox)
    await client.publish("$SRV.INFO.vllm-nats-worker", b"", reply=inbox)
    try:
        while True:
            infos.append(json.loads((await subscription.next_msg(timeout=1)).data))
    except Exception:  # the answers are over
        pass
    await subscription.unsubscribe()
    (info,) = [i for i in infos if i["metadata"]["instance_id"] == worker.config.instance_id]
    assert info["metadata"]["mode"] == "jetstream"
    assert info["metadata"]["stream"] == "JSSEEN_VLLM_GENERATE"
    assert info["metadata"]["consumer"] == "vllm-workers"
    assert info["metadata"]["queue_subject"] == "jsseen.vllm.queue.generate"
    assert info["endpoints"] == []  # nothing is served on the core subjects

    done = await asyncio.to_thread(
        run_client_cli, nats_server.url, "--subject", subjects.generate, "--jetstream",
        "--token-ids", "1,300", "--max-tokens", "3", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    frames = [json.loads(line) for line in done.stdout.splitlines()]
    assert [f["attempt"] for f in frames] == [1, 1, 1]
    assert frames[-1]["finish_reason"] == "length"

    app = create_app(
        FrontendSettings(model_names=(str(tiny_model),), subject=subjects.generate, jetstream=True),
        ModelTokenizer.load(tiny_model),
        nc=client,
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://frontend", timeout=60
    ) as http:
        answer = await http.post(
            "/v1/completions",
            json={"model": str(tiny_model), "prompt": "Hi", "max_tokens": 4, "ignore_eos": True},
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert answer.json()["usage"]["completion_tokens"] == 4
    state, consumer = await settled_state(client, subjects, settings)
    assert state.messages == 0 and consumer.num_ack_pending == 0
