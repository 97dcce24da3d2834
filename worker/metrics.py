"""Prometheus metrics of the worker (prometheus-client), recorded per request and per delta.

The CLI registers them in the default registry, next to vLLM's own `vllm:` metrics, and serves
both on `--metrics-port` (worker/health.py); tests give each worker a registry of its own.

Every series carries `model_name` (the served model name, as vLLM's own metrics do), so the
workers of several models can share one Prometheus. `nats_worker_requests_total` counts
outcomes, not requests' label strings: a request of n choices adds one to the series of each
choice's own finish reason (n in all), a request that ends in an error adds one to its error
code's series; its label values are therefore a fixed set (finish reasons and error codes).

With `--worker-processes N` each process writes its values to prometheus-client's multiprocess
directory and the parent serves them summed (worker/engine/scaleout.py): counters and
histograms add up; each gauge says how it combines (`multiprocess_mode`).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets (s): TTFT spans queueing + prefill; inter-token spans one decode step.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)

MODEL_LABEL = "model_name"

HEALTH_GAUGES = {
    "engine_alive": ("nats_worker_engine_alive", "1 while the vLLM engine is alive, else 0."),
    "nats_connected": ("nats_worker_nats_connected", "1 while connected to NATS, else 0."),
    "draining": ("nats_worker_draining", "1 once shutting down (no new requests), else 0."),
}
"""ProcessHealth field (worker/health.py) → the gauge that publishes it (name, help)."""


class WorkerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.model_name = model_name
        labels = [MODEL_LABEL]
        self._requests = Counter(
            "nats_worker_requests",
            "Requests by outcome: one per choice with its finish reason, or one with the error "
            "code a request ended with.",
            [MODEL_LABEL, "outcome"],
            registry=registry,
        )
        self._errors = Counter(
            "nats_worker_errors",
            "Error frames sent, by error code.",
            [MODEL_LABEL, "code"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "nats_worker_in_flight_requests",
            "Requests being served now.",
            labels,
            registry=registry,
            # With --worker-processes N the processes' values are summed.
            multiprocess_mode="livesum",
        ).labels(model_name)
        self.generated_tokens = Counter(
            "nats_worker_generated_tokens", "Tokens generated and sent.", labels, registry=registry
        ).labels(model_name)
        self.time_to_first_token = Histogram(
            "nats_worker_time_to_first_token_seconds",
            "From the request's arrival to its first generated token's frame.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.admission_wait = Histogram(
            "nats_worker_admission_wait_seconds",
            "From the request's arrival to its task's first step: the event loop's work queued "
            "ahead of it (other requests' outputs and frames).",
            labels,
            buckets=_ITL_BUCKETS,
            registry=registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "nats_worker_inter_token_latency_seconds",
            "Time between consecutive token frames of a choice, per token.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=registry,
        ).labels(model_name)
        # One series per process with --worker-processes N ("liveall" adds a `pid` label): the
        # parent's /health reads each process's state from them (worker/health.py).
        self._health = {
            field: Gauge(
                name,
                help_text,
                labels,
                registry=registry,
                multiprocess_mode="liveall",
            ).labels(model_name)
            for field, (name, help_text) in HEALTH_GAUGES.items()
        }

    def tokens(self, count: int, gap_s: float | None) -> None:
        """A delta of `count` tokens, `gap_s` after the same choice's previous one (None: first)."""
        self.generated_tokens.inc(count)
        if gap_s is not None and count:
            per_token = gap_s / count
            for _ in range(count):
                self.inter_token_latency.observe(per_token)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def admitted(self, seconds: float) -> None:
        self.admission_wait.observe(seconds)

    def finished(self, outcomes: Iterable[str]) -> None:
        """A request ended: one increment per outcome (each choice's finish reason, or the one
        error code)."""
        for outcome in outcomes:
            self._requests.labels(self.model_name, outcome).inc()

    def error(self, code: str) -> None:
        self._errors.labels(self.model_name, code).inc()

    def health(self, **state: bool) -> None:
        """Publishes this process's health (the HEALTH_GAUGES fields, each given)."""
        for field, gauge in self._health.items():
            gauge.set(1 if state[field] else 0)
