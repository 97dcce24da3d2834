"""The worker on NATS: the service core (worker/service.py) wired to a NATS connection.

What it adds to the core: the liveness prober and the frames' `Reply` (liveness.py), the
cancel subscription, discovery (the micro protocol, discovery.py) and, in core mode, the queue
subscriptions (intake/core.py). JetStream mode adds `intake.jetstream.JetStreamIntake` on top.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from messages.codec import codec_for
from messages.subjects import SERVICE_NAME
from worker.config import JetStreamSettings, WorkerConfig
from worker.engine.contract import Engine
from worker.metrics import WorkerMetrics
from worker.nats.discovery import Discovery, Endpoint
from worker.nats.intake.core import CoreIntake
from worker.nats.intake.jetstream import stream_name
from worker.nats.kv_publisher import KvPublisher
from worker.nats.liveness import Liveness, NatsReply
from worker.service import RequestService, SubjectStats
from worker.shared.nats_compat import flush_ordered

log = logging.getLogger(__name__)

CONTENT_TYPES = {"content_types": "application/msgpack,application/json"}


class NatsWorker(RequestService):
    def __init__(
        self,
        engine: Engine,
        nc: NATS,
        config: WorkerConfig,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        super().__init__(engine, config, metrics, max_payload=nc.max_payload)
        self.nc = nc
        self.liveness = Liveness(
            nc,
            interval_s=config.liveness_interval_s,
            probe_timeout_s=config.liveness_timeout_s,
            grace_s=config.client_gone_grace_s,
            outage_wait_s=config.outage_wait_s,
        )
        self.service: Discovery | None = None
        self.intake: CoreIntake | None = None
        self.kv: KvPublisher | None = None
        self._cancel_subscription: Subscription | None = None
        self._prober: asyncio.Task[None] | None = None

    def reply(self, subject: str) -> NatsReply:
        return NatsReply(self.liveness, subject)

    async def start(self, *, jetstream: JetStreamSettings | None = None) -> None:
        """Subscribes and registers for discovery. With `jetstream` requests come from that
        work queue (a JetStreamIntake the caller starts) instead of the core subjects, and
        discovery says so (metadata `mode`, `stream`, `consumer`, `queue_subject`). Once it
        returns, the server holds every subscription: a request published right after (by a
        test, a supervisor, a client that saw the worker in discovery) reaches this worker."""
        subjects = self.config.subjects
        config = self.config
        endpoints = []
        if jetstream is None:
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
                # Every process of one engine core: what a KV router sends to that engine.
                endpoints.append(
                    Endpoint(
                        "generate-engine",
                        subjects.instance(config.engine_id),
                        f"{config.queue_group}-{config.engine_id}",
                        CONTENT_TYPES,
                    )
                )
            self.intake = CoreIntake(
                self, self.nc, self.liveness, [(e.subject, e.queue_group) for e in endpoints]
            )
            await self.intake.start()
            if config.kv_events:
                self.kv = KvPublisher(
                    self.nc,
                    subjects,
                    config.instance_id,
                    self.engine,
                    self.engine.kv_events() if config.kv_event_source else None,
                    lambda: (self.in_flight, config.max_concurrency, self.draining),
                    interval_s=config.load_interval_s,
                    engine_id=config.engine_id,
                )
                await self.kv.start()
        # Cancels go to every worker (no queue group): only the one serving the request acts.
        self._cancel_subscription = await self.nc.subscribe(subjects.cancel, cb=self._on_cancel)
        self._prober = asyncio.create_task(self.liveness.run())
        metadata = self._metadata()
        if jetstream is None:
            metadata["mode"] = "core"
            serving = ", ".join(f"{e.subject} (queue {e.queue_group})" for e in endpoints)
        else:
            stream = stream_name(subjects, jetstream)
            metadata.update(
                mode="jetstream",
                stream=stream,
                consumer=jetstream.durable,
                queue_subject=subjects.queue,
            )
            serving = f"JetStream stream {stream} (consumer {jetstream.durable}, {subjects.queue})"
        self.service = Discovery(self.nc, metadata, endpoints, self._subject_stats, self.stats_data)
        await self.service.start()
        await flush_ordered(self.nc)
        log.info("serving %s as %s id %s", serving, SERVICE_NAME, self.service.id)

    def _subject_stats(self, subject: str) -> SubjectStats:
        return self.stats.get(subject) or SubjectStats()

    def _metadata(self) -> dict[str, str]:
        limits = self.limits
        limit = self.config.max_concurrency
        optional: dict[str, str] = {}
        if self.config.engine_id:
            optional["engine_id"] = self.config.engine_id
        if self.kv is not None:
            # Which process answers KV snapshots: a router asks no other (kv_publisher.py).
            optional["kv_events"] = "published" if self.kv.source is not None else "load-only"
        return {
            **optional,
            "instance_id": self.config.instance_id,
            "model": limits.model,
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
            log.warning("ignored an invalid cancel on %s: %s", msg.subject, error)
            return
        self.cancel(cancel.request_id, cancel.reply_subject)

    async def drain(self, timeout_s: float) -> None:
        """Stops taking requests and answering discovery, then drains the core. Routers hear
        that it drains before it stops taking requests."""
        self._draining = True
        if self.kv is not None:
            await self.kv.publish_load()
        if self.intake is not None:
            await self.intake.stop()
        if self.service is not None:
            await self.service.stop()
        await super().drain(timeout_s)

    async def stop(self) -> None:
        await self.drain(0.0)
        if self.kv is not None:
            await self.kv.stop()
        if self._prober is not None:
            self._prober.cancel()
        if self._cancel_subscription is not None:
            try:
                await self._cancel_subscription.unsubscribe()
            except Exception as error:  # the connection is already closed
                log.debug("cancel unsubscribe failed: %r", error)
