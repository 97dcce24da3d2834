"""The publisher side: send a GenerateRequest over NATS and read its frames.

Needs only nats-py and `messages` (no vllm or torch). It subscribes to its own inbox before
publishing (so no frame can be missed), checks `seq` order, enforces a per-frame timeout, and
stops at the request's end: every choice finished, or one error frame. A caller that stops
iterating early (break, cancellation, an exception) cancels the request on the workers, so the
engine is freed at once (the cancel names the request's inbox, so it reaches no other
publisher's request of the same id). Frames are read by worker.client.reader.

A retryable refusal (`overloaded`, `worker_shutdown`) that comes before anything was yielded is
retried on another worker: `discover_workers` asks the workers' NATS micro STATS which instances
serve the subject and how busy they are, and the next attempt goes to the least busy one with
free capacity on its instance subject, never to one that already refused. A draining worker has
stopped answering discovery, so it is not discovered at all.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.micro.service import ServiceInfo, ServiceStats

from messages.codec import JSON, MSGPACK, Codec
from messages.errors import is_refusal, is_retryable
from messages.frames import ErrorInfo, ResponseFrame
from messages.request import CancelRequest, GenerateRequest
from messages.subjects import REPLY_HEADER, SERVICE_NAME, Subjects
from worker.client.migration import MIGRATION_LIMIT, SILENCE_TIMEOUT_S, Seam
from worker.client.reader import (
    Completion,
    Inbox,
    RequestEnd,
    RequestError,
    WorkerLost,
    fold,
    read_frames,
)
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)


async def publish_cancel(nc: NATS, cancel_subject: str, request_id: str, inbox: str) -> None:
    """Cancels the request of this id whose frames go to `inbox`: only the publisher knows its
    inbox, so a request of another publisher with the same id is not touched."""
    cancel = CancelRequest(request_id=request_id, reply_subject=inbox)
    try:
        await nc.publish(cancel_subject, MSGPACK.encode(cancel))
    except Exception as error:  # connection gone: the worker's liveness probe notices instead
        log.info(
            "cancel of request %s not sent (%r): the worker finds its client gone",
            request_id,
            error,
        )


async def stream_frames(
    nc: NATS,
    subject: str,
    payload: bytes,
    *,
    codec: Codec = MSGPACK,
    choices: int = 1,
    timeout: float = 60.0,
    request_id: str | None = None,
    cancel_subject: str | None = None,
    silence: float | None = None,
) -> AsyncGenerator[ResponseFrame, None]:
    """Frames of one request, in order, until all `choices` finished or an error frame.

    With `request_id` and `cancel_subject`, leaving early publishes a cancel for the request.
    `silence`: WorkerLost after that long without any message (worker.client.reader).
    """
    inbox = nc.new_inbox()
    subscription = await Inbox.open(nc, inbox)
    headers = {"Content-Type": codec.content_type} if codec is JSON else None
    end = RequestEnd(choices)
    try:
        await nc.publish(subject, payload, reply=inbox, headers=headers)
        reader = read_frames(subscription, codec, end, timeout, silence=silence)
        async with aclosing(reader) as frames:
            async for frame in frames:
                yield frame
    finally:
        if not end.ended and request_id is not None and cancel_subject is not None:
            await publish_cancel(nc, cancel_subject, request_id, inbox)
        await subscription.unsubscribe()


@dataclass(frozen=True)
class WorkerInstance:
    """One worker as its micro STATS describe it."""

    instance_id: str
    subject: str
    """Its instance subject (`<generate subject>.<instance_id>`)."""
    in_flight: int
    max_concurrency: int | None
    engine_id: str | None = None
    """The engine core it shares with other instances (`--worker-processes`); None: its own."""
    kv_snapshots: bool = True
    """Whether it may answer KV snapshots: False for the processes of an engine that report
    load only (metadata `kv_events` `load-only`); True where unknown."""

    @property
    def has_capacity(self) -> bool:
        return self.max_concurrency is None or self.in_flight < self.max_concurrency


async def discover_workers(
    nc: NATS, generate_subject: str, *, window: float = 0.25, name: str = SERVICE_NAME
) -> list[WorkerInstance]:
    """Workers that serve `generate_subject`, from every answer to `$SRV.STATS.<name>` that
    arrives within `window` seconds (micro services answer a discovery request each)."""
    found: list[WorkerInstance] = []
    async for data in discovery_answers(nc, f"$SRV.STATS.{name}", window):
        instance = _instance_from_stats(data, generate_subject)
        if instance is not None:
            found.append(instance)
    return found


async def discovery_answers(nc: NATS, subject: str, window: float) -> AsyncGenerator[bytes, None]:
    """Every answer to one discovery request on `subject` (each micro service answers it once)
    that arrives within `window` seconds, as it arrives."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, b"", reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + window
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await subscription.next_msg(timeout=left)
            except Exception:  # nats TimeoutError: the window is over
                return
            yield msg.data
    finally:
        await subscription.unsubscribe()


