"""Discovery and stats over the NATS micro protocol: `$SRV.PING`, `$SRV.INFO`, `$SRV.STATS`.

`nats micro ls/info/stats` and worker.client's discovery see the worker as a micro service named
`vllm-nats-worker` with its generate endpoints and their request counts. The generate subjects
are plain queue subscriptions (worker/nats/intake/core.py), not nats-py micro endpoints: a micro
endpoint's model is one reply per request, its processing time ends when the handler returns and
its counters are private, while a generate request streams for seconds after its handler handed
it off. So this module answers the micro protocol itself (nats-py micro's public response types
and `control_subject`), from the service core's own per-subject stats, which count the streaming
time and the error frames. bench/intake_vs_micro.py measures this intake against a micro endpoint
(README "Discovery and health").
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.service import (
    EndpointInfo,
    EndpointStats,
    ServiceInfo,
    ServicePing,
    ServiceStats,
    ServiceVerb,
    control_subject,
)

from messages.subjects import SERVICE_NAME
from worker import __version__
from worker.service import SubjectStats
from worker.shared.nats_connection import unsubscribe_all

log = logging.getLogger(__name__)

DESCRIPTION = "vLLM engine over NATS: tokenized requests in, token/logprob frames out"


@dataclass(frozen=True)
class Endpoint:
    name: str
    subject: str
    queue_group: str
    metadata: dict[str, str]


class Discovery:
    """Answers the micro protocol's PING, INFO and STATS for one worker."""

    def __init__(
        self,
        nc: NATS,
        metadata: dict[str, str],
        endpoints: list[Endpoint],
        stats: Callable[[str], SubjectStats],
        data: Callable[[], dict[str, Any]],
    ) -> None:
        self.nc = nc
        self.id = uuid.uuid4().hex
        self.metadata = metadata
        self.endpoints = endpoints
        self._stats = stats
        self._data = data
        self._started = datetime.now(timezone.utc)
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        handlers = {
            ServiceVerb.PING: self._ping,
            ServiceVerb.INFO: self._info,
            ServiceVerb.STATS: self._stats_response,
        }
        for verb, handler in handlers.items():
            for name, service_id in ((None, None), (SERVICE_NAME, None), (SERVICE_NAME, self.id)):
                subject = control_subject(verb, name, service_id)
                self._subscriptions.append(await self.nc.subscribe(subject, cb=handler))

    async def stop(self) -> None:
        """Stops answering: a draining worker is no longer discovered."""
        subscriptions, self._subscriptions = self._subscriptions, []
        await unsubscribe_all(subscriptions)

    async def _respond(self, msg: Msg, body: dict[str, Any]) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, json.dumps(body).encode())

    async def _ping(self, msg: Msg) -> None:
        ping = ServicePing(
            id=self.id, name=SERVICE_NAME, version=__version__, metadata=self.metadata
        )
        await self._respond(msg, ping.to_dict())

    async def _info(self, msg: Msg) -> None:
        info = ServiceInfo(
            name=SERVICE_NAME,
            id=self.id,
            version=__version__,
            description=DESCRIPTION,
            endpoints=[
                EndpointInfo(e.name, e.subject, e.queue_group, e.metadata) for e in self.endpoints
            ],
            metadata=self.metadata,
        )
        await self._respond(msg, info.to_dict())

    async def _stats_response(self, msg: Msg) -> None:
        data = self._data()
        endpoints = []
        for endpoint in self.endpoints:
            stats = self._stats(endpoint.subject)
            endpoints.append(
                EndpointStats(
                    name=endpoint.name,
                    subject=endpoint.subject,
                    queue_group=endpoint.queue_group,
                    num_requests=stats.num_requests,
                    num_errors=stats.num_errors,
                    processing_time=stats.processing_time_ns,
                    average_processing_time=stats.processing_time_ns // max(stats.num_requests, 1),
                    last_error=stats.last_error,
                    data=data,
                )
            )
        response = ServiceStats(
            name=SERVICE_NAME,
            id=self.id,
            version=__version__,
            started=self._started,
            endpoints=endpoints,
            metadata=self.metadata,
        )
        await self._respond(msg, response.to_dict())
