"""Test layers and session fixtures.

Layers, one directory and marker each (`pytest -m unit`, `-m integration`, `-m e2e`):
- unit/: no vllm, no torch, no model, no nats-server; seconds. Run alone (`-m unit`), the layer
  is guarded: importing vllm or torch fails, and the other layers are not even collected;
- integration/: a real nats-server and real processes, with the fake engines of worker.dev.fakes;
- e2e/: the real vLLM engine on the tiny model (and the real nats-server).

Engine start costs 25-60 s here, so the whole session shares one engine and one in-process
worker on a real nats-server (JetStream on, its own temp dir, a free loopback port).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from prometheus_client import CollectorRegistry

from bench.vllm_server import VllmOpenAIServer
from tests.helpers import (
    DOOMED_CORE,
    EARLY_WORKERS,
    TEST_KV_CACHE_BYTES,
    TEST_MAX_PAYLOAD,
    TEST_SUBJECTS,
    TINY_MODEL_FLAGS,
)
from worker.config import NatsConfig, WorkerConfig
from worker.dev.embedded import NatsServer
from worker.dev.tiny_model import ensure_tiny_embedding_model, ensure_tiny_lora, ensure_tiny_model
from worker.metrics import WorkerMetrics

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here; models are built locally
# vLLM's CPU engine binds its OpenMP threads to the cores it finds ("auto"): on a small machine
# every engine a test session starts (the session's, CLI workers', vLLM's own server) pins its one
# thread to the same core and leaves the other idle. Unbound single threads let the kernel spread
# them: three engines at once started in 30 s instead of 49 s and generated in 7 s instead of 11
# (2 cores). One thread each, as "auto" gave them, so the arithmetic is the same.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# On a GPU with one device vLLM runs the model inside its EngineCore process ("uni" executor);
# its CPU platform instead starts a Worker process of its own for it (the "mp" executor), unless
# V1 multiprocessing is off, which the async engine (always an EngineCore process) does not
# otherwise read. Off, every engine a test session starts (the session's, CLI workers', vLLM's
# own server, inheriting it) has the GPU's process layout and one spawned process fewer: 23 s of
# CPU instead of 33 s per engine start, measured here, a dozen starts per CI run.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# vLLM's server serves LoRA adapters too, for the CLI worker's (tests/e2e/test_cli_worker.py).
# With LoRA on, the base model's tokens and logprobs are bit for bit those without (checked on
# this engine: 3 prompts x 32 tokens, logprobs 5), so every other comparison is unchanged. The
# session's engine has no LoRA: vLLM 0.32's CPU engine with LoRA on dies on a batch of requests
# with prompt logprobs (worker/engine/vllm_adapter.py refuses those), which other tests send.
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")

LAYERS = ("unit", "integration", "e2e")
SESSION_ENGINE_FIXTURES = frozenset(
    {"engine", "worker", "worker_metrics", "vllm_server", "embedding_engine", "vllm_embed_server"}
)
_HEAVY = ("vllm", "torch")


def _only_layer(config: pytest.Config) -> str | None:
    markexpr = (config.getoption("markexpr") or "").strip()
    return markexpr if markexpr in LAYERS else None


def pytest_configure(config: pytest.Config) -> None:
    for layer in LAYERS:
        config.addinivalue_line("markers", f"{layer}: the {layer} test layer (tests/{layer}/)")
    config.addinivalue_line(
        "markers",
        "own_engine: starts its own engine processes (a worker by its CLI, the demo) and uses "
        "no session engine, so .ci/run runs these beside the rest in a second pytest process",
    )
    config.addinivalue_line(
        "markers",
        "second_session: an e2e test that .ci/run runs in a third pytest process, beside the "
        "integration layer (mostly waiting), with a session engine of its own (long tests, "
        "moved there to even the jobs out)",
    )
    if _only_layer(config) == "unit":
        for name in _HEAVY:
            if name in sys.modules:
                raise pytest.UsageError(f"the unit layer must not import {name}; it was imported")
            sys.modules[name] = None  # type: ignore[assignment]  # importing it now fails


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    layer = _only_layer(config)
    if layer and collection_path.is_dir() and collection_path.name in LAYERS:
        return collection_path.name != layer
    return None


# Each layer's time limit per test (pytest-timeout; pyproject.toml picks the method): a hang fails
# its test, with every thread's stack, instead of holding the run. A limit covers the test's
# setup and teardown too, so the first e2e test also pays the tiny model's build and the
# session's engine start (25-60 s, more on a loaded machine), and the last one its shutdown. A
# test's own `timeout` mark wins; `--timeout` (or PYTEST_TIMEOUT) replaces these for a run.
LAYER_TIMEOUT_S = {"unit": 30, "integration": 120, "e2e": 300}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    overridden = (
        config.getoption("timeout", None) is not None
        or os.environ.get("PYTEST_TIMEOUT") is not None
    )
    for item in items:
        layer = item.path.parent.name
        if layer not in LAYERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in one of tests/{LAYERS}")
        item.add_marker(layer)
        if item.get_closest_marker("own_engine") is not None:
            shared = SESSION_ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
            if shared:
                raise pytest.UsageError(
                    f"{item.nodeid} is marked own_engine but uses {sorted(shared)}: the second "
                    "pytest process would start a session engine of its own"
                )
        if not overridden and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LAYER_TIMEOUT_S[layer]))
    _second_session_last(items)


def _second_session_last(items: list[pytest.Item]) -> None:
    """The second_session tests run after everything else of their pytest process (the
    integration layer, in .ci/run): their CLI workers start early (`_early_workers`) and are
    ready by then."""
    items.sort(key=lambda item: item.get_closest_marker("second_session") is not None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """vLLM's own server starts as soon as the collected tests are known to need it: its ~40 s
    start then overlaps the session engine's and the tests before its first user."""
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    if "vllm_server" in used:
        _vllm_server(ensure_tiny_model()).launch()
    if "vllm_embed_server" in used:
        _vllm_embed_server(ensure_tiny_embedding_model()).launch()


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Launched, perhaps never used (a failed run).
    if _vllm_server.cache_info().currsize:
        _vllm_server(ensure_tiny_model()).stop()
    if _vllm_embed_server.cache_info().currsize:
        _vllm_embed_server(ensure_tiny_embedding_model()).stop()


