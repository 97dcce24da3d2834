"""NATS micro registration: `$SRV.PING`, `$SRV.INFO` and `$SRV.STATS` show the worker.

The generate subjects are micro endpoints, so `nats micro ls/info/stats` list them with their
request and error counts. Two nats-py micro details are bridged here and nowhere else (pinned by
tests/test_operability.py):
- a streaming answer outlives the endpoint handler (which only hands off, since nats-py runs one
  subscription's handlers one at a time), so the session's real processing time and its error
  are added to the endpoint's counters when the request ends;
- the handler needs the message's reply subject before it publishes anything.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from nats import micro
from nats.aio.client import Client as NATS
from nats.micro.request import Request
from nats.micro.service import EndpointStats, Service

from messages.subjects import SERVICE_NAME
from worker import __version__
from worker.config import WorkerConfig
from worker.engine_api import EngineLimits

Handler = Callable[[Request], Awaitable[None]]


def reply_subject(request: Request) -> str:
    return request._msg.reply or ""


async def register(
    nc: NATS,
    config: WorkerConfig,
    limits: EngineLimits,
    handler: Handler,
    stats_data: Callable[[], dict[str, Any]],
    *,
    endpoints: bool = True,
) -> Service:
    """Registers the service; `endpoints=False` (JetStream mode) registers it for discovery
    only, since requests then come from the stream, not from the core subjects."""
    subjects = config.subjects

    def endpoint_data(_: EndpointStats) -> dict[str, Any]:
        return stats_data()

    service = await micro.add_service(
        nc,
        name=SERVICE_NAME,
        version=__version__,
        description="vLLM engine over NATS: tokenized requests in, token/logprob frames out",
        metadata={
            "instance_id": config.instance_id,
            "model": limits.model,
            "engine": limits.engine,
            "max_logprobs": str(limits.max_logprobs),
            "max_model_len": str(limits.max_model_len),
            "vocab_size": str(limits.vocab_size),
            "max_concurrency": (
                "unlimited" if config.max_concurrency is None else str(config.max_concurrency)
            ),
        },
        stats_handler=endpoint_data,
    )
    if not endpoints:
        return service
    await service.add_endpoint(
        name="generate",
        subject=subjects.generate,
        queue_group=config.queue_group,
        handler=handler,
        metadata={"content_types": "application/msgpack,application/json"},
    )
    await service.add_endpoint(
        name="generate-direct",
        subject=subjects.instance(config.instance_id),
        queue_group=f"{config.queue_group}-{config.instance_id}",
        handler=handler,
        metadata={"content_types": "application/msgpack,application/json"},
    )
    return service


class EndpointStatsRecorder:
    """Adds a finished request's processing time and error to its endpoint's micro stats."""

    def __init__(self, service: Service) -> None:
        self._endpoints = {endpoint._subject: endpoint for endpoint in service._endpoints}

    def record(self, subject: str, elapsed_ns: int, error: str | None) -> None:
        endpoint = self._endpoints.get(subject)
        if endpoint is None:
            return
        endpoint._processing_time += elapsed_ns
        endpoint._average_processing_time = int(
            endpoint._processing_time / max(endpoint._num_requests, 1)
        )
        if error is not None:
            endpoint._num_errors += 1
            endpoint._last_error = error
