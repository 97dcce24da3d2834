"""Composition root: the only module that knows both NATS and the engine.

message → codec by Content-Type → decode (errors become an error frame) → one task per request
running a RequestSession → frames to the message's reply subject.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from messages.codec import Codec, codec_for
from messages.request import GenerateRequest
from worker.config import WorkerConfig
from worker.engine_api import Engine, EngineDead
from worker.framing import FrameWriter
from worker.session import Outcome, RequestSession, send_error
from worker.transport import reply_publisher

log = logging.getLogger(__name__)


def _salvage_request_id(codec: Codec, data: bytes) -> str:
    """The request_id of a payload that failed validation, if it has a readable one."""
    try:
        decoded = (
            msgspec.json.decode if codec.content_type.endswith("json") else msgspec.msgpack.decode
        )(data)
    except Exception:
        return ""
    if isinstance(decoded, dict) and isinstance(decoded.get("request_id"), str):
        return decoded["request_id"][:256]
    return ""


class Worker:
    def __init__(self, engine: Engine, nc: NATS, config: WorkerConfig) -> None:
        self.engine = engine
        self.nc = nc
        self.config = config
        self._subscriptions: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.engine_dead = asyncio.Event()
        self.served = 0

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def start(self) -> None:
        subjects = self.config.subjects
        self._subscriptions.append(
            await self.nc.subscribe(
                subjects.generate, queue=self.config.queue_group, cb=self._on_message
            )
        )
        self._subscriptions.append(
            await self.nc.subscribe(subjects.instance(self.config.instance_id), cb=self._on_message)
        )
        await self.nc.flush()
        log.info(
            "serving %s (queue group %s) and %s",
            subjects.generate,
            self.config.queue_group,
            subjects.instance(self.config.instance_id),
        )

    async def _on_message(self, msg: Msg) -> None:
        # nats-py runs a subscription's callbacks one after another: decode and hand off quickly.
        if not msg.reply:
            log.warning(
                "refused a request on %s without a reply subject (%d bytes)",
                msg.subject,
                len(msg.data),
            )
            return
        codec = codec_for(msg.headers)
        writer = FrameWriter(codec, self.nc.max_payload, reply_publisher(self.nc, msg.reply))
        try:
            request = codec.decode_request(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            request_id = _salvage_request_id(codec, msg.data)
            log.info("request %r invalid: %s", request_id, error)
            await send_error(writer, request_id, "invalid_request", f"invalid payload: {error}")
            return
        task = asyncio.create_task(self._serve(request, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, request: GenerateRequest, writer: FrameWriter) -> None:
        engine_request_id = f"{request.request_id}-{uuid.uuid4().hex[:12]}"
        session = RequestSession(request, self.engine, writer, engine_request_id)
        try:
            outcome = await session.run()
        except EngineDead as error:
            log.error("engine dead while serving %s: %s", request.request_id, error)
            self.engine_dead.set()
            return
        self.served += 1
        self._log_outcome(outcome, writer)

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

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            try:
                await subscription.unsubscribe()
            except Exception:  # connection already closed
                pass
        self._subscriptions.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
