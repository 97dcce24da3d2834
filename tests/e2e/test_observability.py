"""What an operator sees of a worker, on the real engine and a real nats-server: metrics per
finish reason with the model's name, --help and the final line of a refused start (the stats
line, /health and the log format of a running CLI worker: test_cli_worker.py;
--disable-log-stats: test_operability.py's engine-death worker)."""

from __future__ import annotations

import asyncio
import re
import sys
import urllib.error
import urllib.request

import pytest

from tests.helpers import (
    ROOT,
    TEST_SUBJECTS,
    metrics_server,
    subprocess_env,
)
from worker.cli import build_parser
from worker.client import complete, generate
from worker.client.requests import make_request

PROMPT = [1, 300, 301, 302]


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


@pytest.mark.second_session  # CI: a CLI start of ~10 s, beside the integration layer
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
    assert (
        "third subject token (default: generate; embed for a pooling model, started with "
        "--runner pooling or --convert embed) --engine-core-cpus" in flat
    )
    assert not re.search(r"\(default: [^)]*\) \(default:", flat), "a default shown twice"
    assert "--help=all" in flat
