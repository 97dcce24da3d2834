"""The frontend's Prometheus metrics, served on its own `/metrics`.

Each app has its own registry (several apps in one process, as in the tests, do not clash). With
`--processes N` prometheus-client runs in multiprocess mode (the command line points
PROMETHEUS_MULTIPROC_DIR at a directory before the processes start): every process writes its
values to files there and `/metrics` sums them, so any process answers for the whole frontend.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from worker.client.router import Route

# The routes labelled by name; anything else is "other" (a label per unknown path would let
# any client grow the series without bound).
ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/version",
    }
)


def route_label(path: str) -> str:
    return path if path in ROUTES else "other"


MAX_ENGINE_LABELS = 64
"""Engines labelled by id in the routed-request series, per frontend process; later ones are
"other". An engine id is new at every worker start, and prometheus-client's multiprocess mode
cannot remove a series, so without a bound a long-lived frontend's series would grow with every
worker restart."""


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "nats_frontend_requests_total",
            "HTTP requests answered, by route and status code",
            ["route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "nats_frontend_request_duration_seconds",
            "HTTP request arrival to the end of its response body (a stream's last event)",
            ["route"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.first_token = Histogram(
            "nats_frontend_time_to_first_token_seconds",
            "HTTP request arrival to the first byte of a streamed (SSE) response body, which the "
            "frontend sends once every prompt's first frame arrived",
            ["route"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.in_flight = Gauge(
            "nats_frontend_in_flight_requests",
            "HTTP requests being answered",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.tokens = Counter(
            "nats_frontend_tokens_total",
            "Tokens of answered completions requests, by kind (prompt, completion)",
            ["kind"],
            registry=self.registry,
        )

        # The router's picture, per worker instance ("queue": sent to the queue group): where
        # requests went, the cached prompt blocks that drew them, and how busy the router
        # believed the chosen worker to be. Set against each worker's own STATS, a router whose
        # load picture is wrong shows as a skewed split at equal believed load.
        self.routed = Counter(
            "nats_frontend_routed_requests_total",
            "Requests routed, by engine (a worker's instance id, a multi-process worker's "
            "engine id; queue: the queue group; other: engines past the first "
            f"{MAX_ENGINE_LABELS} this process routed to)",
            ["instance"],
            registry=self.registry,
        )
        self.routed_overlap = Counter(
            "nats_frontend_routed_overlap_blocks_total",
            "Cached prompt blocks the router counted for the requests it sent, by engine",
            ["instance"],
            registry=self.registry,
        )
        self.router_busy = Gauge(
            "nats_frontend_router_busy_requests",
            "In-flight requests the router counted on the engine it chose last (its own "
            "exactly, others' as of the engine's processes' last load reports)",
            ["instance"],
            registry=self.registry,
            multiprocess_mode="liveall",
        )
        self._engine_labels: set[str] = set()

    def count_usage(self, usage: dict[str, int]) -> None:
        """An answered request's tokens (its `usage`)."""
        self.tokens.labels("prompt").inc(usage["prompt_tokens"])
        self.tokens.labels("completion").inc(usage["completion_tokens"])

    def count_route(self, route: Route) -> None:
        """One routed request, under its engine's label ("queue": the queue group)."""
        if route.instance_id is None:
            self.routed.labels("queue").inc()
            return
        label = route.instance_id
        if label not in self._engine_labels:
            if len(self._engine_labels) >= MAX_ENGINE_LABELS:
                label = "other"
            else:
                self._engine_labels.add(label)
        self.routed.labels(label).inc()
        self.routed_overlap.labels(label).inc(route.overlap_blocks)
        self.router_busy.labels(label).set(route.busy)

    def exposition(self, multiprocess_dir: str | None) -> bytes:
        """The Prometheus text: this app's registry, or every process's summed."""
        if multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=multiprocess_dir)
        return generate_latest(registry)
