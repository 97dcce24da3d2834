"""One production worker started by its CLI, as a user starts it (`python -m worker` with vLLM
engine arguments and a metrics port), on the real CPU engine: what it takes from vLLM's
arguments, what an operator sees (the stats line, /health, one log format), and SIGTERM with a
request in flight (drain, exit 0, the last line). The module's tests share the one process (an
engine start is ~30 s here) and run in file order: the last one stops it."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

from messages.codec import MSGPACK
from messages.frames import ResponseFrame
from messages.subjects import Subjects
from tests.helpers import (
    STATS_LINE,
    collect,
    discover,
    exchange,
    get_health,
    kill_if_running,
    last_worker_line,
    ready_metrics_port,
    scrape,
    sigterm_mid_stream,
    start_cli_worker,
    stats_env,
)
from worker.client import complete, generate
from worker.client.requests import make_request
from worker.dev.embedded import NatsServer

pytestmark = pytest.mark.own_engine

PROMPT = [1, 300, 301, 302]
SUBJECTS = Subjects("cli", "vllm", "generate")
MAX_MODEL_LEN = 256
MAX_LOGPROBS = 7
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
async def cli_worker(nats_server: NatsServer, tiny_model: Path) -> AsyncIterator[CliWorker]:
    proc = await start_cli_worker(
        nats_server.url,
        tiny_model,
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


async def _frames(nc: NATS, subject: str, request: Any) -> AsyncIterator[ResponseFrame]:
    async for frame in generate(nc, request, subject=subject):
        yield frame


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


async def test_sigterm_drains_a_request_in_flight_and_exits_0_with_its_last_line(
    cli_worker: CliWorker, client
) -> None:
    """The module's last test: it stops the worker."""
    proc, port = cli_worker.proc, cli_worker.metrics_port
    seen_draining: list[dict[str, Any]] = []

    async def watch_health() -> None:
        while proc.returncode is None:
            try:
                code, body = await asyncio.to_thread(get_health, port)
            except OSError:
                return  # the port closed: the worker is gone
            if code == 503 and body["status"] == "draining":
                seen_draining.append(body)
                return
            await asyncio.sleep(0.05)

    # /health says draining (503) from the signal until the worker exits.
    long = make_request("cli-long", PROMPT, max_tokens=200)
    watcher = asyncio.create_task(watch_health())
    frames = await sigterm_mid_stream(proc, _frames(client, SUBJECTS.generate, long))
    await asyncio.wait_for(watcher, 30)
    assert frames[-1].finish_reason == "length"
    assert sum(len(f.token_ids) for f in frames) == 200
    assert seen_draining and seen_draining[0]["draining"] is True
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    await asyncio.wait_for(cli_worker.reader, 30)  # every line, up to the last
    lines, output = cli_worker.lines, cli_worker.output
    assert "request cli-1 length tokens=5" in output  # one log line per request outcome
    assert "request cli-2 invalid_request" in output
    assert "Passing raw prompts" not in output
    assert last_worker_line(lines) == "vllm-nats-worker stopped (exit 0)"
    # The worker's own log lines have vLLM's format, as vLLM's stats line has.
    worker_line = next(line for line in lines if "request obs-1 length tokens=64" in line)
    stats_line = next(line for line in lines if re.search(STATS_LINE, line))
    assert re.match(LOG_PREFIX + "request obs-1 length", worker_line), worker_line
    assert re.match(LOG_PREFIX, stats_line), stats_line
