"""Durable work-queue mode (`--mode jetstream`): requests wait in a JetStream stream, and workers
share one durable pull consumer, fetching only as many as they have free capacity.

Settings and why:
- stream `<NAMESPACE>_<COMPONENT>_<ENDPOINT>` on `<namespace>.<component>.queue.<endpoint>` (its
  own subject: no clash with the core subjects), retention WorkQueue (a message is removed once
  acked or terminated), file storage, `max_age` so requests nobody could serve expire;
- durable pull consumer (default `vllm-workers`): explicit acks, `ack_wait` (30 s) with in-progress
  acks (+WPI) when taken and every `ack_wait / 3` while generating, so only a dead worker's
  requests are redelivered; `max_deliver` (3) bounds attempts; `max_ack_pending` bounds requests
  out at once;
- fetches ask for the free slots only; a message delivered past them (a pull request that
  outlived its fetch) is taken from the buffer at once, and NAKed as overloaded if no slot is free;
- the reply subject travels in the `Reply-To` header (a JetStream message's own reply subject is
  its ack subject); frames carry `attempt` = the delivery count;
- ack after the final frame is published; a retryable failure with attempts left is NAKed
  (no error frame: the next attempt answers); on the last attempt the client gets the error frame
  and the message is terminated (+TERM); invalid requests are answered and terminated at once;
- on drain the pull stops; requests still running at the drain timeout are NAKed back.

An existing stream or consumer with incompatible settings is never changed: the worker refuses to
start and says what differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import TYPE_CHECKING

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from messages.errors import disposition
from messages.subjects import REPLY_HEADER, Subjects
from worker.config import JetStreamSettings
from worker.errors import describe
from worker.nats.discovery import Endpoint
from worker.nats.liveness import Liveness, NatsReply
from worker.service import Delivery, RequestService
from worker.session import Outcome
from worker.shared import nats_compat
from worker.shared.log_text import loggable

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

log = logging.getLogger(__name__)

_BUFFER_CHECK_S = 0.1
"""How often a worker with no free slot looks for messages delivered to it all the same."""


async def _nak_all(messages: list[Msg]) -> None:
    for msg in messages:
        try:
            await msg.nak()
        except Exception as error:  # the connection is going: the server redelivers later
            log.debug("jetstream: could not NAK message: %r", error)


class JetStreamConfigError(RuntimeError):
    """An existing stream or consumer is configured incompatibly with this worker."""


def stream_name(subjects: Subjects, settings: JetStreamSettings) -> str:
    if settings.stream:
        return settings.stream
    raw = f"{subjects.namespace}_{subjects.component}_{subjects.endpoint}"
    return re.sub(r"[^A-Za-z0-9_]", "_", raw).upper()


async def ensure_stream_and_consumer(
    js: JetStreamContext, subjects: Subjects, settings: JetStreamSettings
) -> str:
    """Creates the stream and consumer, or checks existing ones; returns the stream name."""
    name = stream_name(subjects, settings)
    subject = subjects.queue
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        await js.add_stream(
            api.StreamConfig(
                name=name,
                subjects=[subject],
                retention=api.RetentionPolicy.WORK_QUEUE,
                storage=api.StorageType.FILE,
                max_age=settings.max_age_s,
            )
        )
        log.info("created work-queue stream %s on %s", name, subject)
    else:
        config = info.config
        problems = []
        if config.retention != api.RetentionPolicy.WORK_QUEUE:
            retention = getattr(config.retention, "value", config.retention)
            problems.append(f"retention is {retention}, not workqueue")
        if subject not in (config.subjects or []):
            problems.append(f"subjects {config.subjects} do not include {subject}")
        if problems:
            raise JetStreamConfigError(
                f"stream {name} exists but " + "; ".join(problems) + ": --mode jetstream needs a "
                f"work-queue stream on {subject}. Delete the stream or pick another --js-stream."
            )
    wanted = api.ConsumerConfig(
        durable_name=settings.durable,
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=settings.ack_wait_s,
        max_deliver=settings.max_deliver,
        max_ack_pending=settings.max_ack_pending,
        filter_subject=subject,
    )
    try:
        consumer = await js.consumer_info(name, settings.durable)
    except NotFoundError:
        await js.add_consumer(name, wanted)
        log.info("created durable pull consumer %s on %s", settings.durable, name)
        return name
    have = consumer.config
    problems = []
    if have.deliver_subject:
        problems.append("it is a push consumer")
    if have.ack_policy != api.AckPolicy.EXPLICIT:
        problems.append(f"ack_policy is {have.ack_policy}")
    for field in ("ack_wait", "max_deliver", "max_ack_pending"):
        if getattr(have, field) != getattr(wanted, field):
            problems.append(f"{field} is {getattr(have, field)}, wanted {getattr(wanted, field)}")
    if problems:
        raise JetStreamConfigError(
            f"consumer {settings.durable} on stream {name} exists but "
            + "; ".join(problems)
            + ". Start every worker with the same --js-* settings, or delete the consumer."
        )
    return name


class JetStreamIntake:
    """Pulls requests from the shared consumer into the worker, as capacity frees up.

    Invariants: every message taken is settled (ACK, NAK or TERM, by
    `messages.errors.disposition`) whatever happens while taking it; its in-progress ticker runs
    only while its request runs. The pull loop survives any one message; if it dies anyway,
    `failed` is set and the worker exits non-zero rather than stay registered and answering
    pings with nobody pulling.
    """

    def __init__(
        self,
        service: RequestService,
        nc: NATS,
        liveness: Liveness,
        subjects: Subjects,
        settings: JetStreamSettings,
    ) -> None:
        self.service = service
        self.nc = nc
        self.liveness = liveness
        self.subjects = subjects
        self.settings = settings
        self.capacity = settings.capacity
        self.endpoints: list[Endpoint] = []  # the queue is the stream's, not a subscription's
        self._subscription: JetStreamContext.PullSubscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._settling: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.failed = asyncio.Event()
        """Set when the pull loop died: the worker must exit (cli: exit status 1)."""

    def describe(self) -> tuple[dict[str, str], str]:
        stream = stream_name(self.subjects, self.settings)
        metadata = {
            "mode": "jetstream",
            "stream": stream,
            "consumer": self.settings.durable,
            "queue_subject": self.subjects.queue,
        }
        serving = (
            f"JetStream stream {stream} (consumer {self.settings.durable}, {self.subjects.queue})"
        )
        return metadata, serving

    async def start(self) -> None:
        js = self.nc.jetstream()
        subjects = self.subjects
        stream = await ensure_stream_and_consumer(js, subjects, self.settings)
        self._subscription = await js.pull_subscribe_bind(
            durable=self.settings.durable, stream=stream
        )
        self._task = asyncio.create_task(self._pull(self._subscription))
        self._task.add_done_callback(self._pull_ended)
        log.info(
            "jetstream: pulling %s (stream %s, consumer %s) up to %d at once",
            subjects.queue,
            stream,
            self.settings.durable,
            self.capacity,
        )

    def _pull_ended(self, task: asyncio.Task[None]) -> None:
        if self._stopping:
            return
        error = None if task.cancelled() else task.exception()
        log.critical("jetstream: the pull loop ended unexpectedly: %r", error, exc_info=error)
        self.failed.set()

    async def _pull(self, subscription: JetStreamContext.PullSubscription) -> None:
        # Load-aware: ask only for as many messages as there are free slots, so a busy worker
        # leaves the queue to idle peers (unlike a queue group's random pick).
        while not self._stopping:
            # Delivered past any fetch (a pull request that outlived its fetch: a busy event
            # loop flushed it late): taken now, each served if a slot is free, else refused as
            # overloaded and NAKed for a peer. Left in the buffer with no slot free, they would
            # wait past `ack_wait`, be delivered again and be served twice.
            await self._take_all(nats_compat.take_buffered(subscription))
            if self.service.asleep or self.service.in_flight >= self.capacity:
                with contextlib.suppress(asyncio.TimeoutError):  # not TimeoutError on 3.10
                    await asyncio.wait_for(
                        self.service.wait_for_capacity(self.capacity), _BUFFER_CHECK_S
                    )
                continue
            try:
                messages = await subscription.fetch(
                    batch=self.capacity - self.service.in_flight,
                    timeout=self.settings.fetch_timeout_s,
                )
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                # Nothing queued. nats-py raises asyncio's own TimeoutError too when the pull's
                # reply is slow (seen on a loaded host): the same empty fetch, not a failure.
                continue
            except Exception as error:  # connection trouble: nats-py reconnects; try again
                if self._stopping:
                    return
                log.warning("jetstream fetch failed: %r", error)
                await asyncio.sleep(0.5)
                continue
            await self._take_all(messages)

    async def _take_all(self, messages: list[Msg]) -> None:
        """Takes each message in turn; cancelled on the way (the intake stopping), it NAKs the
        ones it had not begun, so they go out again at once rather than after `ack_wait`."""
        begun = 0
        try:
            unheard = await asyncio.gather(*(self._unheard_redelivery(m) for m in messages))
            for msg, drop in zip(messages, unheard, strict=True):
                begun += 1
                if drop:
                    await msg.term()
                else:
                    await self._take_guarded(msg)
        finally:
            await _nak_all(messages[begun:])

    async def _unheard_redelivery(self, msg: Msg) -> bool:
        """Whether `msg` is a redelivery whose reply subject nobody listens on any more: its
        publisher continued the request as a new message (worker.client.jetstream_stream) or
        left, so no attempt is started for nobody."""
        reply = (msg.headers or {}).get(REPLY_HEADER, "")
        if not reply or msg.metadata.num_delivered <= 1:
            return False
        if await self.liveness.listened(reply) is not False:
            return False
        log.info(
            "jetstream: terminated attempt %d of message %d: nobody listens on its reply "
            "subject any more (its publisher continued it elsewhere or left)",
            msg.metadata.num_delivered,
            msg.metadata.sequence.stream,
        )
        return True

    def _delivery(self, msg: Msg, reply: str) -> Delivery:
        attempt = msg.metadata.num_delivered
        return Delivery(
            msg.data,
            msg.headers,
            NatsReply(self.liveness, reply),
            self.subjects.queue,
            time.monotonic_ns(),
            attempt=attempt,
            redelivers=attempt < self.settings.max_deliver,
        )

    async def _take_guarded(self, msg: Msg) -> None:
        """Takes one message; a failure while taking it settles it instead of ending the loop:
        a worker bug is an internal_error (retryable: NAK while attempts are left, else its
        error frame and TERM). A payload's own faults never get here: accept answers them."""
        try:
            await self._take(msg)
        except Exception as error:
            log.exception("jetstream: taking a message failed")
            try:
                reply = (msg.headers or {}).get(REPLY_HEADER, "")
                delivery = self._delivery(msg, reply)
                if not delivery.redelivers and reply:
                    await self.service.answer_error(delivery, "internal_error", describe(error))
                await self._settle(msg, "internal_error", delivery.redelivers)
            except Exception:
                log.exception("jetstream: could not settle a failed message (redelivered later)")

    async def _settle(self, msg: Msg, code: str | None, attempts_left: bool) -> None:
        match disposition(code, attempts_left=attempts_left):
            case "ack":
                await msg.ack()
            case "nak":
                # No slot free ("overloaded") means a message delivered past this worker's room
                # by a pull request that outlived its fetch, which lives at most a fetch timeout
                # more: it comes back after that, for a peer, not to the same pull request.
                overloaded = code == "overloaded"
                await msg.nak(delay=self.settings.fetch_timeout_s if overloaded else 0.5)
            case "term":
                await msg.term()

    async def _take(self, msg: Msg) -> None:
        reply = (msg.headers or {}).get(REPLY_HEADER, "")
        if not reply:
            log.warning("terminated a queued request without a %s header", REPLY_HEADER)
            await msg.term()
            return
        if self._stopping:
            await msg.nak()
            return
        delivery = self._delivery(msg, reply)
        admitted = await self.service.accept(delivery)
        if isinstance(admitted, str):  # refused: answered, unless left to a redelivery
            await self._settle(msg, admitted, delivery.redelivers)
            return
        settling = asyncio.create_task(self._settle_when_done(msg, admitted, delivery))
        self._settling.add(settling)
        settling.add_done_callback(self._settling.discard)

    async def _settle_when_done(
        self, msg: Msg, running: asyncio.Task[Outcome], delivery: Delivery
    ) -> None:
        progress = asyncio.create_task(self._keep_in_progress(msg))
        try:
            outcome = await asyncio.shield(running)
        except asyncio.CancelledError:
            outcome = None
        finally:
            progress.cancel()
        try:
            if outcome is None:  # the intake stops: another worker takes it
                await msg.nak()
                return
            if outcome.requeue:
                log.info(
                    "request %s attempt %s: NAK for another attempt",
                    loggable(outcome.request_id),
                    delivery.attempt,
                )
            await self._settle(msg, outcome.error_code, delivery.redelivers)
        except Exception:
            log.exception("jetstream: settling request %s failed", msg.metadata.sequence)

    async def _keep_in_progress(self, msg: Msg) -> None:
        # The first one at once: `ack_wait` runs from the delivery, and the fetch, the take and
        # the admission before this (late on a starved event loop) already used part of it.
        interval = self.settings.ack_wait_s / 3
        while True:
            try:
                await msg.in_progress()
            except Exception as error:
                log.warning("in-progress ack failed: %s", error)
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._subscription is not None:
            # Delivered and never taken: back to the queue now, not at `ack_wait`.
            await _nak_all(nats_compat.take_buffered(self._subscription))
            try:
                await self._subscription.unsubscribe()
            except Exception as error:  # the connection is closing anyway
                log.debug("jetstream unsubscribe failed: %r", error)
