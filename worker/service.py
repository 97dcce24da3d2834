"""The service core: admission, the in-flight registry, cancel, drain and engine health.

It knows neither NATS nor vLLM: an intake (worker/nats/intake/) hands it a `Delivery` whose
`reply` publishes frames back, and it serves the request on the `Engine` contract. The request
path: decode (every unreadable payload is an `invalid_request` frame) → engine-dependent rules
(worker/validation.py) → admission (drain, `max_concurrency`) → one task per request running a
RequestSession (worker/session.py; an EmbedSession, worker/embedding_session.py, where the
engine is a pooling model: its requests are EmbedRequests) → frames through `delivery.reply`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec

from messages.codec import Codec, codec_for
from messages.embeddings import EmbedRequest
from messages.errors import ErrorCode
from messages.request import GenerateRequest
from worker.config import WorkerConfig
from worker.eager import start_eagerly
from worker.embedding_session import EmbedSession
from worker.engine.contract import Engine, EngineDead, InvalidRequest
from worker.framing import FrameWriter
from worker.metrics import WorkerMetrics
from worker.session import Outcome, RequestSession, send_error
from worker.shared.log_text import loggable
from worker.validation import admit, check_embed

log = logging.getLogger(__name__)


class Reply(Protocol):
    """Where one request's frames go (worker/nats/liveness.py implements it over NATS)."""

    subject: str
    """The reply subject: what binds a cancel to the publisher that sent the request."""

    async def publish(self, data: bytes) -> None:
        """Publishes one frame; may wait out a broker outage; raises Undeliverable."""
        ...

    def watch(self, on_gone: Callable[[], None]) -> None:
        """Calls `on_gone` once if the client is found gone while the request runs."""
        ...

    def release(self) -> None:
        """The request ended: stop watching."""
        ...


@dataclass
class Delivery:
    """One request as an intake delivered it."""

    data: bytes
    headers: Mapping[str, str] | None
    reply: Reply
    subject: str
    """Where it came in (per-subject stats)."""
    arrived: int
    """time.monotonic_ns() when the message was taken from NATS."""
    attempt: int | None = None
    """The intake's delivery attempt, carried on every frame (JetStream); None for core NATS."""
    redelivers: bool = False
    """A retryable failure or refusal is left to the intake, which delivers the request again
    (JetStream with attempts left): it ends without an error frame."""


@dataclass
class SubjectStats:
    """What discovery reports per subject (requests taken, errors, time spent streaming)."""

    num_requests: int = 0
    num_errors: int = 0
    processing_time_ns: int = 0
    last_error: str = ""


Session = RequestSession | EmbedSession


@dataclass
class InFlight:
    """A request being served: its session, task, and where its frames go."""

    session: Session
    task: asyncio.Task[Outcome]
    reply: Reply
    deadline: asyncio.TimerHandle | None = None


class _RequestId(msgspec.Struct):
    request_id: str = ""


_ID_DECODERS: dict[str, msgspec.json.Decoder[_RequestId] | msgspec.msgpack.Decoder[_RequestId]] = {
    "json": msgspec.json.Decoder(_RequestId),
    "msgpack": msgspec.msgpack.Decoder(_RequestId),
}


def _salvage_request_id(codec: Codec, data: bytes) -> str:
    """The request_id of a payload that was refused, if it has a readable one (other fields
    are skipped, not built)."""
    decoder = _ID_DECODERS["json" if codec.content_type.endswith("json") else "msgpack"]
    try:
        return decoder.decode(data).request_id[:256]
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return ""