async def find_worker(
    nc: NATS,
    generate_subject: str,
    *,
    window: float,
    jetstream: bool = False,
    name: str = SERVICE_NAME,
) -> dict[str, str] | None:
    """The discovery metadata (`instance_id`, `model`, `max_model_len`, ...) of the first worker
    that answers `$SRV.INFO.<name>` within `window` seconds and serves `generate_subject` (with
    `jetstream`: that subject's work queue); None when none does."""
    queue = subjects_of(generate_subject).queue if jetstream else None
    async with aclosing(discovery_answers(nc, f"$SRV.INFO.{name}", window)) as answers:
        async for data in answers:
            try:
                info = ServiceInfo.from_dict(json.loads(data))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not a micro INFO answer
            metadata = dict(info.metadata or {})
            subjects = {e.subject for e in info.endpoints}
            if (queue is None and generate_subject in subjects) or (
                queue is not None and metadata.get("queue_subject") == queue
            ):
                return metadata
    return None


def _instance_from_stats(data: bytes, generate_subject: str) -> WorkerInstance | None:
    try:
        stats = ServiceStats.from_dict(json.loads(data))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # not a micro STATS answer
    endpoint = next((e for e in stats.endpoints if e.subject == generate_subject), None)
    metadata = stats.metadata or {}
    if endpoint is None or "instance_id" not in metadata:
        return None  # a worker of other subjects (or JetStream mode: no core endpoints)
    instance_id = metadata["instance_id"]
    limit = metadata.get("max_concurrency", "unlimited")
    try:
        in_flight = int((endpoint.data or {}).get("in_flight", 0))
        max_concurrency = None if limit == "unlimited" else int(limit)
    except (ValueError, TypeError):
        return None
    return WorkerInstance(
        instance_id,
        f"{generate_subject}.{instance_id}",
        in_flight,
        max_concurrency,
        metadata.get("engine_id"),
        metadata.get("kv_events") != "load-only",
    )


def generate(
    nc: NATS,
    request: GenerateRequest,
    *,
    subject: str | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
    retries: int = 2,
    discovery_window: float = 0.25,
    migration_limit: int = MIGRATION_LIMIT,
    silence_timeout: float | None = SILENCE_TIMEOUT_S,
) -> AsyncGenerator[ResponseFrame, None]:
    """`async for frame in generate(nc, request)`: the request's frames as they stream.

    `subject` is the generate subject (or an instance subject under it); cancels go to the
    cancel subject of the same namespace/component/endpoint. A retryable refusal that comes
    before any frame was yielded is retried up to `retries` times on other workers (see the
    module's docstring); when none is left, RequestError names the code and every refusal.

    A worker lost mid-request (silent for `silence_timeout` s; None: never taken for lost) or a
    retryable error frame that is not a refusal continues the request on another worker, up to
    `migration_limit` times (worker/client/migration.py); the caller's stream goes on as one.
    Past the limit, or for a request that cannot be continued, the error frame is yielded as it
    came, and a lost worker raises RequestError `worker_lost` (retryable). Any other error frame
    is yielded as it came. `timeout`: the longest wait for any message.
    """
    base = Subjects.parse(subject or Subjects().generate)[0].generate

    def leg(request: GenerateRequest, migration: int) -> AsyncGenerator[ResponseFrame, None]:
        return _generate_leg(
            nc,
            request,
            # A continuation goes to the queue group: whoever is alive takes it.
            subject=subject if migration == 0 else base,
            codec=codec,
            timeout=timeout,
            retries=retries,
            discovery_window=discovery_window,
            silence=silence_timeout,
        )

    return _migrating(request, leg, migration_limit)


def _migrating(
    request: GenerateRequest, leg: Leg, migration_limit: int
) -> AsyncGenerator[ResponseFrame, None]:
    """The request's frames over as many legs as it takes; with migration off, its one leg as
    it comes (no seam to keep: what bench/migration_cost.py compares against)."""
    if migration_limit <= 0:
        return leg(request, 0)
    return _continued(request, leg, migration_limit)


Leg = Callable[[GenerateRequest, int], AsyncGenerator[ResponseFrame, None]]
"""One leg of a request: (the leg's request, how many migrations came before) → its frames."""


