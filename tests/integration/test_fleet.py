"""The control plane across a fleet on a real nats-server (fake engines with in-memory admins):
`worker.client.fleet` reaches every worker of a subject, in core and JetStream mode, and reports
each answer, a silent one included; discovery names the adapters. (The real engine's adapters:
tests/e2e/test_cli_worker.py.)"""

from __future__ import annotations

import asyncio
import json

import nats
import pytest

from messages.control import ControlRequest
from messages.subjects import Subjects
from tests.helpers import discover
from tests.integration.conftest import paced, queue_settings
from worker.client import fleet
from worker.config import JetStreamSettings
from worker.dev.fakes import FakeAdmin, PacedFakeEngine

pytestmark = pytest.mark.integration


def admin_engine(admin: FakeAdmin) -> PacedFakeEngine:
    engine = paced()
    engine.admin = admin
    return engine


async def test_a_load_reaches_every_worker_and_discovery_names_it(fake_worker, client) -> None:
    subjects = Subjects("fleet", "vllm", "generate")
    first, second = FakeAdmin("paced-fake"), FakeAdmin("paced-fake")
    await fake_worker(subjects, admin_engine(first), instance_id="f1")
    await fake_worker(subjects, admin_engine(second), instance_id="f2")
    load = ControlRequest(command="load_lora_adapter", lora_name="a", lora_path="/adapters/a")
    replies = await fleet.command_all(client, subjects.generate, load)
    assert sorted(r.instance_id for r in replies) == ["f1", "f2"]
    assert all(r.error is None and r.adapters == {"a": "/adapters/a"} for r in replies)
    again = await fleet.command_all(client, subjects.generate, load)
    assert {r.error.code for r in again if r.error} == {"invalid_request"} and len(again) == 2

    answers = await discover(client, "INFO", instances={"f1"})
    infos = {i["metadata"]["instance_id"]: i for i in answers}
    assert json.loads(infos["f1"]["metadata"]["adapters"]) == {"a": "/adapters/a"}

    members = await fleet.members(client, subjects.generate)
    assert {m.instance_id: m.adapters for m in members} == {
        "f1": {"a": "/adapters/a"},
        "f2": {"a": "/adapters/a"},
    }


async def test_the_fleet_reaches_jetstream_workers_and_reports_a_silent_one(
    fake_worker, client
) -> None:
    subjects = Subjects("fleetjs", "vllm", "generate")
    admin = FakeAdmin("paced-fake")
    settings = queue_settings(JetStreamSettings(), capacity=4)
    await fake_worker(subjects, admin_engine(admin), instance_id="q1", **settings)
    replies = await fleet.command_all(client, subjects.generate, ControlRequest(command="sleep"))
    assert [(r.instance_id, r.error, r.is_sleeping) for r in replies] == [("q1", None, True)]
    assert admin.sleeping
    # One that does not answer in time is reported, never skipped.
    silent = await fleet.command(
        client, subjects, "nobody", ControlRequest(command="is_sleeping"), timeout=0.5
    )
    assert silent.error is not None and silent.error.code == "worker_lost"
    assert silent.error.message.startswith("no answer within 0.5 s")


async def test_a_frontend_without_model_learns_models_and_health_from_discovery(
    nats_server, fake_worker
) -> None:
    """A frontend started without `--model` (no tokenizer): /health is 503 until some worker
    answers discovery, then 200 without waiting out the window; /v1/models lists what the
    workers serve (here a fake embedding worker), and a model whose last worker left is a 404."""
    import time

    import httpx

    from tests.helpers import serving
    from worker.dev.fakes import fake_embedding_engine
    from worker.frontend.app import FrontendSettings, create_app

    nc = await nats.connect(nats_server.url)
    # A window wide enough that "the first answer, not the whole window" holds on a loaded CI
    # host (a 0.5 s window once saw its first answer after 0.62 s there).
    settings = FrontendSettings(health_timeout_s=2.0, discovery_refresh_s=0.2)
    app = create_app(settings, None, nc=nc)
    try:
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            # The session's server may hold other tests' workers: only ours is looked for.
            embed = Subjects("healthless", "vllm", "embed")
            worker = await fake_worker(embed, fake_embedding_engine())
            started = time.monotonic()
            health = await http.get("/health")
            assert health.status_code == 200, health.text
            assert time.monotonic() - started < 1.5  # the first answer, not the whole window
            cards: dict = {}
            deadline = time.monotonic() + 5  # learnt within a refresh (0.2 s + the window)
            while "fake-embed" not in cards and time.monotonic() < deadline:
                cards = {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}
                await asyncio.sleep(0.1)
            assert cards["fake-embed"]["max_model_len"] == 512
            await worker.stop()
            deadline = time.monotonic() + 10  # the catalog's next rounds
            listed = set(cards)
            while "fake-embed" in listed and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                listed = {c["id"] for c in (await http.get("/v1/models")).json()["data"]}
            assert "fake-embed" not in listed
            gone = await http.post("/v1/embeddings", json={"model": "fake-embed", "input": [1]})
            assert gone.status_code == 404
            assert gone.json()["error"]["message"] == "The model `fake-embed` does not exist."
    finally:
        await nc.close()
