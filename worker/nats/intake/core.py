"""Core NATS intake: the generate subject in the workers' queue group, plus this worker's
instance subject (direct routing), both plain queue subscriptions.

Each message is one request; its reply subject is where the frames go. nats-py runs one
subscription's callbacks one after another, so the callback only validates and hands off (the
request streams in its own task). Failure guard: whatever raises while taking a message, the
request gets its one `internal_error` frame and the subscription goes on. At most once: a worker
that dies mid-request loses it (the client's timer notices; JetStream mode redelivers).
"""

from __future__ import annotations

import logging
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from worker.errors import describe
from worker.nats.liveness import Liveness, NatsReply
from worker.service import Delivery, RequestService
from worker.shared.nats_connection import unsubscribe_all

log = logging.getLogger(__name__)


class CoreIntake:
    def __init__(
        self, worker: RequestService, nc: NATS, liveness: Liveness, subjects: list[tuple[str, str]]
    ) -> None:
        """`subjects`: (subject, queue group) pairs to take requests from."""
        self.worker = worker
        self.nc = nc
        self.liveness = liveness
        self.subjects = subjects
        self._subscriptions: list[Subscription] = []

    async def start(self) -> None:
        for subject, queue in self.subjects:
            self._subscriptions.append(await self.nc.subscribe(subject, queue, cb=self._take))

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
            await self.worker.accept(delivery)
        except Exception as error:
            # accept publishes at most one frame, its last step, so an error here means none
            # went out: this one is seq 0.
            log.exception("request on %s failed before it was admitted", msg.subject)
            try:
                await self.worker.answer_error(delivery, "internal_error", describe(error))
            except Exception:
                log.exception("could not answer the failed request on %s", msg.subject)