async def _continued(
    request: GenerateRequest, leg: Leg, migration_limit: int
) -> AsyncGenerator[ResponseFrame, None]:
    """The request's frames as one stream over as many legs as it takes (see `generate`)."""
    seam = Seam(request)
    current = request
    for migration in itertools.count():
        lost, error_frame = None, None
        try:
            async with aclosing(leg(current, migration)) as frames:
                async for frame in frames:
                    if frame.error and is_retryable(frame.error.code):
                        lost, error_frame = f"{frame.error.code}: {frame.error.message}", frame
                        break
                    if (out := seam.translate(frame)) is not None:
                        yield out
        except WorkerLost as error:
            lost = error.message
        if lost is None:
            return
        refused = seam.why_not_continued() or (
            f"migration limit {migration_limit} reached" if migration >= migration_limit else None
        )
        if refused is not None:
            if error_frame is not None:
                if (out := seam.translate(error_frame)) is not None:
                    yield out
                return
            raise WorkerLost(f"{lost}; not continued: {refused}")
        continuation = seam.continuation()
        log.info(
            "request %s: %s; continued on another worker after %d token(s) (migration %d)",
            loggable(request.request_id),
            loggable(lost),
            len(seam.tokens),
            migration + 1,
        )
        if continuation is None:
            yield seam.final_frame()
            return
        current = continuation


async def other_workers(
    nc: NATS, base: str, refused: set[str], window: float
) -> list[WorkerInstance]:
    """Workers on `base` with free capacity that have not refused this request. A worker's
    discovery answer can miss a short window on a busy host, so finding none is only believed
    after a second look four times as long."""
    for look in (window, 4 * window):
        candidates = [
            worker
            for worker in await discover_workers(nc, base, window=look)
            if worker.instance_id not in refused and worker.has_capacity
        ]
        if candidates:
            return candidates
    return []


async def _generate_leg(
    nc: NATS,
    request: GenerateRequest,
    *,
    subject: str | None,
    codec: Codec,
    timeout: float,
    retries: int,
    discovery_window: float,
    silence: float | None,
) -> AsyncGenerator[ResponseFrame, None]:
    """One leg of `generate`: the request sent, refusals retried on other workers."""
    subjects, instance_id = Subjects.parse(subject or Subjects().generate)
    base = subjects.generate
    refused: set[str] = set()
    refusals: list[str] = []
    last: ErrorInfo | None = None
    target = subject or base
    # Every target is the queue group or an instance subject under it: one cancel subject.
    cancel_subject = subjects.cancel
    for attempt in range(retries + 1):
        yielded = False
        refusal: ErrorInfo | None = None
        try:
            async with aclosing(
                stream_frames(
                    nc,
                    target,
                    codec.encode(request),
                    codec=codec,
                    choices=request.sampling_options.n,
                    timeout=timeout,
                    request_id=request.request_id,
                    cancel_subject=cancel_subject,
                    silence=silence,
                )
            ) as frames:
                async for frame in frames:
                    if not yielded and frame.error and is_refusal(frame.error.code):
                        refusal = frame.error
                        break
                    yielded = True
                    yield frame
        except RequestError as error:
            # Nobody on the instance subject (the worker just stopped, or a router's picture is
            # a second old): the queue group may still serve it. Nothing was sent or yielded.
            if error.code != "no_workers" or target == base or yielded or attempt == retries:
                raise
            log.info("no worker on %s: request %s to the queue group", target, request.request_id)
            target, instance_id = base, None
            continue
        if refusal is None:
            return
        last = refusal
        refusals.append(f"{instance_id or 'queue group ' + base}: {refusal.message}")
        if instance_id is not None:
            refused.add(instance_id)
        if attempt == retries:
            break
        candidates = await other_workers(nc, base, refused, discovery_window)
        if not candidates:
            refusals.append("no other worker with free capacity")
            break
        chosen = min(candidates, key=lambda worker: worker.in_flight)
        target, instance_id = chosen.subject, chosen.instance_id
    assert last is not None
    raise RequestError(last.code, f"refused after {attempt + 1} attempt(s): " + "; ".join(refusals))


async def complete(
    nc: NATS,
    request: GenerateRequest,
    *,
    subject: str | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
    retries: int = 2,
    migration_limit: int = MIGRATION_LIMIT,
    silence_timeout: float | None = SILENCE_TIMEOUT_S,
) -> Completion:
    frames = [
        f
        async for f in generate(
            nc,
            request,
            subject=subject,
            codec=codec,
            timeout=timeout,
            retries=retries,
            migration_limit=migration_limit,
            silence_timeout=silence_timeout,
        )
    ]
    return fold(request.request_id, frames, request.sampling_options.n)


