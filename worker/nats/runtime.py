"""The worker on NATS, start to exit: the request service (worker/service.py) held beside its
intake (core or JetStream, picked by `make_intake`), the liveness prober and the frames'
`Reply` (liveness.py), the cancel subscription, discovery (the micro protocol, discovery.py),
the control plane (admin commands, control.py) and, in core mode, the KV publisher.

`WorkerRuntime.run` is the one lifecycle both modes share: wait for a stop, a dead engine or a
failed intake; then drain; then stop. The command (worker/process.py), the tests and the
benchmarks build workers the same way: `open_worker`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from messages.codec import codec_for
from messages.subjects import SERVICE_NAME
from worker.config import WorkerConfig
from worker.engine.contract import Engine
from worker.metrics import WorkerMetrics
from worker.nats.control import Control
from worker.nats.discovery import Discovery
from worker.nats.intake import Intake, make_intake
from worker.nats.kv_publisher import KvPublisher
from worker.nats.liveness import Liveness
from worker.service import RequestService, SubjectStats
from worker.shared.log_text import loggable
from worker.shared.nats_compat import flush_ordered
from worker.shared.nats_connection import connect

log = logging.getLogger(__name__)


class WorkerRuntime:
    """One worker process's serving side on one NATS connection."""

    def __init__(
        self,
        engine: Engine,
        nc: NATS,
        config: WorkerConfig,
        metrics: WorkerMetrics | None = None,
        *,
        owns_connection: bool = False,
    ) -> None:
        self.nc = nc
        self.config = config
        self.service = RequestService(engine, config, metrics, max_payload=nc.max_payload)
        self.liveness = Liveness(
            nc,
            interval_s=config.liveness_interval_s,
            probe_timeout_s=config.liveness_timeout_s,
            grace_s=config.client_gone_grace_s,
            outage_wait_s=config.outage_wait_s,
            heartbeat_s=config.heartbeat_interval_s,
        )
        self.intake: Intake = make_intake(config, self.service, nc, self.liveness)
        self.discovery: Discovery | None = None
        self.control: Control | None = None
        self.kv: KvPublisher | None = None
        self._owns_connection = owns_connection
        self._cancel_subscription: Subscription | None = None
        self._prober: asyncio.Task[None] | None = None
        self._heart: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def instance_id(self) -> str:
        return self.config.instance_id

    async def start(self) -> None:
        """Subscribes and registers for discovery. Once it returns, the server holds every
        subscription: a request published right after (by a test, a supervisor, a client that
        saw the worker in discovery) reaches this worker. Raises `JetStreamConfigError` for a
        work queue set up otherwise (nothing is left subscribed then)."""
        config = self.config
        service = self.service
        try:
            await self.intake.start()
        except BaseException:
            await self.intake.stop()
            raise
        if config.kv_events and config.jetstream is None:
            # A JetStream work queue is not routed to an instance: no KV picture to publish.
            self.kv = KvPublisher(
                self.nc,
                config.subjects,
                config.instance_id,
                service.engine,
                service.engine.kv_events() if config.kv_event_source else None,
                lambda: (service.in_flight, config.max_concurrency, service.draining),
                interval_s=config.load_interval_s,
                engine_id=config.engine_id,
            )
            await self.kv.start()
        # Cancels go to every worker (no queue group): only the one serving the request acts.
        self._cancel_subscription = await self.nc.subscribe(
            config.subjects.cancel, cb=self._on_cancel
        )
        self._prober = asyncio.create_task(self.liveness.run())
        self._heart = asyncio.create_task(self.liveness.beat())
        mode, serving = self.intake.describe()
        metadata = {**self._metadata(), **mode}
        self.discovery = Discovery(
            self.nc, metadata, self.intake.endpoints, self._subject_stats, service.stats_data
        )
        await self.discovery.start()
        self.control = Control(
            self.nc,
            config.subjects.control(config.instance_id),
            config.instance_id,
            service,
            self._adapters_changed,
        )
        await self.control.start()
        await flush_ordered(self.nc)
        log.info("serving %s as %s id %s", serving, SERVICE_NAME, self.discovery.id)

    async def run(self, stop: asyncio.Event, on_stopping: Callable[[], None] | None = None) -> int:
        """The lifecycle after `start`: serves until `stop` is set (drain, exit status 0), the
        engine dies (in-flight requests end with `engine_error`, 1) or the intake fails (drain,
        1); the engine's health is checked meanwhile. `on_stopping` is called once, as soon as
        one of those happened (before the drain). Stops the runtime before it returns."""
        service = self.service
        watch = asyncio.create_task(service.watch_engine())
        waits = [
            asyncio.create_task(stop.wait()),
            asyncio.create_task(service.engine_dead.wait()),
            asyncio.create_task(self.intake.failed.wait()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if on_stopping is not None:
                on_stopping()
            if self.intake.failed.is_set():
                log.error("the intake failed: draining and exiting non-zero")
                await self.drain(self.config.drain_timeout_s)
                return 1
            if service.engine_dead.is_set():
                log.error("engine is dead: answering in-flight requests and exiting")
                tasks = service.interrupt_all(
                    "engine_error", "the engine died: retry on another worker"
                )
                await asyncio.gather(*tasks, return_exceptions=True)
                return 1
            log.info("stopping: draining (timeout %.1fs)", self.config.drain_timeout_s)
            await self.drain(self.config.drain_timeout_s)
            return 0
        finally:
            for task in (watch, *waits):
                task.cancel()
            await self.stop()

    def _adapters_changed(self, adapters: dict[str, str]) -> None:
        if self.discovery is not None:
            self.discovery.metadata["adapters"] = _adapters_metadata(adapters)

    def _subject_stats(self, subject: str) -> SubjectStats:
        return self.service.stats.get(subject) or SubjectStats()

    def _metadata(self) -> dict[str, str]:
        limits = self.service.limits
        limit = self.config.max_concurrency
        optional: dict[str, str] = {}
        if self.config.engine_id:
            optional["engine_id"] = self.config.engine_id
        admin = self.service.engine.admin
        if admin is not None:
            # The LoRA adapters it holds, name → path, as JSON (kept current by `control`).
            optional["adapters"] = _adapters_metadata(admin.adapters())
        if self.kv is not None:
            # Which process answers KV snapshots: a router asks no other (kv_publisher.py).
            optional["kv_events"] = "published" if self.kv.source is not None else "load-only"
        return {
            **optional,
            "instance_id": self.config.instance_id,
            "model": limits.model,
            "subject": self.config.subjects.generate,
            "kind": limits.kind,
            "tokenizer": limits.tokenizer,
            "engine": limits.engine,
            "max_logprobs": str(limits.max_logprobs),
            "max_model_len": str(limits.max_model_len),
            "vocab_size": str(limits.vocab_size),
            "max_concurrency": "unlimited" if limit is None else str(limit),
        }

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = codec_for(msg.headers, msg.data).decode_cancel(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as error:
            log.warning("ignored an invalid cancel on %s: %s", msg.subject, loggable(error))
            return
        self.service.cancel(cancel.request_id, cancel.reply_subject)

    async def drain(self, timeout_s: float) -> None:
        """Stops taking requests and answering discovery, then drains the request service.
        Routers hear that it drains before it stops taking requests."""
        self.service.stop_admitting()
        if self.kv is not None:
            await self.kv.publish_load()
        await self.intake.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.service.drain(timeout_s)

    async def stop(self) -> None:
        """Drains at once (what still runs ends with `worker_shutdown`), unsubscribes, and
        closes the connection if the runtime opened it. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.drain(0.0)
        if self.control is not None:
            await self.control.stop()
        if self.kv is not None:
            await self.kv.stop()
        for task in (self._prober, self._heart):
            if task is not None:
                task.cancel()
        if self._cancel_subscription is not None:
            try:
                await self._cancel_subscription.unsubscribe()
            except Exception as error:  # the connection is already closed
                log.debug("cancel unsubscribe failed: %r", error)
        if self._owns_connection and not self.nc.is_closed:
            await self.nc.drain()


def _adapters_metadata(adapters: dict[str, str]) -> str:
    """Discovery's `adapters`: name → path as JSON (micro metadata values are strings)."""
    return json.dumps(adapters, sort_keys=True)


async def open_worker(
    engine: Engine,
    config: WorkerConfig,
    metrics: WorkerMetrics | None = None,
    *,
    nc: NATS | None = None,
) -> WorkerRuntime:
    """A started worker: connects by `config.nats` unless given a connection (then the caller
    closes it), builds the runtime and its intake for the configured mode, and starts it."""
    own = nc is None
    connection = await connect(config.nats) if nc is None else nc
    runtime = WorkerRuntime(engine, connection, config, metrics, owns_connection=own)
    try:
        await runtime.start()
    except BaseException:
        await runtime.stop()
        raise
    return runtime