def _decode(codec: Codec, data: bytes, embed: bool) -> GenerateRequest | EmbedRequest:
    """Decodes a request; every way a payload can be unreadable is an InvalidRequest."""
    try:
        if embed:
            return codec.decode_as(data, EmbedRequest)
        return codec.decode_request(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise InvalidRequest("invalid payload", str(error)) from error
    except RecursionError as error:
        # msgspec decodes nested containers recursively, skipped unknown fields included.
        raise InvalidRequest("invalid payload", "nested too deeply to decode") from error


class RequestService:
    def __init__(
        self,
        engine: Engine,
        config: WorkerConfig,
        metrics: WorkerMetrics | None = None,
        *,
        max_payload: int,
    ) -> None:
        self.engine = engine
        self.config = config
        self.max_payload = max_payload
        # The engine's limits plus the operator's caps: what every request is checked against.
        self.limits = dataclasses.replace(
            engine.limits, max_n=config.max_n, max_tokens_limit=config.max_tokens_limit
        )
        self.metrics = metrics
        self.stats: dict[str, SubjectStats] = {}
        self._in_flight: dict[asyncio.Task[Outcome], InFlight] = {}
        self._draining = False
        self._asleep = False
        self._capacity_freed = asyncio.Event()
        self.engine_dead = asyncio.Event()
        self.served = 0
        self.peak_in_flight = 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def draining(self) -> bool:
        """True once `drain` began: no request is admitted any more."""
        return self._draining

    @property
    def asleep(self) -> bool:
        """True while the engine sleeps (vLLM's /sleep): new requests are refused, retryable
        (`overloaded`), and a work queue's pull waits."""
        return self._asleep

    def set_asleep(self, asleep: bool) -> None:
        self._asleep = asleep
        self._capacity_freed.set()  # a pull waiting for capacity looks again

    def stats_data(self) -> dict[str, object]:
        return {
            "in_flight": self.in_flight,
            "served": self.served,
            "engine_unfinished_requests": self.engine.num_unfinished_requests(),
        }

    async def wait_for_capacity(self, limit: int) -> None:
        """Returns once fewer than `limit` requests are in flight and the engine is awake."""
        while self._asleep or self.in_flight >= limit:
            self._capacity_freed.clear()
            await self._capacity_freed.wait()

    def _writer(self, delivery: Delivery) -> FrameWriter:
        codec = codec_for(delivery.headers, delivery.data)
        return FrameWriter(codec, self.max_payload, delivery.reply.publish, delivery.attempt)

    async def accept(self, delivery: Delivery) -> asyncio.Task[Outcome] | ErrorCode:
        """Validates and admits one request, then serves it in its own task.

        Returns the running request's task (its result is the Outcome), or the code it was
        refused with. A refusal is answered with an error frame, except a retryable one when
        `delivery.redelivers` (the intake delivers it again instead).
        """
        self.stats.setdefault(delivery.subject, SubjectStats()).num_requests += 1
        writer = self._writer(delivery)
        try:
            if len(delivery.data) > self.config.max_request_bytes:
                raise InvalidRequest(
                    "payload",
                    f"{len(delivery.data)} bytes exceeds max_request_bytes "
                    f"{self.config.max_request_bytes}",
                )
            decoded = _decode(writer.codec, delivery.data, self.limits.kind == "embed")
            if isinstance(decoded, EmbedRequest):
                check_embed(decoded, self.limits)
            else:
                admit(decoded, self.limits)
        except InvalidRequest as error:
            request_id = _salvage_request_id(writer.codec, delivery.data)
            await self._refuse(writer, delivery, request_id, error.code, str(error))
            return error.code
        limit = self.config.max_concurrency
        refusal: tuple[ErrorCode, str] | None = None
        if self._draining:
            refusal = ("worker_shutdown", "worker is shutting down: retry on another worker")
        elif self._asleep:
            refusal = ("overloaded", "worker is asleep (/sleep): retry on another worker")
        elif limit is not None and self.in_flight >= limit:
            refusal = ("overloaded", f"worker at max_concurrency {limit}: retry on another worker")
        if refusal is not None:
            if delivery.redelivers:
                log.info(
                    "request %s %s, left to a redelivery (attempt %s): %s",
                    loggable(decoded.request_id),
                    refusal[0],
                    delivery.attempt,
                    refusal[1],
                )
            else:
                await self._refuse(writer, delivery, decoded.request_id, *refusal)
            return refusal[0]
        session = self._session(decoded, writer, delivery)
        # Admission first: the request reaches the engine in this turn, ahead of the other
        # streams' output work already queued in the event loop (worker/eager.py).
        task = start_eagerly(self._serve(session, delivery))
        entry = InFlight(session, task, delivery.reply)
        delivery.reply.watch(functools.partial(self._client_gone, entry))
        if decoded.timeout_ms is not None:
            entry.deadline = asyncio.get_running_loop().call_later(
                decoded.timeout_ms / 1000,
                session.cancel,
                task,
                "deadline_exceeded",
                f"timeout_ms {decoded.timeout_ms} passed",
            )
        self._in_flight[task] = entry
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        task.add_done_callback(self._done)
        return task

    def _session(
        self, request: GenerateRequest | EmbedRequest, writer: FrameWriter, delivery: Delivery
    ) -> Session:
        engine_request_id = f"{request.request_id}-{uuid.uuid4().hex[:12]}"
        final_attempt = not delivery.redelivers
        arrived = delivery.arrived / 1e9
        if isinstance(request, GenerateRequest):
            return RequestSession(
                request,
                self.engine,
                writer,
                engine_request_id,
                self.metrics,
                final_attempt,
                arrived=arrived,
            )
        assert self.engine.embedder is not None  # an engine of kind "embed" has one
        return EmbedSession(
            request, self.engine.embedder, writer, engine_request_id, final_attempt, arrived=arrived
        )

    def _done(self, task: asyncio.Task[Outcome]) -> None:
        entry = self._in_flight.pop(task)
        entry.reply.release()
        if entry.deadline is not None:
            entry.deadline.cancel()
        self._capacity_freed.set()

    def _client_gone(self, entry: InFlight) -> None:
        if not entry.task.done():
            log.info(
                "request %s: client gone, aborting", loggable(entry.session.request.request_id)
            )
            entry.session.cancel(entry.task, "client_gone", "nobody listens on the reply subject")

    def cancel(self, request_id: str, reply_subject: str) -> int:
        """Cancels the running request(s) with this id whose frames go to `reply_subject`: an
        equal request_id of another publisher is not touched. Returns how many."""
        cancelled = 0
        for entry in list(self._in_flight.values()):
            if (
                entry.session.request.request_id == request_id
                and entry.reply.subject == reply_subject
            ):
                log.info("request %s cancelled by its client", loggable(request_id))
                entry.session.cancel(entry.task)
                cancelled += 1
        return cancelled

    async def answer_error(self, delivery: Delivery, code: ErrorCode, message: str) -> None:
        """Ends a request that failed before it ran (its intake's guard caught the error) with
        its one error frame (seq 0)."""
        await self._refuse(self._writer(delivery), delivery, "", code, message)

    async def _refuse(
        self,
        writer: FrameWriter,
        delivery: Delivery,
        request_id: str,
        code: ErrorCode,
        message: str,
    ) -> None:
        log.info("request %s %s error=%s", loggable(request_id or "-"), code, loggable(message))
        self._record(delivery, f"{code}: {message}")
        if self.metrics is not None:
            self.metrics.error(code)
            self.metrics.finished([code])
        await send_error(writer, request_id, code, message)

    async def _serve(self, session: Session, delivery: Delivery) -> Outcome:
        if self.metrics is not None:
            self.metrics.in_flight.inc()
        try:
            outcome = await session.run()
        except EngineDead as dead:
            log.error(
                "engine dead while serving %s: %s",
                loggable(session.request.request_id),
                loggable(dead),
            )
            self.engine_dead.set()
            outcome = session.outcome
        finally:
            if self.metrics is not None:
                self.metrics.in_flight.dec()
        self.served += 1
        self._log_outcome(outcome, session.writer)
        failure = f"{outcome.error_code}: {outcome.error_message}" if outcome.error_code else None
        self._record(delivery, failure)
        if self.metrics is not None:
            self.metrics.finished(outcome.outcomes)
            if outcome.error_code is not None:
                self.metrics.error(outcome.error_code)
        return outcome

    def _record(self, delivery: Delivery, error: str | None) -> None:
        stats = self.stats.setdefault(delivery.subject, SubjectStats())
        stats.processing_time_ns += time.monotonic_ns() - delivery.arrived
        if error is not None:
            stats.num_errors += 1
            stats.last_error = error

    def _log_outcome(self, outcome: Outcome, writer: FrameWriter) -> None:
        if not (self.config.log_requests or outcome.error_code):
            return
        elapsed = time.monotonic() - outcome.started
        ttft = f"{outcome.first_token_s * 1000:.1f}ms" if outcome.first_token_s is not None else "-"
        log.info(
            "request %s %s tokens=%d frames=%d ttft=%s total=%.1fms%s",
            loggable(outcome.request_id),
            outcome.label,
            outcome.completion_tokens,
            writer.frames_sent,
            ttft,
            elapsed * 1000,
            f" error={loggable(outcome.error_message)}" if outcome.error_code else "",
        )

    async def watch_engine(self) -> None:
        """Background health check; a failed one marks the engine dead (the worker then exits)."""
        while not self.engine_dead.is_set():
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.engine.check_health()
            except EngineDead as error:
                log.error("engine health check failed: %s", error)
                self.engine_dead.set()

    def interrupt_all(self, code: ErrorCode, message: str) -> list[asyncio.Task[Outcome]]:
        entries = list(self._in_flight.values())
        for entry in entries:
            entry.session.interrupt(entry.task, code, message)
        return [entry.task for entry in entries]

    def stop_admitting(self) -> None:
        """From now on every request is refused with a retryable `worker_shutdown`."""
        self._draining = True

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting requests; let in-flight ones finish for up to `timeout_s`; end the rest
        with a retryable `worker_shutdown` error frame (their engine requests are aborted)."""
        self.stop_admitting()
        pending = set(self._in_flight)
        if pending and timeout_s > 0:
            log.info("draining %d in-flight requests (up to %.1fs)", len(pending), timeout_s)
            _, pending = await asyncio.wait(pending, timeout=timeout_s)
        if pending:
            log.warning("ending %d requests still running after the drain timeout", len(pending))
            tasks = self.interrupt_all(
                "worker_shutdown", "worker shut down before this request finished: retry"
            )
            await asyncio.gather(*tasks, return_exceptions=True)
