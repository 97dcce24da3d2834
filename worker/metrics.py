"""Prometheus metrics of the worker (prometheus-client), recorded per request and per delta.

The CLI registers them in the default registry, next to vLLM's own `vllm:` metrics, and serves
both on `--metrics-port`; tests give each worker a registry of its own.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

# Latency buckets (s): TTFT spans queueing + prefill; inter-token spans one decode step.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.requests = Counter(
            "nats_worker_requests",
            "Requests by outcome (a finish reason or an error code).",
            ["outcome"],
            registry=registry,
        )
        self.errors = Counter(
            "nats_worker_errors", "Error frames sent, by error code.", ["code"], registry=registry
        )
        self.in_flight = Gauge(
            "nats_worker_in_flight_requests",
            "Requests being served now.",
            registry=registry,
            # With --worker-processes N the processes' values are summed.
            multiprocess_mode="livesum",
        )
        self.generated_tokens = Counter(
            "nats_worker_generated_tokens", "Tokens generated and sent.", registry=registry
        )
        self.time_to_first_token = Histogram(
            "nats_worker_time_to_first_token_seconds",
            "From the request's arrival to its first generated token's frame.",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "nats_worker_inter_token_latency_seconds",
            "Time between consecutive token frames of a choice, per token.",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )

    def tokens(self, count: int, gap_s: float | None) -> None:
        """A delta of `count` tokens, `gap_s` after the same choice's previous one (None: first)."""
        self.generated_tokens.inc(count)
        if gap_s is not None and count:
            per_token = gap_s / count
            for _ in range(count):
                self.inter_token_latency.observe(per_token)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def finished(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def error(self, code: str) -> None:
        self.errors.labels(code=code).inc()
