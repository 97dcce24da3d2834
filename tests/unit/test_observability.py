"""Metrics labels, the /health report and its HTTP server, help-text defaults: no vllm, no
nats-server."""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry

from worker import health
from worker.engine.args import explicit_defaults
from worker.metrics import WorkerMetrics
from worker.session import Outcome

MODEL = "org/model-7b"


def test_requests_total_counts_each_choices_finish_reason_with_the_model_label() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(MODEL, registry)
    metrics.finished(Outcome("a", ["length", "length"]).outcomes)
    metrics.finished(Outcome("b", ["stop", "eos"]).outcomes)
    metrics.finished(Outcome("c", ["length", "eos"], error_code="engine_error").outcomes)
    value = registry.get_sample_value
    name = "nats_worker_requests_total"
    assert value(name, {"model_name": MODEL, "outcome": "length"}) == 2
    assert value(name, {"model_name": MODEL, "outcome": "stop"}) == 1
    assert value(name, {"model_name": MODEL, "outcome": "eos"}) == 1
    # An error counts once, with its code, whatever its choices had reached.
    assert value(name, {"model_name": MODEL, "outcome": "engine_error"}) == 1
    outcomes = {
        sample.labels["outcome"]
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name
    }
    assert outcomes == {"length", "stop", "eos", "engine_error"}  # never "length,length"


def test_every_worker_metric_carries_the_model_name() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(MODEL, registry)
    metrics.tokens(3, 0.03)
    metrics.first_token(0.1)
    metrics.admitted(0.004)
    metrics.error("overloaded")
    metrics.finished(["overloaded"])
    metrics.in_flight.inc()
    metrics.health(engine_alive=True, nats_connected=True, draining=False)
    names = set()
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            names.add(sample.name)
            assert sample.labels["model_name"] == MODEL, sample
    assert {
        "nats_worker_requests_total",
        "nats_worker_errors_total",
        "nats_worker_in_flight_requests",
        "nats_worker_generated_tokens_total",
        "nats_worker_time_to_first_token_seconds_count",
        "nats_worker_admission_wait_seconds_count",
        "nats_worker_inter_token_latency_seconds_count",
        "nats_worker_engine_alive",
        "nats_worker_nats_connected",
        "nats_worker_draining",
    } <= names


def test_the_outcome_log_label_joins_what_metrics_count_apart() -> None:
    assert Outcome("a", ["length", "stop"]).label == "length,stop"
    assert Outcome("a", ["length", "stop"]).outcomes == ["length", "stop"]
    assert Outcome("a", [None], error_code="overloaded").outcomes == ["overloaded"]


SERVING = health.ProcessHealth(engine_alive=True, nats_connected=True, draining=False)


def test_health_is_200_only_while_every_expected_process_serves() -> None:
    code, body = health.report([SERVING], expected=1)
    assert code == 200
    assert body == {
        "status": "ok",
        "engine_alive": True,
        "nats_connected": True,
        "draining": False,
        "expected_processes": 1,
        "processes": [
            {"engine_alive": True, "nats_connected": True, "draining": False, "pid": None}
        ],
    }
    cases = [
        ([], 1, "starting"),
        ([SERVING], 2, "starting"),
        ([SERVING, health.ProcessHealth(True, True, True, pid=7)], 2, "draining"),
        ([health.ProcessHealth(False, True, False)], 1, "engine_dead"),
        ([health.ProcessHealth(True, False, False)], 1, "nats_disconnected"),
        # Draining is said first: a worker shutting down is expected to lose its engine.
        ([health.ProcessHealth(False, False, True)], 1, "draining"),
    ]
    for processes, expected, status in cases:
        code, body = health.report(processes, expected)
        assert (code, body["status"]) == (503, status), (processes, body)
    assert health.report([], 1)[1]["engine_alive"] is False


def test_health_read_back_from_the_gauges_of_each_process() -> None:
    registry = CollectorRegistry()
    assert health.from_gauges(registry) == []
    metrics = WorkerMetrics(MODEL, registry)
    health.record(metrics, health.ProcessHealth(True, False, False))
    assert health.from_gauges(registry) == [health.ProcessHealth(True, False, False)]


