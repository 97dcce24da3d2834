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

import psutil
import pytest

from messages.subjects import Subjects
from tests.helpers import (
    REAPER,
    collect,
    kill_all,
    process_text,
    read_until,
    run_client_cli,
    settled_state,
    start_cli_worker,
    stream_state,
    wait_gone,
)
from worker.client import jetstream_generate
from worker.client.requests import make_request
from worker.config import JetStreamSettings, NatsConfig, WorkerConfig
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

    yield start
    for worker in made:
        await worker.stop()


@pytest.mark.second_session  # CI: beside the integration layer, to even the jobs out
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
    family: list[psutil.Process] = []
    try:
        await read_until(proc.stdout, r"vllm-nats-worker ready: .* \(jetstream\)", lines, 300)
        rest = asyncio.create_task(collect(proc.stdout, lines))
        family = psutil.Process(proc.pid).children(recursive=True)
        cores = [p for p in family if "EngineCore" in process_text(p)]
        reapers = [p for p in family if "worker.engine.reaper" in process_text(p)]
        assert len(reapers) == 1 and cores, [process_text(p) for p in family]
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
        # The host dies mid-generation (nothing acked). Its processes are stopped first, so that
        # the stream shows what it had acked at the moment of death; then the main process alone
        # is killed, and its reaper (own session, not stopped) kills vLLM's engine processes,
        # which have no parent-death handling of their own.
        os.killpg(proc.pid, signal.SIGSTOP)
        _, consumer = await stream_state(client, subjects, settings)
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        killed.set()
        assert consumer.num_ack_pending == 4, "a stream ended before the kill"
        left = await asyncio.to_thread(wait_gone, family, 15)
        assert left == [], [process_text(p) for p in left]
        await asyncio.wait_for(rest, 15)  # every holder of the worker's stdout is gone
        reaped = [line for line in lines if line.startswith(REAPER)]
        assert len(reaped) == 1 and all(f"{p.pid} (" in reaped[0] for p in cores), reaped
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
