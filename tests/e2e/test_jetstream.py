"""Durable work-queue mode on a real JetStream server with the real vLLM engine: a worker
started by its CLI is SIGKILLed mid-generation and its requests complete on a survivor (the one
real-engine variant of redelivery; its reaper takes vLLM's engine processes with it), and the
mode as discovery, the log, the client CLI and the frontend see it.

The intake itself on the fake engines (queueing, attempts, in-progress acks, poison messages,
max_deliver, load-aware pulls, malformed payloads): tests/integration/test_jetstream_intake.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import statistics
import time
from collections.abc import Awaitable

import nats
import psutil
import pytest

from messages.frames import ResponseFrame
from messages.subjects import Subjects
from tests.e2e.conftest import MIGRATED_STREAMS, MIGRATED_TOKENS, migrated_request
from tests.helpers import (
    REAPER,
    Streams,
    check_continued,
    collect,
    kill_all,
    process_text,
    read_until,
    run_client_cli,
    run_in_slices,
    settled_state,
    start_cli_worker,
    stream_state,
    wait_gone,
)
from worker.client import jetstream_generate, jetstream_stream
from worker.client.requests import make_request
from worker.config import JetStreamSettings, NatsConfig, WorkerConfig
from worker.nats.intake.jetstream import ensure_stream_and_consumer
from worker.nats.runtime import WorkerRuntime, open_worker

PROMPT = [1, 300, 301, 302]
RAW, USERS = 2, MIGRATED_STREAMS


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

    yield start
    for worker in made:
        await worker.stop()


@pytest.mark.second_session
async def test_sigkilled_worker_requests_complete_on_the_survivor(
    engine, nats_server, tiny_model, client, js_workers, undisturbed
) -> None:
    """Two kinds of publisher on one worker that dies: raw `jetstream_generate` readers (2
    requests, n=2, sampled) see the queue's redelivery (attempt 2 from token 0), and 64 user
    streams from 4 clients (`jetstream_stream`: 300 greedy tokens, logprobs 5) continue after
    the tokens they had, token for token and logprob for logprob an undisturbed run's, on
    attempt 1 throughout."""
    subjects = Subjects("jsk", "vllm", "generate")
    settings = JetStreamSettings(ack_wait_s=3.0)
    await ensure_stream_and_consumer(client.jetstream(), subjects, settings)
    proc: asyncio.subprocess.Process | None = None
    lines: list[str] = []
    family: list[psutil.Process] = []
    tasks: list[asyncio.Task[list[ResponseFrame]]] = []
    users: list[asyncio.Task[list[ResponseFrame]]] = []
    try:
        seen: dict[str, list[int]] = {}
        first_frames = asyncio.Event()
        user_clients = [await nats.connect(nats_server.url) for _ in range(4)]
        streams = Streams(USERS, at_least=4)

        def user(i: int) -> Awaitable[list[ResponseFrame]]:
            request = migrated_request(i, f"user-{i}")
            # The redelivery at ack_wait (3 s) tells these streams of the loss; a long silence
            # timeout keeps a niced worker starved on a busy CI host from being taken for dead.
            nc = user_clients[i % 4]
            stream = jetstream_stream(nc, request, subjects=subjects, silence_timeout=20.0)
            return streams.read(i, stream)

        killed = asyncio.Event()
        ends: list[tuple] = []  # (request_id, attempt, index, finish_reason): a failure's message

        async def one(i: int):
            request_id = f"kill-{i}"
            request = make_request(
                request_id,
                [1, 70 + i, 300],
                max_tokens=300,
                n=2,
                temperature=1.0,
                seed=i,
                logprobs=5,
            )
            frames = []
            # Queued before the worker starts: the first frame waits for its engine to load.
            generated = jetstream_generate(client, request, subjects=subjects, timeout=300)
            async for frame in generated:
                if frame.attempt not in seen.setdefault(request_id, []):
                    seen[request_id].append(frame.attempt)
                    frames = []  # the new attempt replaces what the old one sent
                frames.append(frame)
                if frame.finish_reason is not None:
                    ends.append((request_id, frame.attempt, frame.index, frame.finish_reason))
                if len(seen) == RAW:
                    first_frames.set()
                if not killed.is_set():
                    # Read no further until the kill: a reader that drains buffered frames
                    # without yielding would delay it past the end of a stream on a slow host.
                    await killed.wait()
            return frames

        # Every request is queued before the worker starts, so that it takes them all in its
        # first pull (a starved test publishes slowly, and on a running worker the first would
        # end before the last came); then it runs in slices, so that every stream is mid-flight
        # when it dies.
        tasks = [asyncio.create_task(one(i)) for i in range(RAW)]
        users = [asyncio.create_task(user(i)) for i in range(USERS)]
        while (await stream_state(client, subjects, settings))[0].messages < RAW + USERS:
            await asyncio.sleep(0.05)
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
            str(RAW + USERS),
            own_session=True,  # its own process group: the worker and vLLM's engine process
        )
        await read_until(proc.stdout, r"vllm-nats-worker ready: .* \(jetstream\)", lines, 300)
        rest = asyncio.create_task(collect(proc.stdout, lines))
        family = psutil.Process(proc.pid).children(recursive=True)
        cores = [p for p in family if "EngineCore" in process_text(p)]
        reapers = [p for p in family if "worker.engine.reaper" in process_text(p)]
        assert len(reapers) == 1 and cores, [process_text(p) for p in family]
        consumer_seq = 0
        while consumer_seq < RAW + USERS:
            consumer_seq = (await stream_state(client, subjects, settings))[
                1
            ].delivered.consumer_seq
            await asyncio.sleep(0.02)
        os.killpg(proc.pid, signal.SIGSTOP)
        await run_in_slices(
            proc.pid,
            lambda: first_frames.is_set() and streams.started.is_set(),
            lambda: sum(streams.received) + sum(len(attempts) for attempts in seen.values()),
        )
        # The host dies mid-generation (nothing acked): stopped, the stream shows what it had
        # acked at the moment of death; then the main process alone is killed, and its reaper
        # (own session, not stopped) kills vLLM's engine processes, which have no parent-death
        # handling of their own.
        _, consumer = await stream_state(client, subjects, settings)
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        killed_at = time.monotonic()
        killed.set()
        assert consumer.num_ack_pending == RAW + USERS, "a stream ended before the kill"
        assert max(streams.received) < MIGRATED_TOKENS
        left = await asyncio.to_thread(wait_gone, family, 15)
        assert left == [], [process_text(p) for p in left]
        await asyncio.wait_for(rest, 15)  # every holder of the worker's stdout is gone
        reaped = [line for line in lines if line.startswith(REAPER)]
        assert len(reaped) == 1 and all(f"{p.pid} (" in reaped[0] for p in cores), reaped
        await js_workers(engine, subjects, settings, capacity=RAW + USERS)  # the survivor
        results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        continued = await asyncio.wait_for(asyncio.gather(*users), 180)
        for i, frames in enumerate(continued):
            assert {f.attempt for f in frames} == {1}
            check_continued(undisturbed[i], len(migrated_request(i).token_ids), frames)
        stalls = streams.stalls(killed_at)
        p50, p99 = statistics.median(stalls), statistics.quantiles(stalls, n=100)[98]
        print(f"\njetstream: {USERS} streams continued; stall at the seam p50 {p50:.2f} s, "
              f"p99 {p99:.2f} s")  # fmt: skip
        for i, frames in enumerate(results):
            assert seen[f"kill-{i}"] == [1, 2], (seen, ends, "".join(lines[-40:]))
            tokens = {c: 0 for c in range(2)}
            finals = {}
            for frame in frames:
                assert frame.attempt == 2
                assert len(frame.log_probs) == len(frame.top_logprobs) == len(frame.token_ids)
                tokens[frame.index] += len(frame.token_ids)
                if frame.finish_reason is not None:
                    finals[frame.index] = frame.finish_reason
            assert finals == {c: "length" for c in range(2)}
            assert tokens == {c: 300 for c in range(2)}  # one complete answer per choice
        state, consumer = await settled_state(client, subjects, settings)
        assert state.messages == 0 and consumer.num_ack_pending == 0  # 0 lost, 0 left
        for nc in user_clients:
            await nc.close()
    finally:
        for task in (*tasks, *users):  # a failed run leaves no reader in the session's loop
            task.cancel()
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        kill_all(family)  # the reaper runs in its own session


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
