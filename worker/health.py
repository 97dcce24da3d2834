"""The worker's health, and the HTTP server of `--metrics-port` that reports it.

`GET /health` answers JSON:

    {"status": "ok", "engine_alive": true, "nats_connected": true, "draining": false,
     "expected_processes": 1, "processes": [{"pid": null, "engine_alive": true, ...}]}

with 200 only while the worker serves: every expected process reports, each with its engine
alive, its NATS connection up and not draining. Otherwise 503, and `status` says why, the first
that holds of: "draining" (shutting down: SIGTERM/SIGINT), "engine_dead", "nats_disconnected",
"starting" (the engine is loading, or fewer processes report than expected). Every other path
answers the Prometheus text (`/metrics`), as the port did before.

Where the state comes from: a single worker process answers from its live state (the provider
reads the worker and its connection on each request). With `--worker-processes N` the parent
serves the port and each process publishes its state in the `nats_worker_engine_alive`,
`nats_worker_nats_connected` and `nats_worker_draining` gauges (prometheus-client's
multiprocess files, one series per process: `pid` label); the parent reads them back
(`from_gauges`), refreshed by each process every `PUBLISH_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import json
import socketserver
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from worker.metrics import HEALTH_GAUGES, WorkerMetrics

PUBLISH_INTERVAL_S = 1.0
"""How often each process refreshes its health gauges (what the parent of N processes reads)."""

OK = 200
UNAVAILABLE = 503


@dataclass(frozen=True)
class ProcessHealth:
    """One worker process's state."""

    engine_alive: bool
    nats_connected: bool
    draining: bool
    pid: int | None = None
    """The process, where several report (the multiprocess gauges' `pid`); None for one."""

    @property
    def serving(self) -> bool:
        return self.engine_alive and self.nats_connected and not self.draining


Provider = Callable[[], Sequence[ProcessHealth]]
"""The processes' current health (empty while none reports yet: the engine is loading)."""


def report(processes: Sequence[ProcessHealth], expected: int) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body of /health for these processes' states."""
    if any(p.draining for p in processes):
        status = "draining"
    elif not all(p.engine_alive for p in processes):
        status = "engine_dead"
    elif not all(p.nats_connected for p in processes):
        status = "nats_disconnected"
    elif len(processes) < expected:
        status = "starting"
    else:
        status = "ok"
    body = {
        "status": status,
        "engine_alive": bool(processes) and all(p.engine_alive for p in processes),
        "nats_connected": bool(processes) and all(p.nats_connected for p in processes),
        "draining": any(p.draining for p in processes),
        "expected_processes": expected,
        "processes": [asdict(p) for p in processes],
    }
    return (OK if status == "ok" else UNAVAILABLE), body


def from_gauges(registry: CollectorRegistry) -> list[ProcessHealth]:
    """The processes' states as their health gauges in `registry` say (one per `pid` label;
    a process that has not published all three yet is left out: it is still starting)."""
    names = {name: field for field, (name, _) in HEALTH_GAUGES.items()}
    found: dict[str | None, dict[str, bool]] = {}
    for family in registry.collect():
        field = names.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            found.setdefault(sample.labels.get("pid"), {})[field] = sample.value >= 1
    return [
        ProcessHealth(**fields, pid=int(pid) if pid is not None else None)
        for pid, fields in sorted(found.items(), key=lambda item: str(item[0]))
        if len(fields) == len(HEALTH_GAUGES)
    ]


async def publish(
    current: Callable[[], ProcessHealth],
    metrics: WorkerMetrics,
    interval_s: float = PUBLISH_INTERVAL_S,
) -> None:
    """Keeps this process's health gauges current (until cancelled)."""
    while True:
        record(metrics, current())
        await asyncio.sleep(interval_s)


def record(metrics: WorkerMetrics, state: ProcessHealth) -> None:
    """Sets this process's health gauges to `state`."""
    metrics.health(**{field: getattr(state, field) for field in HEALTH_GAUGES})


def app(registry: CollectorRegistry, provider: Provider, expected: int) -> Callable[..., Any]:
    """The WSGI app of the metrics port: /health, else the Prometheus text of `registry`."""
    metrics_app = make_wsgi_app(registry)

    def serve(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/health":
            result: Iterable[bytes] = metrics_app(environ, start_response)
            return result
        code, body = report(provider(), expected)
        data = json.dumps(body).encode()
        start_response(
            f"{code} {'OK' if code == OK else 'Service Unavailable'}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
        )
        return [data]

    return serve


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log: Prometheus and probes scrape every few seconds."""


def serve(
    host: str, port: int, registry: CollectorRegistry, provider: Provider, expected: int = 1
) -> WSGIServer:
    """Serves the metrics port in a daemon thread (port 0: a free one, `server.server_port`)."""
    server = make_server(
        host,
        port,
        app(registry, provider, expected),
        server_class=_Server,
        handler_class=_QuietHandler,
    )
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
