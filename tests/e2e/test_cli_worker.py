"""One production worker started by its CLI, as a user starts it (`python -m worker` with vLLM
engine arguments and a metrics port), on the real CPU engine: what it takes from vLLM's
arguments (`--stream-interval` among them) and from `vllm serve`'s (`--lora-modules`), what an
operator sees (the stats line, /health, one
log format), and its engine's death with a request in flight (answered, exit 1). The module's
tests share the one process (an engine start is ~40 CPU-seconds here) and run in file order: the
last one ends it. SIGTERM's drain and exit 0 are shown on the --worker-processes worker
(tests/e2e/test_scaleout.py).

CI runs the module beside the integration layer (second_session): its frames coalesced by
`--stream-interval` are compared with those of that process's session engine."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from messages.codec import MSGPACK
from messages.control import ControlReply, ControlRequest
from messages.frames import ResponseFrame
from messages.subjects import Subjects
from tests.helpers import (
    STATS_LINE,
    TEST_SUBJECTS,
    check_row,
    collect,
    discover,
    engine_processes,
    exchange,
    get_health,
    kill_if_running,
    last_worker_line,
    process_text,
    ready_metrics_port,
    scrape,
    signal_each,
    start_cli_worker,
    stats_env,
    until_in_flight,
)
from worker.client import complete, generate
from worker.client.requests import make_request
from worker.dev.embedded import NatsServer

pytestmark = pytest.mark.second_session

PROMPT = [1, 300, 301, 302]
SUBJECTS = Subjects("cli", "vllm", "generate")
MAX_MODEL_LEN = 256
MAX_LOGPROBS = 7
ADAPTER = "tiny-lora"
INTERVAL = 4
# vLLM's text format (after an optional "(process pid=N) " field): level, date, [file:line].
LOG_PREFIX = (
    r"(?:\(\S+ pid=\d+\) )?(INFO|WARNING|ERROR|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[\S+:\d+\] "
)


@dataclass
class CliWorker:
    proc: asyncio.subprocess.Process
    metrics_port: int
    reader: asyncio.Task[None]
    """Collects the output into `lines` until the process closes it."""
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)


@pytest.fixture(scope="module")
async def cli_worker(
    nats_server: NatsServer, tiny_model: Path, tiny_lora: Path
) -> AsyncIterator[CliWorker]:
    proc = await start_cli_worker(
        nats_server.url,
        tiny_model,
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"{ADAPTER}={tiny_lora}",
        "--namespace",
        SUBJECTS.namespace,
        "--instance-id",
        "cli1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
        "--stream-interval",
        str(INTERVAL),
        "--health-interval",
        "1",
        env=stats_env("1"),
    )
    lines: list[str] = []
    output = None
    try:
        port = await ready_metrics_port(proc, lines)
        output = asyncio.create_task(collect(proc.stdout, lines))
        yield CliWorker(proc, port, output, lines)
    finally:
        await kill_if_running(proc)
        if output is not None:
            await asyncio.wait_for(output, 30)


async def test_the_cli_worker_takes_vllms_engine_arguments(
    cli_worker: CliWorker, client, tiny_model: Path
) -> None:
    subject = SUBJECTS.generate
    served = await complete(
        client, make_request("cli-1", PROMPT, max_tokens=5, logprobs=7), subject=subject
    )
    assert served.choices[0].finish_reason == "length"
    assert all(len(row) in (7, 8) for row in served.choices[0].top_logprobs)
    raw = await exchange(client, subject, MSGPACK.encode(make_request("cli-2", PROMPT, logprobs=8)))
    assert (
        "must be <= 7 (the engine's max_logprobs)"
        in msgspec.msgpack.decode(raw[0])["error"]["message"]
    )
    raw = await exchange(client, subject, MSGPACK.encode(make_request("cli-3", [5] * 300)))
    assert "max_model_len 256" in msgspec.msgpack.decode(raw[0])["error"]["message"]

    infos = [i for i in await discover(client, "INFO") if i["metadata"]["instance_id"] == "cli1"]
    assert len(infos) == 1 and infos[0]["metadata"]["max_logprobs"] == "7"
    samples = await asyncio.to_thread(scrape, cli_worker.metrics_port)
    model = f"model_name={tiny_model}"
    assert samples[f"nats_worker_requests_total{{{model},outcome=length}}"] == 1
    assert samples[f"nats_worker_errors_total{{code=invalid_request,{model}}}"] == 2
    assert any(name.startswith("vllm:") for name in samples), "vLLM's own metrics are served too"


async def test_lora_modules_are_loaded_before_it_serves(
    cli_worker: CliWorker, client, worker, tiny_lora: Path
) -> None:
    """`--lora-modules name=path` (vLLM's flag and parser): the adapter is in discovery from
    the start and answers as the same adapter loaded at run time into the session's engine."""
    (info,) = [i for i in await discover(client, "INFO") if i["metadata"]["instance_id"] == "cli1"]
    assert json.loads(info["metadata"]["adapters"]) == {ADAPTER: str(tiny_lora)}
    load = ControlRequest(command="load_lora_adapter", lora_name=ADAPTER, lora_path=str(tiny_lora))
    answer = await client.request(
        TEST_SUBJECTS.control(worker.instance_id), MSGPACK.encode(load), timeout=60
    )
    assert MSGPACK.decode_as(answer.data, ControlReply).error is None
    try:
        request = make_request("cli-lora", PROMPT, max_tokens=12, logprobs=3)
        request.model = ADAPTER
        ours = await complete(client, request, subject=SUBJECTS.generate)
        session = await complete(client, request, subject=TEST_SUBJECTS.generate)
    finally:
        unload = ControlRequest(command="unload_lora_adapter", lora_name=ADAPTER)
        await client.request(
            TEST_SUBJECTS.control(worker.instance_id), MSGPACK.encode(unload), timeout=60
        )
    assert ours.choices[0].token_ids == session.choices[0].token_ids
    for a, b in zip(ours.choices[0].log_probs, session.choices[0].log_probs, strict=True):
        assert abs(a - b) <= 1e-5


async def test_health_and_the_stats_line_while_it_serves(cli_worker: CliWorker, client) -> None:
    code, body = await asyncio.to_thread(get_health, cli_worker.metrics_port)
    assert code == 200, body
    assert body["status"] == "ok"
    assert body["engine_alive"] is True
    assert body["nats_connected"] is True
    assert body["draining"] is False
    assert body["expected_processes"] == 1 and len(body["processes"]) == 1

    # A stats line comes within the interval (1 s here) while the engine works.
    served = await complete(
        client, make_request("obs-1", PROMPT, max_tokens=64), subject=SUBJECTS.generate
    )
    assert served.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 15
    while not re.search(STATS_LINE, cli_worker.output):
        assert time.monotonic() < deadline, "no stats line:\n" + "".join(cli_worker.lines[-40:])
        await asyncio.sleep(0.2)


async def test_stream_interval_coalesces_frames_and_keeps_logprobs_aligned(
    cli_worker: CliWorker, client, worker, engine
) -> None:
    """vLLM's own `--stream-interval N` (an engine argument the CLI passes through) makes the
    worker send a request's tokens N at a time, first token at once, with every frame's logprobs
    still aligned and the same tokens and values as one frame per step (the session's worker)."""
    tokens = 25
    request = make_request("interval-1", [1, 40, 41, 42, 43, 44], max_tokens=tokens, logprobs=5)
    coalesced = [
        MSGPACK.decode_frame(data)
        for data in await exchange(client, SUBJECTS.generate, MSGPACK.encode(request))
    ]
    stepwise = [
        MSGPACK.decode_frame(data)
        for data in await exchange(client, TEST_SUBJECTS.generate, MSGPACK.encode(request))
    ]
    sizes = [len(f.token_ids) for f in coalesced]
    # First token at once (TTFT unchanged), then INTERVAL per frame: 25 = 1 + 6 x 4. A worker
    # that lags merges a request's pending outputs (both workers do, by design), so under load a
    # frame may carry more than one interval (the first token too: [5, 4, 16] on CI), never a
    # part of one.
    assert sizes[0] % INTERVAL == 1 and sum(sizes) == tokens, sizes
    assert all(size % INTERVAL == 0 for size in sizes[1:]), sizes
    assert len(stepwise) > len(coalesced)
    assert [f.seq for f in coalesced] == list(range(len(coalesced)))
    assert [f.finish_reason for f in coalesced] == [None] * (len(coalesced) - 1) + ["length"]
    for frame in coalesced:
        assert len(frame.log_probs) == len(frame.top_logprobs) == len(frame.token_ids)
        for token_id, logprob, row in zip(
            frame.token_ids, frame.log_probs, frame.top_logprobs, strict=True
        ):
            check_row(row, token_id, logprob, 5, engine.table)

    def flat(frames: list[ResponseFrame], field: str) -> list[Any]:
        return [v for f in frames for v in getattr(f, field)]

    assert flat(coalesced, "token_ids") == flat(stepwise, "token_ids")
    for a, b in zip(flat(coalesced, "log_probs"), flat(stepwise, "log_probs"), strict=True):
        assert abs(a - b) < 1e-4
    ids = [[e.token_id for e in row] for row in flat(coalesced, "top_logprobs")]
    assert ids == [[e.token_id for e in row] for row in flat(stepwise, "top_logprobs")]
    assert coalesced[-1].completion_usage == stepwise[-1].completion_usage


async def test_engine_death_answers_in_flight_and_exits_non_zero(
    cli_worker: CliWorker, client, tiny_model: Path
) -> None:
    """The module's last test: it kills the worker's engine. The request in flight gets a
    retryable `engine_error` (migration off, so the test sees the worker's own frame) and the
    worker exits 1 with its last line."""
    proc = cli_worker.proc
    frames: list[ResponseFrame] = []
    request = make_request("crash-1", PROMPT, max_tokens=250)

    async def in_flight() -> None:
        async for frame in generate(client, request, subject=SUBJECTS.generate, migration_limit=0):
            frames.append(frame)

    # The engine is stopped before the request comes, so the request is in flight, admitted by
    # the worker, when the engine dies, however fast the tiny model and however slow the host
    # (running the worker in slices until a first frame, a starved test overran a slice and
    # the request ended first). The engine dies whole (an OOM kill of its processes): its core
    # and the core's executor worker, which would otherwise report its parent's death after the
    # worker's last line.
    engine = engine_processes(proc.pid)
    assert len(engine) >= 2, [process_text(p) for p in psutil.Process(proc.pid).children()]
    signal_each(engine, signal.SIGSTOP)
    reading = asyncio.create_task(in_flight())
    await until_in_flight(cli_worker.metrics_port, tiny_model, 1)
    signal_each(engine, signal.SIGKILL)
    await asyncio.wait_for(reading, 60)
    final = frames[-1]
    assert final.finish_reason == "error" and final.error is not None
    assert final.error.code == "engine_error"
    assert sum(len(f.token_ids) for f in frames) < 250
    assert await asyncio.wait_for(proc.wait(), 60) == 1
    await asyncio.wait_for(cli_worker.reader, 30)  # every line, up to the last
    lines, output = cli_worker.lines, cli_worker.output
    assert "engine is dead: answering in-flight requests and exiting" in output
    assert last_worker_line(lines) == "vllm-nats-worker stopped (exit 1)"
    assert "request cli-1 length tokens=5" in output  # one log line per request outcome
    assert "request cli-2 invalid_request" in output
    assert "Passing raw prompts" not in output
    # The worker's own log lines have vLLM's format, as vLLM's stats line has.
    worker_line = next(line for line in lines if "request obs-1 length tokens=64" in line)
    stats_line = next(line for line in lines if re.search(STATS_LINE, line))
    assert re.match(LOG_PREFIX + "request obs-1 length", worker_line), worker_line
    assert re.match(LOG_PREFIX, stats_line), stats_line
