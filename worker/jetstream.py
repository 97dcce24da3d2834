"""Durable work-queue mode (`--mode jetstream`): requests wait in a JetStream stream, and workers
share one durable pull consumer, fetching only as many as they have free capacity.

Settings and why:
- stream `<NAMESPACE>_<COMPONENT>_<ENDPOINT>` on `<namespace>.<component>.queue.<endpoint>` (its
  own subject: no clash with the core subjects), retention WorkQueue (a message is removed once
  acked or terminated), file storage, `max_age` so requests nobody could serve expire;
- durable pull consumer (default `vllm-workers`): explicit acks, `ack_wait` (30 s) with in-progress
  acks (+WPI) every `ack_wait / 3` while generating, so only a dead worker's requests are
  redelivered; `max_deliver` (3) bounds attempts; `max_ack_pending` bounds requests out at once;
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
import logging
import re
import time
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from messages.subjects import Subjects
from worker.engine_api import describe
from worker.service import Delivery, Worker
from worker.session import Outcome

log = logging.getLogger(__name__)

REPLY_HEADER = "Reply-To"


class JetStreamConfigError(RuntimeError):
    """An existing stream or consumer is configured incompatibly with this worker."""


@dataclass(kw_only=True)
class JetStreamSettings:
    stream: str | None = None
    """Stream name; default `<NAMESPACE>_<COMPONENT>_<ENDPOINT>`."""
    durable: str = "vllm-workers"
    ack_wait_s: float = 30.0
    max_deliver: int = 3
    max_ack_pending: int = 1024
    max_age_s: float = 3600.0
    fetch_timeout_s: float = 1.0


def stream_name(subjects: Subjects, settings: JetStreamSettings) -> str:
    if settings.stream:
        return settings.stream
    raw = f"{subjects.namespace}_{subjects.component}_{subjects.endpoint}"
    return re.sub(r"[^A-Za-z0-9_]", "_", raw).upper()


async def ensure_stream_and_consumer(js, subjects: Subjects, settings: JetStreamSettings) -> str:
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

    Invariants: every message taken is settled (ACK, NAK or TERM) whatever happens while taking
    it; its in-progress ticker runs only while its request runs. The pull loop survives any
    one message; if it dies anyway, `failed` is set and the worker exits non-zero rather than
    stay registered and answering pings with nobody pulling.
    """

    def __init__(
        self, worker: Worker, nc: NATS, settings: JetStreamSettings, capacity: int
    ) -> None:
        self.worker = worker
        self.nc = nc
        self.settings = settings
        self.capacity = capacity
        self._subscription = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.failed = asyncio.Event()
        """Set when the pull loop died: the worker must exit (cli: exit status 1)."""

    async def start(self) -> None:
        js = self.nc.jetstream()
        subjects = self.worker.config.subjects
        stream = await ensure_stream_and_consumer(js, subjects, self.settings)
        self._subscription = await js.pull_subscribe_bind(
            durable=self.settings.durable, stream=stream
        )
        self._task = asyncio.create_task(self._pull())
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

    async def _pull(self) -> None:
        # Load-aware: ask only for as many messages as there are free slots, so a busy worker
        # leaves the queue to idle peers (unlike a queue group's random pick).
        while not self._stopping:
            free = self.capacity - self.worker.in_flight
            if free <= 0:
                self.worker.capacity_freed.clear()
                await self.worker.capacity_freed.wait()
                continue
            try:
                messages = await self._subscription.fetch(
                    batch=free, timeout=self.settings.fetch_timeout_s
                )
            except nats.errors.TimeoutError:
                continue
            except Exception as error:  # connection trouble: nats-py reconnects; try again
                if self._stopping:
                    return
                log.warning("jetstream fetch failed: %r", error)
                await asyncio.sleep(0.5)
                continue
            for msg in messages:
                await self._take_guarded(msg)

    async def _take_guarded(self, msg: Msg) -> None:
        """Takes one message; a failure while taking it settles it instead of ending the loop."""
        try:
            await self._take(msg)
        except Exception as error:
            log.exception("jetstream: taking a message failed")
            await self._settle_failed(msg, error)

    async def _settle_failed(self, msg: Msg, error: Exception) -> None:
        """A message whose taking raised (a worker bug: the payload's faults are answered as
        invalid_request by accept): internal_error, retryable, so NAK while attempts are left;
        on the last one answer with an error frame and TERM."""
        attempt = msg.metadata.num_delivered
        try:
            if attempt < self.settings.max_deliver:
                await msg.nak(delay=0.5)
                return
            reply = (msg.headers or {}).get(REPLY_HEADER, "")
            if reply:
                await self.worker.answer_error(
                    reply, msg.headers, attempt, "internal_error", describe(error)
                )
            await msg.term()
        except Exception:
            log.exception("jetstream: could not settle a failed message (it will be redelivered)")

    async def _take(self, msg: Msg) -> None:
        attempt = msg.metadata.num_delivered
        reply = (msg.headers or {}).get(REPLY_HEADER, "")
        if not reply:
            log.warning("terminated a queued request without a %s header", REPLY_HEADER)
            await msg.term()
            return
        if self._stopping:
            await msg.nak()
            return
        progress: asyncio.Task[None] | None = None

        async def settle(outcome: Outcome) -> None:
            if progress is not None:
                progress.cancel()
            if outcome.requeue:
                log.info(
                    "request %s attempt %d: NAK for another attempt", outcome.request_id, attempt
                )
                await msg.nak(delay=0.5)
            elif outcome.error_code is not None:
                await msg.term()
            else:
                await msg.ack()

        refused = await self.worker.accept(
            Delivery(
                msg.data,
                msg.headers,
                reply,
                self.worker.config.subjects.queue,
                time.monotonic_ns(),
                attempt=attempt,
                final_attempt=attempt >= self.settings.max_deliver,
                requeue_refusals=True,
                on_done=settle,
            )
        )
        if refused is None:
            # Running: settle() runs when it ends, which cannot be before this line (no await
            # since accept returned), so the ticker is always there to cancel.
            progress = asyncio.create_task(self._keep_in_progress(msg))
        elif refused == "invalid_request":
            await msg.term()  # answered with an error frame; retrying cannot help
        else:
            await msg.nak()

    async def _keep_in_progress(self, msg: Msg) -> None:
        interval = self.settings.ack_wait_s / 3
        while True:
            await asyncio.sleep(interval)
            try:
                await msg.in_progress()
            except Exception as error:
                log.warning("in-progress ack failed: %s", error)

    async def stop(self) -> None:
        self._stopping = True
        self.worker.capacity_freed.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._subscription is not None:
            try:
                await self._subscription.unsubscribe()
            except Exception:
                pass
