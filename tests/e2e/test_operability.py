"""CLI with vLLM's engine args, embedded defaults, NATS micro discovery, metrics, compose file."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path

import msgspec
import pytest

from messages.subjects import SERVICE_NAME
from tests.helpers import (
    ROOT,
    TEST_SUBJECTS,
    discover,
    exchange,
    metrics_server,
    run_client_cli,
    scrape,
    subprocess_env,
)
from worker.cli import build_parser, engine_args
from worker.client import complete
from worker.client.requests import make_request

PROMPT = [1, 300, 301, 302]


async def srv(nc, verb: str, service_id: str) -> dict:
    msg = await nc.request(f"$SRV.{verb}.{SERVICE_NAME}.{service_id}", b"", timeout=5)
    return json.loads(msg.data)


def test_unknown_flag_fails_with_argparse_message(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--model", "m", "--no-such-flag"])
    assert info.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_help_shows_worker_and_vllm_engine_flags(capsys, monkeypatch) -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "NATS worker" in out
    for flag in (
        "--nats-url",
        "--namespace",
        "--component",
        "--endpoint",
        "--queue-group",
        "--max-concurrency",
        "--drain-timeout",
        "--metrics-port",
        "--tls-ca",
        "--nats-creds",
    ):
        assert flag in out, flag
    # vLLM's ~250 engine flags are behind vLLM's own --help=<group> / --help=all.
    assert "ModelConfig" in out and "--help=all" in out
    # vLLM keeps the searched word on its parser class: restored after this test.
    monkeypatch.setattr(FlexibleArgumentParser, "_search_keyword", None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help=all"])
    out = capsys.readouterr().out
    assert out.index("NATS worker:") < out.index("ModelConfig:")
    for flag in ("--model", "--tensor-parallel-size", "--max-logprobs", "--max-model-len"):
        assert flag in out, flag


def test_engine_args_go_to_vllm_as_vllm_serve_takes_them(tiny_model: Path) -> None:
    args = build_parser().parse_args(
        [
            "--model",
            str(tiny_model),
            "--max-logprobs",
            "7",
            "--max-model-len",
            "256",
            "--tensor-parallel-size",
            "1",
            "--dtype",
            "float32",
        ]
    )
    resolved = engine_args(args)
    assert (resolved.model, resolved.max_logprobs, resolved.max_model_len) == (
        str(tiny_model),
        7,
        256,
    )
    assert resolved.tensor_parallel_size == 1 and resolved.dtype == "float32"
    # --dev and no --model: the tiny demo model, fp32, max_model_len 512, eager.
    default = engine_args(build_parser().parse_args(["--dev"]))
    assert Path(default.model).name.startswith("tiny-llama")
    assert (default.dtype, default.max_model_len, default.enforce_eager) == ("float32", 512, True)


async def test_micro_ping_info_stats_and_counts_move(worker, client, engine) -> None:
    service_id = worker.discovery.id
    ping = await srv(client, "PING", service_id)
    assert (ping["name"], ping["id"], ping["version"]) == ("vllm-nats-worker", service_id, "0.1.0")
    info = await srv(client, "INFO", service_id)
    assert info["metadata"]["model"] == engine.limits.model
    assert info["metadata"]["max_logprobs"] == "20"
    assert info["metadata"]["instance_id"] == worker.config.instance_id
    assert info["metadata"]["engine"].startswith("vllm ")
    endpoints = {e["name"]: e for e in info["endpoints"]}
    assert endpoints["generate"]["subject"] == TEST_SUBJECTS.generate
    assert endpoints["generate"]["queue_group"] == "vllm-workers"
    assert endpoints["generate-direct"]["subject"] == TEST_SUBJECTS.instance(
        worker.config.instance_id
    )
    pings = await discover(client, "PING", instances={worker.config.instance_id})
    assert any(s["id"] == service_id for s in pings)

    def generate_stats(stats: dict) -> dict:
        return next(e for e in stats["endpoints"] if e["name"] == "generate")

    before = generate_stats(await srv(client, "STATS", service_id))
    started = time.monotonic()
    for i in range(2):
        await complete(
            client, make_request(f"stats-{i}", PROMPT, max_tokens=8), subject=TEST_SUBJECTS.generate
        )
    elapsed_ns = (time.monotonic() - started) * 1e9
    await exchange(
        client, TEST_SUBJECTS.generate, msgspec.msgpack.encode({"request_id": "x", "token_ids": []})
    )

    # A long request in flight shows up in the stats' data.
    long_request = asyncio.create_task(
        complete(
            client,
            make_request("stats-long", PROMPT, max_tokens=300),
            subject=TEST_SUBJECTS.generate,
        )
    )
    for _ in range(200):
        during = generate_stats(await srv(client, "STATS", service_id))
        if during["data"]["in_flight"] >= 1:
            break
        await asyncio.sleep(0.02)
    assert during["data"]["in_flight"] >= 1
    assert during["data"]["engine_unfinished_requests"] >= 1
    await long_request
    after = generate_stats(await srv(client, "STATS", service_id))
    assert after["num_requests"] == before["num_requests"] + 4  # 2 served, 1 bad, 1 long
    assert after["num_errors"] == before["num_errors"] + 1
    assert "invalid_request" in after["last_error"]
    # Streaming time counts: at least the two served requests' wall time (minus client overhead).
    assert after["processing_time"] - before["processing_time"] >= 0.5 * elapsed_ns
    assert after["data"]["in_flight"] == 0


async def test_metrics_endpoint_shows_counters_and_histograms(
    worker, client, worker_metrics, engine
) -> None:
    with metrics_server(worker_metrics.registry) as port:
        for i in range(3):
            await complete(
                client,
                make_request(f"m-{i}", PROMPT, max_tokens=10, logprobs=2),
                subject=TEST_SUBJECTS.generate,
            )
        await exchange(client, TEST_SUBJECTS.generate, b"\xc1garbage")
        samples = await asyncio.to_thread(scrape, port)
    model = f"model_name={engine.limits.model}"
    assert samples[f"nats_worker_requests_total{{{model},outcome=length}}"] >= 3
    assert samples[f"nats_worker_requests_total{{{model},outcome=invalid_request}}"] >= 1
    assert samples[f"nats_worker_errors_total{{code=invalid_request,{model}}}"] >= 1
    assert samples[f"nats_worker_generated_tokens_total{{{model}}}"] >= 30
    assert samples[f"nats_worker_time_to_first_token_seconds_count{{{model}}}"] >= 3
    assert samples[f"nats_worker_time_to_first_token_seconds_sum{{{model}}}"] > 0
    assert samples[f"nats_worker_inter_token_latency_seconds_count{{{model}}}"] >= 27
    assert samples[f"nats_worker_in_flight_requests{{{model}}}"] == 0


@pytest.mark.own_engine
async def test_demo_runs_on_embedded_nats_and_default_model() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "worker.dev.demo",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=subprocess_env(),
        cwd=ROOT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"embedded nats-server on nats://127\.0\.0\.1:\d+", text)
    assert "no --model: serving the tiny demo model" in text
    rows = re.findall(r"^\s*\d+\s+\d+\s+'.*'\s+[0-9a-f ]+\s+-?\d+\.\d{4}\s", text, re.MULTILINE)
    assert len(rows) == 16, text[-3000:]
    assert "finish_reason='length'" in text and "completion_tokens=16" in text


async def test_the_production_cli_requires_a_model_and_a_nats_url(capsys) -> None:
    """A misconfigured pod must not look ready on a random-weight model or a private broker:
    without --model and a NATS URL the worker exits 2 and says what is missing (--dev asks for
    the embedded defaults instead, as the demo does)."""
    from worker.process import serve

    assert await serve(build_parser().parse_args([])) == 2
    assert "--model and --nats-url (or NATS_URL) required" in capsys.readouterr().err
    assert await serve(build_parser().parse_args(["--model", "/models/m"])) == 2
    assert "vllm-nats-worker: --nats-url (or NATS_URL) required" in capsys.readouterr().err
    args = build_parser().parse_args(["--dev"])
    assert args.dev and args.model is None and args.nats_url is None


@pytest.mark.second_session  # CI: a CLI start of ~10 s, beside the integration layer
async def test_nats_and_jetstream_trouble_refuse_before_the_model_loads(
    nats_server, client, capsys
) -> None:
    """A wrong URL, wrong credentials or a JetStream stream set up otherwise end the worker with
    one line and exit 2 before the engine starts (the model path here does not even exist: had
    the worker tried to load it, it would have failed otherwise, minutes later on a GPU)."""
    from nats.js import api

    from worker.dev.embedded import NatsServer
    from worker.process import serve

    missing_model = "/models/never-loaded"

    async def refusal(*flags: str) -> str:
        started = time.monotonic()
        code = await serve(build_parser().parse_args(["--model", missing_model, *flags]))
        assert code == 2
        assert time.monotonic() - started < 20
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    line = await refusal("--nats-url", "nats://127.0.0.1:1")
    assert line.startswith("vllm-nats-worker: cannot connect to NATS at nats://127.0.0.1:1: ")
    assert "Connect call failed" in line, line

    server = NatsServer(jetstream=False, extra_config='authorization { token: "s3cret" }').start()
    try:
        line = await refusal("--nats-url", server.url, "--nats-token", "wrong")
        assert line.startswith(f"vllm-nats-worker: cannot connect to NATS at {server.url}: ")
        assert "authorization violation" in line.lower(), line
    finally:
        server.stop()

    await client.jetstream().add_stream(
        api.StreamConfig(
            name="PRE_VLLM_GENERATE",
            subjects=["pre.vllm.queue.generate"],
            retention=api.RetentionPolicy.LIMITS,
        )
    )
    line = await refusal("--nats-url", nats_server.url, "--mode", "jetstream", "--namespace", "pre")
    assert line.startswith("vllm-nats-worker: refusing to start: stream PRE_VLLM_GENERATE ")
    assert "retention is limits, not workqueue" in line, line


async def test_client_cli_options_and_one_line_errors(worker, tiny_model) -> None:
    """`python -m worker.client`: sampling and output flags reach the worker, --json prints the
    raw frames, a tokenizer prints the text, and every failure is one line with exit 1 (2 for
    bad arguments), no traceback."""
    import subprocess

    nats_url = worker.config.nats.servers[0]

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        return run_client_cli(nats_url, "--subject", TEST_SUBJECTS.generate, *flags)

    raw = await asyncio.to_thread(
        run, "--token-ids", "1,300,301", "--max-tokens", "4", "--n", "2", "--seed", "7",
        "--temperature", "1.0", "--top-p", "0.9", "--logprobs", "2", "--prompt-logprobs", "1",
        "--json",
    )  # fmt: skip
    assert raw.returncode == 0, raw.stderr
    frames = [json.loads(line) for line in raw.stdout.splitlines()]
    assert "prompt_log_probs" in frames[0]  # --prompt-logprobs reached the worker
    finals = {f["index"]: f["finish_reason"] for f in frames if f.get("finish_reason")}
    assert finals == {0: "length", 1: "length"}
    assert sum(len(f["token_ids"]) for f in frames) == 8
    assert all(len(row) >= 2 for f in frames for row in f.get("top_logprobs", []))

    text = await asyncio.to_thread(
        run, "--prompt", "Hello there", "--tokenizer", str(tiny_model), "--max-tokens", "3"
    )
    assert text.returncode == 0, text.stderr
    assert "0: finish_reason=length" in text.stdout
    assert "0: text=" in text.stdout

    bad_ids = await asyncio.to_thread(run, "--token-ids", "1,x")
    assert bad_ids.returncode == 2
    assert "argument --token-ids: comma-separated integers, got '1,x'" in bad_ids.stderr

    too_many = await asyncio.to_thread(run, "--token-ids", "1,2", "--logprobs", "21")
    assert too_many.returncode == 1 and too_many.stdout.count("\n") == 0
    assert too_many.stderr.strip().splitlines() == [
        "error invalid_request: output_options.logprobs: must be <= 20 (the engine's "
        "max_logprobs), got 21"
    ]

    wrong_port = run_client_cli("nats://127.0.0.1:1", "--token-ids", "1,2", timeout=60)
    assert wrong_port.returncode == 1 and wrong_port.stdout == ""
    lines = wrong_port.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: cannot connect to NATS at nats://127.0.0.1:1: "
    ), wrong_port.stderr


def test_worker_client_and_frontend_take_one_set_of_nats_flags(monkeypatch) -> None:
    """The same NATS flags and environment variables, parsed by one implementation
    (worker/shared/nats_options.py), give the same NatsConfig in all three tools."""
    from worker.cli import worker_config
    from worker.client.__main__ import _parse_args as client_args
    from worker.frontend.cli import parse_args as frontend_args
    from worker.shared.nats_options import nats_config

    monkeypatch.setenv("NATS_TLS_CA", "/etc/ca.pem")
    flags = [
        "--nats-url", "nats://a:4222,nats://b:4222", "--nats-user", "u", "--nats-password", "p",
        "--nats-token", "t", "--nats-creds", "/c.creds", "--nats-nkey-seed", "/k.nk",
        "--tls-cert", "/cert.pem", "--tls-key", "/key.pem",
    ]  # fmt: skip
    worker = worker_config(build_parser().parse_args(["--model", "/m", *flags])).nats
    client = nats_config(client_args([*flags, "--token-ids", "1"]))
    frontend = nats_config(frontend_args([*flags, "--model", "/m"]))
    assert worker == client == frontend
    assert worker.servers == ["nats://a:4222", "nats://b:4222"]
    assert (worker.user, worker.password, worker.token) == ("u", "p", "t")
    assert (worker.creds_file, worker.nkeys_seed) == ("/c.creds", "/k.nk")
    assert (worker.tls_ca, worker.tls_cert, worker.tls_key) == (
        "/etc/ca.pem",
        "/cert.pem",
        "/key.pem",
    )


def test_frontend_refuses_a_wrong_nats_url_with_one_line(tiny_model) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "worker.frontend", "--nats-url", "nats://127.0.0.1:1",
         "--model", str(tiny_model)],
        capture_output=True, text=True, cwd=ROOT, timeout=60, env=subprocess_env(),
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("frontend: cannot connect to NATS at nats://127.0.0.1:1: ")
