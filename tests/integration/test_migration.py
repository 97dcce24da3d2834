"""A request continues on another worker when the one serving it dies or drains (the client
library's migration, worker/client/migration.py), on a real nats-server with paced fake engines.

The worker that dies is a process of its own, SIGKILLed mid-stream: its connection goes away as a
dead host's does. The fake engine's tokens follow the context position, so a continuation must
go on with exactly the tokens an undisturbed run has (`expected`). The same on the real engine:
tests/e2e/test_migration.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import nats
import pytest

from messages.frames import ResponseFrame
from messages.subjects import Subjects
from tests.helpers import Streams, settled_state
from tests.integration.conftest import paced, queue_settings
from worker.client import RequestError, generate, jetstream_stream
from worker.client.requests import make_request
from worker.config import JetStreamSettings
from worker.dev.fakes import PacedFakeEngine

ROOT = Path(__file__).resolve().parents[2]
SILENCE_S = 1.0
"""The clients' silence timeout here; the workers beat every 0.2 s (HEARTBEAT)."""
KILL_SILENCE_S = 2.0
"""The silence timeout of the SIGKILL tests, whose survivor runs in the test's own process: on a
busy CI host a 1 s timeout took a starved survivor for dead too."""
HEARTBEAT = {"heartbeat_interval_s": 0.2}
TOKENS = 300

WORKER_PROCESS = textwrap.dedent(
    """
    import asyncio, signal, sys
    from messages.subjects import Subjects
    from worker.config import JetStreamSettings, NatsConfig, WorkerConfig
    from worker.dev.fakes import PacedFakeEngine
    from worker.nats.runtime import open_worker

    async def main(url, namespace, mode, ack_wait):
        queue = JetStreamSettings(ack_wait_s=float(ack_wait))
        config = WorkerConfig(
            nats=NatsConfig(servers=[url]),
            subjects=Subjects(namespace, "vllm", "generate"),
            heartbeat_interval_s=0.2,
            jetstream=queue if mode == "jetstream" else None,
        )
        runtime = await open_worker(PacedFakeEngine(0.01), config)
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main(*sys.argv[1:]))
    """
)


@pytest.fixture
async def worker_process(nats_server) -> AsyncIterator[Callable[..., object]]:
    """Starts a fake-engine worker in a process of its own: `await worker_process(namespace,
    mode="core")`; SIGKILL it to kill the worker as a host dies. Killed after the test."""
    made: list[subprocess.Popen[str]] = []

    async def start(
        namespace: str, mode: str = "core", ack_wait: float = 30.0
    ) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER_PROCESS, nats_server.url, namespace, mode, str(ack_wait)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        made.append(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line == "ready\n", line
        return proc

    yield start
    for proc in made:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def expected(prompt: list[int], count: int = TOKENS) -> list[int]:
    """An undisturbed run's tokens on the paced fake engine."""
    return [100 + (len(prompt) + i) % 50 for i in range(count)]


def prompt_of(i: int) -> list[int]:
    return [1, 40 + i, 300, 301 + i % 3]


def check_one_stream(prompt: list[int], frames: list[ResponseFrame]) -> None:
    """One undisturbed-looking stream: seq 0…, the undisturbed tokens, aligned logprob rows, one
    final frame `length` with the original prompt's usage, no error."""
    assert [f.seq for f in frames] == list(range(len(frames)))
    assert not any(f.error for f in frames)
    assert sum((f.token_ids for f in frames), []) == expected(prompt)
    assert all(len(f.log_probs) == len(f.top_logprobs) == len(f.token_ids) for f in frames)
    assert [f.finish_reason for f in frames if f.finish_reason] == ["length"]
    usage = frames[-1].completion_usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), TOKENS)


async def test_a_sigkilled_worker_s_streams_continue_on_the_other(
    nats_server, fake_worker, worker_process, caplog
) -> None:
    """16 streams from two clients, 300 tokens with logprobs 5 each, across two workers; one
    worker's process is SIGKILLed when every stream is mid-flight."""
    caplog.set_level(logging.INFO, logger="worker.client.library")
    subjects = Subjects("migrate", "vllm", "generate")
    doomed = await worker_process("migrate")
    await fake_worker(subjects, **HEARTBEAT)
    clients = [await nats.connect(nats_server.url) for _ in range(2)]
    streams = Streams(16)

    def one(i: int) -> Awaitable[list[ResponseFrame]]:
        request = make_request(f"m-{i}", prompt_of(i), max_tokens=TOKENS, logprobs=5)
        nc = clients[i % 2]
        return streams.read(
            i, generate(nc, request, subject=subjects.generate, silence_timeout=KILL_SILENCE_S)
        )

    try:
        tasks = [asyncio.create_task(one(i)) for i in range(16)]
        await asyncio.wait_for(streams.started.wait(), 30)
        assert max(streams.received) < TOKENS // 2  # every stream is mid-flight at the kill
        doomed.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for i, frames in enumerate(results):
            check_one_stream(prompt_of(i), frames)
        migrated = caplog.text.count("continued on another worker")
        assert 0 < migrated < 16, caplog.text  # the queue group gave the dead worker a share
        # Noticed within the silence timeout, then 300 tokens at 10 ms on the survivor.
        assert time.monotonic() - killed_at < KILL_SILENCE_S + 3 * TOKENS * 0.01 + 5
    finally:
        for nc in clients:
            await nc.close()