def test_metrics_port_serves_health_json_and_the_prometheus_text() -> None:
    registry = CollectorRegistry()
    WorkerMetrics(MODEL, registry).finished(["length"])
    states = [SERVING]
    server = health.serve("127.0.0.1", 0, registry, lambda: states, expected=1)
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as answer:
            assert answer.status == 200
            assert answer.headers["Content-Type"] == "application/json"
            assert json.load(answer)["status"] == "ok"
        states[:] = [health.ProcessHealth(True, True, True)]
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5)
            raise AssertionError("a draining worker answered /health with 200")
        except urllib.error.HTTPError as error:
            assert error.code == 503
            assert json.load(error)["draining"] is True
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        assert 'nats_worker_requests_total{model_name="org/model-7b",outcome="length"} 1.0' in text
    finally:
        server.shutdown()


def test_each_default_is_shown_once_in_help() -> None:
    parser = argparse.ArgumentParser(
        formatter_class=explicit_defaults(argparse.ArgumentDefaultsHelpFormatter)
    )
    parser.add_argument("--own", default=None, help="worker's (default: random)")
    parser.add_argument("--theirs", default=5, help="vLLM's")
    text = " ".join(parser.format_help().split())
    assert "worker's (default: random) --theirs" in text
    assert "vLLM's (default: 5)" in text
    assert text.count("(default:") == 2


def test_routed_series_are_bounded_however_many_engines_come_and_go() -> None:
    from worker.client.router import Route
    from worker.frontend.metrics import MAX_ENGINE_LABELS, FrontendMetrics

    metrics = FrontendMetrics()
    # Every worker start is a new engine id: more of them than the bound, two requests each.
    for n in range(MAX_ENGINE_LABELS + 6):
        for _ in range(2):
            metrics.count_route(Route(f"llm.vllm.generate.e{n}", f"e{n}", overlap_blocks=3, busy=n))
    metrics.count_route(Route(None))
    value = metrics.registry.get_sample_value
    name = "nats_frontend_routed_requests_total"
    assert value(name, {"instance": "e0"}) == 2
    assert value(name, {"instance": f"e{MAX_ENGINE_LABELS - 1}"}) == 2
    assert value(name, {"instance": f"e{MAX_ENGINE_LABELS}"}) is None
    assert value(name, {"instance": "other"}) == 12
    assert value(name, {"instance": "queue"}) == 1
    assert value("nats_frontend_routed_overlap_blocks_total", {"instance": "other"}) == 36
    assert (
        value("nats_frontend_router_busy_requests", {"instance": "other"}) == MAX_ENGINE_LABELS + 5
    )
    labels = {
        sample.labels["instance"]
        for family in metrics.registry.collect()
        if family.name == "nats_frontend_routed_requests"
        for sample in family.samples
    }
    assert len(labels) == MAX_ENGINE_LABELS + 2  # the engines, "other", "queue"


async def test_the_frontends_first_token_time_is_a_streamed_responses_first_body_bytes() -> None:
    """The Gate observes `nats_frontend_time_to_first_token_seconds` once per streamed (SSE)
    response, at its first non-empty body message (an empty one, as the ASGI server may send,
    is not the first event); a JSON response is not observed."""
    import asyncio
    from typing import Any

    from worker.frontend.gate import Gate
    from worker.frontend.metrics import FrontendMetrics
    from worker.frontend.settings import FrontendSettings

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        streamed = scope["path"] == "/v1/completions"
        kind = b"text/event-stream; charset=utf-8" if streamed else b"application/json"
        headers = [(b"content-type", kind)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        await asyncio.sleep(0.05)  # the first frame's wait
        for chunk in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    metrics = FrontendMetrics()
    gate = Gate(app, FrontendSettings(), metrics)
    for path in ("/v1/completions", "/v1/models"):
        await gate({"type": "http", "path": path, "headers": []}, receive, send)
    value = metrics.registry.get_sample_value
    name = "nats_frontend_time_to_first_token_seconds"
    assert value(f"{name}_count", {"route": "/v1/completions"}) == 1
    assert 0.05 <= value(f"{name}_sum", {"route": "/v1/completions"}) < 5
    assert value(f"{name}_count", {"route": "/v1/models"}) is None
