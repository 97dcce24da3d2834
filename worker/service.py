"""Composition root: the only module that knows both NATS and the engine.

message → codec by Content-Type → decode (errors become an error frame) → admission
(max_concurrency) → one task per request running a RequestSession → frames to the message's
reply subject, through worker/liveness.py (which holds frames through a broker outage and finds
clients that are gone). The generate subjects are NATS micro endpoints (see
worker/discovery.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.request import Request
from nats.micro.service import Service

from messages.codec import Codec, codec_for
from messages.errors import ErrorCode
from messages.subjects import SERVICE_NAME
from worker import discovery, transport
from worker.config import WorkerConfig
from worker.engine_api import Engine, EngineDead, InvalidRequest, describe
from worker.framing import FrameWriter
from worker.liveness import Listener, Liveness
from worker.metrics import WorkerMetrics
from worker.session import Outcome, RequestSession, send_error
from worker.validation import admit

log = logging.getLogger(__name__)


class _RequestId(msgspec.Struct):
    request_id: str = ""


_ID_DECODERS = {
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


def _decode(codec: Codec, data: bytes):  # -> GenerateRequest
    """Decodes a request; every way a payload can be unreadable is an InvalidRequest."""
    try:
        return codec.decode_request(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise InvalidRequest("invalid payload", str(error)) from error
    except RecursionError as error:
        # msgspec decodes nested containers recursively, skipped unknown fields included.
        raise InvalidRequest("invalid payload", "nested too deeply to decode") from error


@dataclass
class Delivery:
    """One request as the transport delivered it (core request or JetStream message)."""

    data: bytes
    headers: dict[str, str] | None
    reply: str
    subject: str
    arrived: int
    """time.monotonic_ns() when the message was taken from NATS."""
    attempt: int | None = None
    """JetStream delivery attempt (frames carry it); None for core NATS."""
    final_attempt: bool = True
    requeue_refusals: bool = False
    on_done: Callable[[Outcome], Awaitable[None]] | None = None


@dataclass
class InFlight:
    """A request being served: its session, task, and where its frames go."""

    session: RequestSession
    task: asyncio.Task[None]
    listener: Listener
    deadline: asyncio.TimerHandle | None = None


class Worker:
    def __init__(
        self,
        engine: Engine,
        nc: NATS,
        config: WorkerConfig,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.nc = nc
        self.config = config
        # The engine's limits plus the operator's caps: what every request is checked against.
        self.limits = dataclasses.replace(
            engine.limits, max_n=config.max_n, max_tokens_limit=config.max_tokens_limit
        )
        self.metrics = metrics
        self.service: Service | None = None
        self._stats: discovery.EndpointStatsRecorder | None = None
        self._in_flight: dict[asyncio.Task[None], InFlight] = {}
        self._cancel_subscription: Subscription | None = None
        self.liveness = Liveness(
            nc,
            interval_s=config.liveness_interval_s,
            probe_timeout_s=config.liveness_timeout_s,
            grace_s=config.client_gone_grace_s,
            outage_wait_s=config.outage_wait_s,
        )
        self._liveness: asyncio.Task[None] | None = None
        self._draining = False
        self.engine_dead = asyncio.Event()
        self.capacity_freed = asyncio.Event()
        self.served = 0
        self.peak_in_flight = 0

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def start(self, *, core_endpoints: bool = True) -> None:
        """Registers with NATS micro; `core_endpoints=False` when requests come from JetStream."""
        self.service = await discovery.register(
            self.nc,
            self.config,
            self.limits,
            self.handle,
            self._stats_data,
            endpoints=core_endpoints,
        )
        self._stats = discovery.EndpointStatsRecorder(self.service)
        subjects = self.config.subjects
        # Cancels go to every worker (no queue group): only the one serving the id acts.
        self._cancel_subscription = await self.nc.subscribe(subjects.cancel, cb=self._on_cancel)
        self._liveness = asyncio.create_task(self.liveness.run())
        # Once start returns, the server holds every subscription above: a request published
        # right after (by a test, a supervisor, a client that saw the worker in discovery)
        # reaches this worker.
        await transport.flush(self.nc)
        log.info(
            "serving %s (queue group %s) and %s as micro service %s id %s",
            subjects.generate,
            self.config.queue_group,
            subjects.instance(self.config.instance_id),
            SERVICE_NAME,
            self.service.id,
        )

    def _stats_data(self) -> dict[str, object]:
        return {
            "in_flight": self.in_flight,
            "served": self.served,
            "engine_unfinished_requests": self.engine.num_unfinished_requests(),
        }

    async def handle(self, request: Request) -> None:
        """The micro endpoint handler. nats-py runs one subscription's handlers one after another,
        so this only validates and hands off; the stream runs in its own task."""
        arrived = time.monotonic_ns()
        reply = discovery.reply_subject(request)
        if not reply:
            log.warning(
                "refused a request on %s without a reply subject (%d bytes)",
                request.subject,
                len(request.data),
            )
            self._record(request.subject, arrived, "no reply subject")
            return
        delivery = Delivery(request.data, request.headers, reply, request.subject, arrived)
        try:
            await self.accept(delivery)
        except Exception as error:
            # Never let an error reach micro: it would answer with an empty, header-only message
            # that frame readers cannot tell from a liveness probe. accept publishes at most one
            # frame, its last step, so an error here means none went out: this one is seq 0.
            log.exception("request on %s failed before it was admitted", request.subject)
            self._record(delivery.subject, delivery.arrived, f"internal_error: {error!r}")
            try:
                await self.answer_error(
                    reply, request.headers, None, "internal_error", describe(error)
                )
            except Exception:
                log.exception("could not answer the failed request on %s", request.subject)

    def _writer(
        self, reply: str, headers: dict[str, str] | None, attempt: int | None
    ) -> tuple[FrameWriter, Listener]:
        """The frame writer for one reply subject, publishing through the liveness gate."""
        listener = self.liveness.listener(reply)
        publish = functools.partial(self.liveness.publish, listener)
        codec = codec_for(headers)
        return FrameWriter(codec, self.nc.max_payload, publish, attempt), listener

    async def answer_error(
        self,
        reply: str,
        headers: dict[str, str] | None,
        attempt: int | None,
        code: ErrorCode,
        message: str,
    ) -> None:
        """Ends a request that failed before it ran with its one error frame (seq 0)."""
        writer, _ = self._writer(reply, headers, attempt)
        await self._answer(writer, "", code, message)

    async def accept(self, delivery: Delivery) -> ErrorCode | None:
        """Validates and admits one request, then serves it in its own task.

        Returns None once the request runs, or the code it was refused with. A refusal is
        answered with an error frame, except for a JetStream delivery refused for capacity or
        drain (`delivery.requeue_refusals`), which its caller NAKs for another worker instead.
        """
        writer, listener = self._writer(delivery.reply, delivery.headers, delivery.attempt)
        codec = writer.codec
        try:
            if len(delivery.data) > self.config.max_request_bytes:
                raise InvalidRequest(
                    "payload",
                    f"{len(delivery.data)} bytes exceeds max_request_bytes "
                    f"{self.config.max_request_bytes}",
                )
            decoded = _decode(codec, delivery.data)
            admit(decoded, self.limits)
        except InvalidRequest as error:
            request_id = _salvage_request_id(codec, delivery.data)
            await self._refuse(writer, delivery, request_id, "invalid_request", str(error))
            return "invalid_request"
        request_id = decoded.request_id
        limit = self.config.max_concurrency
        refusal: tuple[ErrorCode, str] | None = None
        if self._draining:
            refusal = ("worker_shutdown", "worker is shutting down: retry on another worker")
        elif limit is not None and self.in_flight >= limit:
            refusal = ("overloaded", f"worker at max_concurrency {limit}: retry on another worker")
        if refusal is not None:
            if not delivery.requeue_refusals:
                await self._refuse(writer, delivery, request_id, *refusal)
            return refusal[0]
        engine_request_id = f"{decoded.request_id}-{uuid.uuid4().hex[:12]}"
        session = RequestSession(
            decoded,
            self.engine,
            writer,
            engine_request_id,
            self.metrics,
            delivery.final_attempt,
            arrived=delivery.arrived / 1e9,
        )
        task = asyncio.create_task(self._serve(session, delivery))
        entry = InFlight(session, task, listener)
        self.liveness.track(listener, functools.partial(self._client_gone, entry))
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
        return None

    def _done(self, task: asyncio.Task[None]) -> None:
        entry = self._in_flight.pop(task)
        self.liveness.untrack(entry.listener)
        if entry.deadline is not None:
            entry.deadline.cancel()
        self.capacity_freed.set()

    def _client_gone(self, entry: InFlight) -> None:
        if not entry.task.done():
            log.info("request %s: client gone, aborting", entry.session.request.request_id)
            entry.session.cancel(entry.task, "client_gone", "nobody listens on the reply subject")

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = codec_for(msg.headers).decode_cancel(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as error:
            log.warning("ignored an invalid cancel on %s: %s", msg.subject, error)
            return
        # Bound to the reply subject: an equal request_id of another publisher is not touched.
        for entry in list(self._in_flight.values()):
            if (
                entry.session.request.request_id == cancel.request_id
                and entry.listener.reply == cancel.reply_subject
            ):
                log.info("request %s cancelled by its client", cancel.request_id)
                entry.session.cancel(entry.task)

    async def _refuse(
        self,
        writer: FrameWriter,
        delivery: Delivery,
        request_id: str,
        code: ErrorCode,
        message: str,
    ) -> None:
        await self._answer(writer, request_id, code, message)
        self._record(delivery.subject, delivery.arrived, f"{code}: {message}")

    async def _answer(
        self, writer: FrameWriter, request_id: str, code: ErrorCode, message: str
    ) -> None:
        log.info("request %s %s error=%r", request_id or "-", code, message)
        await send_error(writer, request_id, code, message)
        if self.metrics is not None:
            self.metrics.error(code)
            self.metrics.finished(code)

    async def _serve(self, session: RequestSession, delivery: Delivery) -> None:
        if self.metrics is not None:
            self.metrics.in_flight.inc()
        try:
            outcome = await session.run()
        except EngineDead as error:
            log.error("engine dead while serving %s: %s", session.request.request_id, error)
            self.engine_dead.set()
            outcome = session.outcome
        finally:
            if self.metrics is not None:
                self.metrics.in_flight.dec()
        self.served += 1
        self._log_outcome(outcome, session.writer)
        error = f"{outcome.error_code}: {outcome.error_message}" if outcome.error_code else None
        self._record(delivery.subject, delivery.arrived, error)
        if delivery.on_done is not None:
            try:
                await delivery.on_done(outcome)
            except Exception:
                log.exception("settling request %s failed", outcome.request_id)
        if self.metrics is not None:
            self.metrics.finished(outcome.label)
            if outcome.error_code is not None:
                self.metrics.error(outcome.error_code)

    def _record(self, subject: str, arrived: int, error: str | None) -> None:
        if self._stats is not None:
            self._stats.record(subject, time.monotonic_ns() - arrived, error)

    def _log_outcome(self, outcome: Outcome, writer: FrameWriter) -> None:
        elapsed = time.monotonic() - outcome.started
        ttft = f"{outcome.first_token_s * 1000:.1f}ms" if outcome.first_token_s is not None else "-"
        log.info(
            "request %s %s tokens=%d frames=%d ttft=%s total=%.1fms%s",
            outcome.request_id,
            outcome.label,
            outcome.completion_tokens,
            writer.frames_sent,
            ttft,
            elapsed * 1000,
            f" error={outcome.error_message!r}" if outcome.error_code else "",
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

    def interrupt_all(self, code, message: str) -> list[asyncio.Task[None]]:
        entries = list(self._in_flight.values())
        for entry in entries:
            entry.session.interrupt(entry.task, code, message)
        return [entry.task for entry in entries]

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests; let in-flight ones finish for up to `timeout_s`; end the rest
        with a retryable `worker_shutdown` error frame (their engine requests are aborted)."""
        self._draining = True
        if self.service is not None:
            await self.service.stop()
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

    async def stop(self) -> None:
        await self.drain(0.0)
        if self._liveness is not None:
            self._liveness.cancel()
        if self._cancel_subscription is not None:
            try:
                await self._cancel_subscription.unsubscribe()
            except Exception:  # connection already closed
                pass
