"""Integration-layer fixtures: workers on the fake engines of worker/dev/fakes.py, built as the
command builds them (`open_worker`), on the session's nats-server or one a test starts itself.

The session's `nats_server` and `client` come from tests/conftest.py; nothing here starts vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from messages.subjects import Subjects
from worker.config import JetStreamSettings, NatsConfig, WorkerConfig
from worker.dev.embedded import NatsServer
from worker.dev.fakes import PacedFakeEngine
from worker.engine.contract import Engine, EngineLimits
from worker.nats.runtime import WorkerRuntime, open_worker

TINY_LIMITS = EngineLimits(model="paced-fake", max_logprobs=20, vocab_size=1024, max_model_len=512)
"""The tiny model's limits (the session engine's of the e2e layer), for the refusals that
name them: a vocabulary of 1024, a context of 512 tokens, 20 logprobs."""

STEP_S = 0.01
"""The default fake engine's pace: 400 tokens take 4 s, so a request is running whenever a
test's cancel, deadline, drain or refusal comes, on a loaded host too."""

MakeWorker = Callable[..., Awaitable[WorkerRuntime]]


def paced(step_s: float = STEP_S) -> PacedFakeEngine:
    """A paced fake engine (a token every `step_s`, logprob rows when asked) with the tiny
    model's limits."""
    return PacedFakeEngine(step_s, limits=TINY_LIMITS)


def worker_config(url: str, subjects: Subjects, **settings: Any) -> WorkerConfig:
    return WorkerConfig(nats=NatsConfig(servers=[url]), subjects=subjects, **settings)


def queue_settings(settings: JetStreamSettings, capacity: int = 8) -> dict[str, Any]:
    """A JetStream-mode worker's settings: `capacity` requests pulled and served at once."""
    return {
        "max_concurrency": capacity,
        "jetstream": dataclasses.replace(settings, capacity=capacity),
    }


@pytest.fixture
async def fake_worker(nats_server: NatsServer) -> AsyncIterator[MakeWorker]:
    """Makes workers on fake engines (own connection, subjects and settings); stopped after the
    test (a stop is idempotent: a test may stop one itself).

    `await fake_worker(subjects, engine=None, url=None, **settings)`: `engine` defaults to a
    paced fake engine (`paced()`), `url` to the session's nats-server; `settings` are
    WorkerConfig's."""
    made: list[WorkerRuntime] = []

    async def make(
        subjects: Subjects, engine: Engine | None = None, *, url: str | None = None, **settings: Any
    ) -> WorkerRuntime:
        config = worker_config(url or nats_server.url, subjects, **settings)
        runtime = await open_worker(engine or paced(), config)
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        # A stop that hangs fails the test with the stack it waited in, not by the layer limit.
        await asyncio.wait_for(runtime.stop(), 60)


@pytest.fixture
async def queue_worker(fake_worker: MakeWorker) -> AsyncIterator[MakeWorker]:
    """Makes JetStream-mode workers: `await queue_worker(subjects, settings, engine=None,
    capacity=8)`."""

    async def make(
        subjects: Subjects,
        settings: JetStreamSettings,
        engine: Engine | None = None,
        *,
        capacity: int = 8,
    ) -> WorkerRuntime:
        return await fake_worker(subjects, engine, **queue_settings(settings, capacity))

    yield make
