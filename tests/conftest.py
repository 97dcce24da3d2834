"""Session fixtures: one real nats-server, one tiny model, one real vLLM engine, one worker.

Engine start costs 25-60 s here, so the whole session shares one engine and one in-process
worker on a real nats-server (JetStream on, its own temp dir, a free loopback port).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry

from messages.subjects import Subjects
from worker.config import NatsConfig, WorkerConfig
from worker.embedded import NatsServer
from worker.metrics import WorkerMetrics
from worker.tiny_model import cpu_env_defaults, ensure_tiny_model, tiny_engine_args

cpu_env_defaults()

# Small on purpose: large prompt-logprob answers must be split to fit (the default is 1 MiB).
TEST_MAX_PAYLOAD = 32 * 1024
TEST_SUBJECTS = Subjects(namespace="test", component="vllm", endpoint="generate")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    server = NatsServer(max_payload=TEST_MAX_PAYLOAD).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
async def engine(tiny_model: Path):  # -> VllmEngine
    from worker import vllm_fast_merge
    from worker.vllm_engine import VllmEngine

    vllm_fast_merge.install()  # as worker.cli.serve does
    engine = await VllmEngine.start(tiny_engine_args(tiny_model))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def worker_metrics() -> WorkerMetrics:
    return WorkerMetrics(CollectorRegistry())


@pytest.fixture(scope="session")
async def worker(engine, nats_server: NatsServer, worker_metrics: WorkerMetrics):  # -> Worker
    from worker.service import Worker
    from worker.transport import connect

    config = WorkerConfig(nats=NatsConfig(servers=[nats_server.url]), subjects=TEST_SUBJECTS)
    nc = await connect(config.nats)
    service = Worker(engine, nc, config, worker_metrics)
    await service.start()
    yield service
    await service.stop()
    await nc.close()


@pytest.fixture(scope="session")
async def client(nats_server: NatsServer) -> AsyncIterator[NATS]:
    nc = await nats.connect(nats_server.url)
    yield nc
    await nc.close()


@pytest.fixture
async def extra_worker(engine, nats_server):
    """Makes more workers on the session's engine (own connection, subjects and settings)."""
    from worker.service import Worker
    from worker.transport import connect

    made: list[tuple[Worker, NATS]] = []

    async def make(subjects: Subjects, **settings) -> Worker:
        config = WorkerConfig(
            nats=NatsConfig(servers=[settings.pop("url", nats_server.url)]),
            subjects=subjects,
            **settings,
        )
        nc = await connect(config.nats)
        worker = Worker(engine, nc, config)
        await worker.start()
        made.append((worker, nc))
        return worker

    yield make
    for worker, nc in made:
        await worker.stop()
        await nc.close()
