"""What an operator sees of a running worker, on the real engine and a real nats-server: the
stats line and --disable-log-stats, metrics per finish reason with the model's name, /health,
one log format, no raw-prompt warning, --help and the final line."""

from __future__ import annotations

import asyncio
import re
import sys
import time
import urllib.error
import urllib.request

from tests.helpers import (
    ROOT,
    TEST_SUBJECTS,
    collect,
    get_health,
    kill_if_running,
    last_worker_line,
    metrics_server,
    read_until,
    ready_metrics_port,
    sigterm_mid_stream,
    start_cli_worker,
    subprocess_env,
)
from worker.cli import build_parser
from worker.client import complete, generate
from worker.client.requests import make_request

PROMPT = [1, 300, 301, 302]
STATS_LINE = r"Avg prompt throughput: .* Running: \d+ reqs, Waiting: \d+ reqs, .*KV cache usage"
# vLLM's text format (after an optional "(process pid=N) " field): level, date, [file:line].
LOG_PREFIX = (
    r"(?:\(\S+ pid=\d+\) )?(INFO|WARNING|ERROR|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[\S+:\d+\] "
)


def stats_env(interval_s: str) -> dict[str, str]:
    env = subprocess_env()
    env["VLLM_LOG_STATS_INTERVAL"] = interval_s
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # vLLM logs its stats line at INFO
    return env


async def _frames(nc, subject, request):
    async for frame in generate(nc, request, subject=subject):
        yield frame


async def test_requests_total_counts_each_choice_with_the_model_name(
    worker, client, worker_metrics, engine
) -> None:
    registry = worker_metrics.registry
    with metrics_server(registry) as port:
        labels = {"model_name": engine.limits.model, "outcome": "length"}
        before = registry.get_sample_value("nats_worker_requests_total", labels) or 0.0
        request = make_request("obs-n2", PROMPT, max_tokens=4, n=2, temperature=1.0, seed=1)
        result = await complete(client, request, subject=TEST_SUBJECTS.generate)
        assert [c.finish_reason for c in result.choices] == ["length", "length"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    assert registry.get_sample_value("nats_worker_requests_total", labels) == before + 2
    assert b'outcome="length,length"' not in text
    assert f'model_name="{engine.limits.model}"'.encode() in text


async def test_cli_worker_stats_line_health_log_format_and_stopped_line(
    nats_server, tiny_model, client
) -> None:
    proc = await start_cli_worker(
        nats_server.url,
        tiny_model,
        "--namespace",
        "obs",
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
        env=stats_env("1"),
    )
    lines: list[str] = []
    rest = None
    try:
        port = await ready_metrics_port(proc, lines)
        rest = asyncio.create_task(collect(proc.stdout, lines))
        subject = "obs.vllm.generate"

        code, body = await asyncio.to_thread(get_health, port)
        assert code == 200, body
        assert body["status"] == "ok"
        assert body["engine_alive"] is True
        assert body["nats_connected"] is True
        assert body["draining"] is False
        assert body["expected_processes"] == 1 and len(body["processes"]) == 1

        # A stats line comes within the interval (1 s here) while the engine works.
        served = await complete(
            client, make_request("obs-1", PROMPT, max_tokens=64), subject=subject
        )
        assert served.choices[0].finish_reason == "length"
        deadline = time.monotonic() + 15
        while not any(re.search(STATS_LINE, line) for line in lines):
            assert time.monotonic() < deadline, "no stats line:\n" + "".join(lines[-40:])
            await asyncio.sleep(0.2)

        # SIGTERM with a request in flight: /health says draining (503) until the worker exits.
        seen_draining: list[dict] = []

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

        long = make_request("obs-long", PROMPT, max_tokens=300)
        watcher = asyncio.create_task(watch_health())
        frames = await sigterm_mid_stream(proc, _frames(client, subject, long))
        await asyncio.wait_for(watcher, 30)
        assert frames[-1].finish_reason == "length"
        assert seen_draining and seen_draining[0]["draining"] is True
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await rest
    finally:
        await kill_if_running(proc)
    output = "".join(lines)
    assert "Passing raw prompts" not in output
    assert last_worker_line(lines) == "vllm-nats-worker stopped (exit 0)"
    # The worker's own log lines have vLLM's format, as vLLM's stats line has.
    worker_line = next(line for line in lines if "request obs-1 length tokens=64" in line)
    stats_line = next(line for line in lines if re.search(STATS_LINE, line))
    assert re.match(LOG_PREFIX + "request obs-1 length", worker_line), worker_line
    assert re.match(LOG_PREFIX, stats_line), stats_line


async def test_disable_log_stats_turns_the_stats_line_off(nats_server, tiny_model, client) -> None:
    proc = await start_cli_worker(
        nats_server.url,
        tiny_model,
        "--namespace",
        "obsquiet",
        "--disable-log-stats",
        env=stats_env("1"),
    )
    lines: list[str] = []
    try:
        await read_until(proc.stdout, r"vllm-nats-worker ready:", lines, 300)
        rest = asyncio.create_task(collect(proc.stdout, lines))
        served = await complete(
            client, make_request("quiet-1", PROMPT, max_tokens=64), subject="obsquiet.vllm.generate"
        )
        assert served.choices[0].finish_reason == "length"
        await asyncio.sleep(4)  # four intervals
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await rest
    finally:
        await kill_if_running(proc)
    output = "".join(lines)
    assert "request quiet-1 length tokens=64" in output
    assert not re.search(STATS_LINE, output), output
    assert last_worker_line(lines) == "vllm-nats-worker stopped (exit 0)"


async def test_a_refused_start_ends_with_the_stopped_line_too() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker",
        "--model",
        "m",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={k: v for k, v in subprocess_env().items() if k != "NATS_URL"},
        cwd=ROOT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    lines = out.decode().splitlines()
    assert proc.returncode == 2
    assert "--nats-url (or NATS_URL) required" in lines[-2]
    assert lines[-1] == "vllm-nats-worker stopped (exit 2)"


def test_help_shows_the_nats_groups_first_and_each_default_once() -> None:
    text = build_parser().format_help()
    assert text.startswith(
        "usage: vllm-nats-worker --model MODEL --nats-url URL [NATS options] "
        "[vLLM engine options]\n"
    )
    nats, worker, engine = (
        text.index("NATS connection:"),
        text.index("NATS worker:"),
        text.index("vLLM engine arguments:"),
    )
    assert nats < worker < engine
    for flag in ("--nats-url", "--queue-group", "--drain-timeout", "--metrics-port"):
        assert text.index(flag, nats) < engine, flag
    flat = " ".join(text.split())
    assert "third subject token (default: generate) --health-interval" in flat
    assert not re.search(r"\(default: [^)]*\) \(default:", flat), "a default shown twice"
    assert "--help=all" in flat
