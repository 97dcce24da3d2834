"""Durable work-queue mode on a real JetStream server with the real vLLM engine: the mode as
discovery, the log, the client CLI and the frontend see it. A CLI worker SIGKILLed with every
stream mid-flight, its messages redelivered and terminated unrun, and its reaper taking vLLM's
engine processes with it: tests/e2e/test_migration.py.

The intake itself on the fake engines (queueing, attempts, in-progress acks, poison messages,
max_deliver, load-aware pulls, malformed payloads): tests/integration/test_jetstream_intake.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from messages.subjects import Subjects
from tests.helpers import (
    run_client_cli,
    settled_state,
)
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
    # Three tokens, in as many frames as the worker's output loop made of them under load.
    assert {f["attempt"] for f in frames} == {1}
    assert sum(len(f["token_ids"]) for f in frames) == 3
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