async def jetstream_generate(
    nc: NATS,
    request: GenerateRequest,
    *,
    subjects: Subjects | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
    silence: float | None = None,
) -> AsyncGenerator[ResponseFrame, None]:
    """Publishes to the work-queue stream (`--mode jetstream`) with a JetStream ack, then yields
    the frames. Frames carry `attempt`: when a worker died and the request was redelivered, a
    new attempt's frames restart at seq 0 and the caller drops what the old attempt sent (late
    frames of an older attempt are skipped here). `silence`: WorkerLost after that long without
    any message, counted once a worker took the request (it may wait in the stream)."""
    subjects = subjects or Subjects()
    inbox = nc.new_inbox()
    subscription = await Inbox.open(nc, inbox)
    headers = {REPLY_HEADER: inbox}
    if codec is JSON:
        headers["Content-Type"] = codec.content_type
    end = RequestEnd(request.sampling_options.n)
    try:
        await nc.jetstream().publish(subjects.queue, codec.encode(request), headers=headers)
        reader = read_frames(subscription, codec, end, timeout, attempts=True, silence=silence)
        async with aclosing(reader) as frames:
            async for frame in frames:
                yield frame
    finally:
        if not end.ended:
            await publish_cancel(nc, subjects.cancel, request.request_id, inbox)
        await subscription.unsubscribe()


def jetstream_stream(
    nc: NATS,
    request: GenerateRequest,
    *,
    subjects: Subjects | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
    migration_limit: int = MIGRATION_LIMIT,
    silence_timeout: float | None = SILENCE_TIMEOUT_S,
) -> AsyncGenerator[ResponseFrame, None]:
    """`jetstream_generate` for a caller that cannot take output back (a user's stream): one
    stream that never restarts. The publisher owns the continuation: when the worker serving
    the request is lost (silent, or a redelivery restarted the request from token 0 after frames
    were yielded) or ends it with a retryable error frame, the continuation is published to the
    work queue as a new message with a new inbox, so it waits in the stream while no worker is
    up, and nothing the old message's redelivery sends can reach this caller (it goes to the old
    inbox, which nobody reads any more; the worker finds nobody listening and drops it). Limits
    and errors as in `generate`."""

    def leg(request: GenerateRequest, migration: int) -> AsyncGenerator[ResponseFrame, None]:
        return _jetstream_leg(nc, request, subjects, codec, timeout, silence_timeout)

    return _migrating(request, leg, migration_limit)


async def _jetstream_leg(
    nc: NATS,
    request: GenerateRequest,
    subjects: Subjects | None,
    codec: Codec,
    timeout: float,
    silence: float | None,
) -> AsyncGenerator[ResponseFrame, None]:
    """The frames of one attempt of one queue message; a newer attempt after frames were
    yielded is a lost worker (its redelivery starts over at token 0)."""
    attempt = None
    yielded = False
    generated = jetstream_generate(
        nc, request, subjects=subjects, codec=codec, timeout=timeout, silence=silence
    )
    async with aclosing(generated) as frames:
        async for frame in frames:
            if frame.attempt != attempt:
                if yielded:
                    raise WorkerLost(
                        f"the worker serving attempt {attempt} was lost and the queue "
                        f"redelivered the request (attempt {frame.attempt})"
                    )
                attempt = frame.attempt
            yielded = True
            yield frame


def subjects_of(generate_subject: str) -> Subjects:
    """The Subjects of a generate subject `namespace.component.endpoint` (an instance subject's
    too), e.g. for its JetStream queue subject."""
    return Subjects.parse(generate_subject)[0]


async def jetstream_complete(
    nc: NATS,
    request: GenerateRequest,
    *,
    subjects: Subjects | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
) -> tuple[Completion, list[int]]:
    """The last attempt's answer, folded; and the attempts whose frames were seen, in order."""
    frames: list[ResponseFrame] = []
    attempts: list[int] = []
    async for frame in jetstream_generate(
        nc, request, subjects=subjects, codec=codec, timeout=timeout
    ):
        if not attempts or frame.attempt != attempts[-1]:
            attempts.append(frame.attempt or 0)
            frames = []  # a new attempt replaces the partial output of the one before
        frames.append(frame)
    return fold(request.request_id, frames, request.sampling_options.n), attempts


async def connect_url(url: str, **options: Any) -> NATS:
    """A publisher's NATS connection (nats-py's, with its options), for callers that import only
    the client package."""
    return await nats.connect(url, **options)


async def wait_for_worker(nc: NATS, timeout: float, name: str = SERVICE_NAME) -> bool:
    """True once a worker answers `$SRV.PING.<name>` (workers register as NATS micro services)."""
    import time

    import nats.errors

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            await nc.request(f"$SRV.PING.{name}", b"", timeout=1.0)
            return True
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            await asyncio.sleep(0.5)
    return False