@functools.cache
def _vllm_server(model: Path) -> VllmOpenAIServer:
    """vLLM's OpenAI server on the tiny model with the session engine's flags (the side-by-side
    tests compare against it)."""
    return VllmOpenAIServer(
        [
            "--model", str(model), *TINY_MODEL_FLAGS, "--max-logprobs", "20", "--seed", "0",
            # tests/e2e/test_frontend_structured.py: tool calls as the frontend's hermes parser
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            # tests/e2e/test_cli_worker.py: the adapters its worker loads, at start and later
            *LORA_FLAGS, "--lora-modules", f"tiny-lora={ensure_tiny_lora(seed=1)}",
            f"tiny-lora-2={ensure_tiny_lora(seed=2)}",
        ]
    )  # fmt: skip


# The embedding model's engine flags, the same for vLLM's server and the worker's engine.
EMBED_FLAGS = ["--runner", "pooling", "--convert", "embed"]


@functools.cache
def _vllm_embed_server(model: Path) -> VllmOpenAIServer:
    """vLLM's OpenAI server on the tiny embedding model, a pooling run of a causal LM."""
    return VllmOpenAIServer(
        [
            "--model", str(model), *TINY_MODEL_FLAGS, "--seed", "0", *EMBED_FLAGS,
        ]
    )  # fmt: skip


@pytest.fixture(scope="session")
def vllm_embed_server(tiny_embedding_model: Path) -> Iterator[VllmOpenAIServer]:
    server = _vllm_embed_server(tiny_embedding_model).launch()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_embedding_model() -> Path:
    return ensure_tiny_embedding_model()


@pytest.fixture(scope="session")
async def embedding_engine(tiny_embedding_model: Path):  # -> VllmEngine of kind "embed"
    from worker.engine.args import tiny_engine_args
    from worker.engine.vllm_adapter import VllmEngine

    args = tiny_engine_args(
        tiny_embedding_model,
        runner="pooling",
        convert="embed",
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
    )
    engine = await VllmEngine.start(args)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path) -> Iterator[VllmOpenAIServer]:
    server = _vllm_server(tiny_model).launch()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def tiny_lora() -> Path:
    """A LoRA adapter of the tiny model (seeded random A and B, PEFT's files)."""
    return ensure_tiny_lora(seed=1)


@pytest.fixture(scope="session")
def tiny_lora_2() -> Path:
    """A second one (another seed), loaded at run time."""
    return ensure_tiny_lora(seed=2)


@pytest.fixture(scope="session", autouse=True)
async def _early_workers(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """When the session runs the SIGKILL migration tests (second_session, run last), the core
    test's CLI worker starts at its first test (tests.helpers.EarlyWorkers; why not the
    JetStream test's: tests.helpers.DOOMED_JETSTREAM)."""
    if not any(item.get_closest_marker("second_session") for item in request.session.items):
        yield
        return
    url = request.getfixturevalue("nats_server").url
    model = request.getfixturevalue("tiny_model")
    EARLY_WORKERS.start(url, model, DOOMED_CORE)
    yield
    await EARLY_WORKERS.stop()


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    server = NatsServer(max_payload=TEST_MAX_PAYLOAD).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
async def engine(tiny_model: Path):  # -> VllmEngine
    from worker.engine import fast_merge as vllm_fast_merge
    from worker.engine import kv_events
    from worker.engine.args import tiny_engine_args
    from worker.engine.vllm_adapter import VllmEngine

    vllm_fast_merge.install()  # as worker.process.serve does
    args = tiny_engine_args(tiny_model, kv_cache_memory_bytes=TEST_KV_CACHE_BYTES)
    kv_events.configure(args)  # as worker.cli.engine_args does (--kv-events is on by default)
    engine = await VllmEngine.start(args)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def worker_metrics(engine) -> WorkerMetrics:
    return WorkerMetrics(engine.limits.model, CollectorRegistry())


@pytest.fixture(scope="session")
async def worker(engine, nats_server: NatsServer, worker_metrics: WorkerMetrics):  # WorkerRuntime
    from worker.nats.runtime import open_worker

    config = WorkerConfig(nats=NatsConfig(servers=[nats_server.url]), subjects=TEST_SUBJECTS)
    runtime = await open_worker(engine, config, worker_metrics)
    yield runtime
    await runtime.stop()


@pytest.fixture(scope="session")
async def client(nats_server: NatsServer) -> AsyncIterator[NATS]:
    nc = await nats.connect(nats_server.url)
    yield nc
    await nc.close()
