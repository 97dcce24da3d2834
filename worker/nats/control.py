"""A worker's control plane (messages/control.py): its admin commands on
`Subjects.control(instance_id)`, run by the engine's admin (worker/engine/admin.py), each
answered with one `ControlReply`. What a command changes that others route by is published at
once: discovery's metadata lists the adapters, and a sleeping worker refuses new requests
(retryable `overloaded`: a client retries elsewhere) and pulls nothing from a work queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from messages.codec import codec_for
from messages.control import ControlReply, ControlRequest
from messages.frames import ErrorInfo
from worker.engine.contract import AdminError, EngineAdmin
from worker.service import RequestService
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)


class Control:
    """Answers one worker's admin commands."""

    def __init__(
        self,
        nc: NATS,
        subject: str,
        instance_id: str,
        service: RequestService,
        on_adapters: Callable[[dict[str, str]], None],
    ) -> None:
        self.nc = nc
        self.subject = subject
        self.instance_id = instance_id
        self.service = service
        self.admin: EngineAdmin | None = service.engine.admin
        self._on_adapters = on_adapters
        self._subscription: Subscription | None = None

    async def start(self) -> None:
        self._subscription = await self.nc.subscribe(self.subject, cb=self._on_message)

    async def stop(self) -> None:
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            try:
                await subscription.unsubscribe()
            except Exception as error:  # the connection is already closed
                log.debug("control unsubscribe failed: %r", error)

    async def _on_message(self, msg: Msg) -> None:
        codec = codec_for(msg.headers, msg.data)
        try:
            request = codec.decode_as(msg.data, ControlRequest)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as error:
            reply = ControlReply(
                instance_id=self.instance_id,
                command="",
                error=ErrorInfo("invalid_request", f"invalid payload: {error}"),
            )
        else:
            reply = await self.run(request)
        if msg.reply:
            await self.nc.publish(msg.reply, codec.encode(reply))

    async def run(self, request: ControlRequest) -> ControlReply:
        """Runs one command; a refusal or failure is the reply's `error`."""
        reply = ControlReply(instance_id=self.instance_id, command=request.command)
        admin = self.admin
        if admin is None:
            reply.error = ErrorInfo("invalid_request", "this worker's engine takes no commands")
            return reply
        try:
            await self._run(admin, request, reply)
        except AdminError as error:
            reply.error = ErrorInfo(error.error_code, str(error))
        except Exception as error:  # the engine failed: the caller sees it, the worker goes on
            log.exception("control command %s failed", request.command)
            reply.error = ErrorInfo("engine_error", f"{type(error).__name__}: {error}")
        reply.adapters = admin.adapters()
        log.info(
            "control %s %s: %s",
            request.command,
            loggable(request.lora_name or ""),
            "ok" if reply.error is None else loggable(reply.error.message),
        )
        return reply

    async def _run(self, admin: EngineAdmin, request: ControlRequest, reply: ControlReply) -> None:
        command = request.command
        if command in ("load_lora_adapter", "unload_lora_adapter"):
            if request.lora_name is None:
                raise AdminError("invalid_request", "lora_name: required")
            if command == "load_lora_adapter":
                if request.lora_path is None:
                    raise AdminError("invalid_request", "lora_path: required")
                await admin.load_adapter(
                    request.lora_name, request.lora_path, load_inplace=request.load_inplace
                )
            else:
                await admin.unload_adapter(request.lora_name)
            self._on_adapters(admin.adapters())
        elif command == "reset_prefix_cache":
            reply.reset = await admin.reset_prefix_cache()
        elif command == "sleep":
            # Refuse new requests first: none may reach an engine that is going to sleep.
            self.service.set_asleep(True)
            try:
                await admin.sleep(request.level)
            except BaseException:
                self.service.set_asleep(await admin.is_sleeping())
                raise
            reply.is_sleeping = True
        elif command == "wake_up":
            await admin.wake_up(request.tags)
            reply.is_sleeping = await admin.is_sleeping()
            self.service.set_asleep(reply.is_sleeping)
        elif command == "is_sleeping":
            reply.is_sleeping = await admin.is_sleeping()
