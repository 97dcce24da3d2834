"""Core NATS intake: the generate subject in the workers' queue group, plus this worker's
instance subject (direct routing), both plain queue subscriptions.

Each message is one request; its reply subject is where the frames go. nats-py runs one
subscription's callbacks one after another, so the callback only validates and hands off (the
request streams in its own task). Failure guard: whatever raises while taking a message, the
request gets its one `internal_error` frame and the subscription goes on. At most once: a worker
that dies mid-request loses it (the client's timer notices; JetStream mode redelivers).
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from worker.config import WorkerConfig
from worker.errors import describe
from worker.nats.discovery import Endpoint
from worker.nats.liveness import Liveness, NatsReply
from worker.service import Delivery, RequestService
from worker.shared.nats_connection import unsubscribe_all

log = logging.getLogger(__name__)

CONTENT_TYPES = {"content_types": "application/msgpack,application/json"}


def core_endpoints(config: WorkerConfig) -> list[Endpoint]:
    """The subjects a core-mode worker takes requests on, each in its own queue group: the
    model's (every worker), its instance's (direct routing) and, for a process of a shared
    engine core, the engine's (what a KV router sends to that engine)."""
    subjects = config.subjects
    endpoints = [
        Endpoint("generate", subjects.generate, config.queue_group, CONTENT_TYPES),
        Endpoint(
            "generate-direct",
            subjects.instance(config.instance_id),
            f"{config.queue_group}-{config.instance_id}",
            CONTENT_TYPES,
        ),
    ]
    if config.engine_id:
        endpoints.append(
            Endpoint(
                "generate-engine",
                subjects.instance(config.engine_id),
                f"{config.queue_group}-{config.engine_id}",
                CONTENT_TYPES,
            )
        )
    return endpoints


class CoreIntake:
    def __init__(
        self, service: RequestService, nc: NATS, liveness: Liveness, config: WorkerConfig
    ) -> None:
        self.service = service
        self.nc = nc
        self.liveness = liveness
        self.endpoints = core_endpoints(config)
        self.failed = asyncio.Event()
        """Never set: a core subscription has no loop of its own that could die."""
        self._subscriptions: list[Subscription] = []

    def describe(self) -> tuple[dict[str, str], str]:
        serving = ", ".join(f"{e.subject} (queue {e.queue_group})" for e in self.endpoints)
        return {"mode": "core"}, serving

    async def start(self) -> None:
        for endpoint in self.endpoints:
            subscription = await self.nc.subscribe(
                endpoint.subject, endpoint.queue_group, cb=self._take
            )
            self._subscriptions.append(subscription)

    async def stop(self) -> None:
        subscriptions, self._subscriptions = self._subscriptions, []
        await unsubscribe_all(subscriptions)

    async def _take(self, msg: Msg) -> None:
        arrived = time.monotonic_ns()
        if not msg.reply:
            log.warning(
                "refused a request on %s without a reply subject (%d bytes)",
                msg.subject,
                len(msg.data),
            )
            return
        delivery = Delivery(
            msg.data, msg.headers, NatsReply(self.liveness, msg.reply), msg.subject, arrived
        )
        try:
            await self.service.accept(delivery)
        except Exception as error:
            # accept publishes at most one frame, its last step, so an error here means none
            # went out: this one is seq 0.
            log.exception("request on %s failed before it was admitted", msg.subject)
            try:
                await self.service.answer_error(delivery, "internal_error", describe(error))
            except Exception:
                log.exception("could not answer the failed request on %s", msg.subject)