async def test_heartbeats_keep_a_slow_prefill_and_a_slow_step_from_being_taken_for_death(
    fake_worker, client
) -> None:
    """A first token 2.5 s late and a token every 1.5 s, against a 1 s silence timeout: one
    engine request each, no continuation."""
    subjects = Subjects("slow", "vllm", "generate")
    engine = PacedFakeEngine(1.5, limits=paced().limits, prefill_s=2.5)
    await fake_worker(subjects, engine, **HEARTBEAT)
    request = make_request("slow-1", [1, 2, 3], max_tokens=2, logprobs=1)
    frames = [
        f
        async for f in generate(
            client, request, subject=subjects.generate, silence_timeout=SILENCE_S
        )
    ]
    assert sum((f.token_ids for f in frames), []) == expected([1, 2, 3], 2)
    assert frames[-1].finish_reason == "length"
    assert engine.requests == 1


async def test_a_drain_that_times_out_hands_its_streams_to_another_worker(
    fake_worker, client, caplog
) -> None:
    """The draining worker ends its open streams with `worker_shutdown` after 0.3 s; the
    clients continue them on the other worker and see no error."""
    caplog.set_level(logging.INFO, logger="worker.client.library")
    subjects = Subjects("handover", "vllm", "generate")
    draining = await fake_worker(subjects, drain_timeout_s=0.3, **HEARTBEAT)
    await fake_worker(subjects, **HEARTBEAT)
    streams = Streams(8)

    def one(i: int) -> Awaitable[list[ResponseFrame]]:
        request = make_request(f"h-{i}", prompt_of(i), max_tokens=TOKENS, logprobs=5)
        return streams.read(i, generate(client, request, subject=subjects.generate))

    tasks = [asyncio.create_task(one(i)) for i in range(8)]
    await asyncio.wait_for(streams.started.wait(), 30)
    await draining.stop()
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    for i, frames in enumerate(results):
        check_one_stream(prompt_of(i), frames)
    assert "worker_shutdown" in caplog.text and "continued on another worker" in caplog.text


@pytest.mark.parametrize("limit", [3, 0])
async def test_with_no_worker_left_the_caller_gets_one_retryable_error_in_bounded_time(
    client, worker_process, limit: int
) -> None:
    """The only worker is SIGKILLed: its continuation finds nobody (`no_workers`), or, with
    migration off, the loss itself is the error (`worker_lost`); both retryable, within the
    silence timeout and a second."""
    namespace = f"alone{limit}"
    subjects = Subjects(namespace, "vllm", "generate")
    proc = await worker_process(namespace)
    request = make_request("alone", [1, 2, 3], max_tokens=TOKENS, logprobs=5)
    frames = generate(
        client,
        request,
        subject=subjects.generate,
        silence_timeout=SILENCE_S,
        migration_limit=limit,
    )
    assert (await anext(frames)).seq == 0
    proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(RequestError) as caught:
        async for _ in frames:
            pass
    assert time.monotonic() - killed_at < SILENCE_S + 1.0
    assert caught.value.code == ("no_workers" if limit else "worker_lost")


async def test_jetstream_a_sigkilled_worker_s_streams_continue_without_a_restart(
    nats_server, fake_worker, worker_process, caplog
) -> None:
    """Work-queue mode: the worker serving every stream is SIGKILLed; each continuation is a
    new queue message, taken by the survivor before the dead worker's messages are redelivered
    (ack_wait 3 s), and no frame of a redelivery can reach the caller: every stream stays on
    attempt 1. The redeliveries themselves are terminated unrun: nobody listens on their
    reply subjects any more."""
    caplog.set_level(logging.INFO)
    namespace = "jsmigrate"
    subjects = Subjects(namespace, "vllm", "generate")
    settings = JetStreamSettings(ack_wait_s=3.0)
    doomed = await worker_process(namespace, "jetstream", ack_wait=3.0)
    clients = [await nats.connect(nats_server.url) for _ in range(2)]
    streams = Streams(8)

    def one(i: int) -> Awaitable[list[ResponseFrame]]:
        request = make_request(f"j-{i}", prompt_of(i), max_tokens=TOKENS, logprobs=5)
        nc = clients[i % 2]
        return streams.read(
            i, jetstream_stream(nc, request, subjects=subjects, silence_timeout=KILL_SILENCE_S)
        )

    try:
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        await asyncio.wait_for(streams.started.wait(), 30)
        engine = paced()
        await fake_worker(subjects, engine, **queue_settings(settings, 16), **HEARTBEAT)
        os.kill(doomed.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 25)
        for i, frames in enumerate(results):
            check_one_stream(prompt_of(i), frames)
            assert {f.attempt for f in frames} == {1}
        assert caplog.text.count("continued on another worker") == 8
        state, consumer = await settled_state(clients[0], subjects, settings)
        assert state.messages == 0 and consumer.num_ack_pending == 0
        assert caplog.text.count("nobody listens on its reply subject any more") == 8
        assert engine.requests == 8  # the continuations only
    finally:
        for nc in clients:
            await nc.close()
