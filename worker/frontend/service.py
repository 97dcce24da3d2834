"""FrontendService: what the routes share, on `app.state.service`: the settings, the tokenizer,
the metrics, the NATS connection and the router that picks each request's worker. It sends a
request's GenerateRequests through `worker.client` and reads their frames into an answer.

Invariants:
- the first frame of every prompt is awaited before any HTTP status is chosen, so a request the
  worker refuses (invalid, overloaded everywhere) is an OpenAI error body with a 4xx/5xx status,
  streaming or not; one prompt's error is the whole response's (the others are cancelled);
- an HTTP client that goes away (or a request that stops for any reason) closes the frame
  streams, which publish their cancels: the engine is freed within a round trip. If this
  process dies instead, its NATS inbox disappears and the worker's liveness probe aborts them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from nats.aio.client import Client as NATS

from messages.control import ControlReply, ControlRequest
from messages.frames import ResponseFrame
from messages.request import GenerateRequest, GuidedDecoding
from worker.client import KvRouter, find_worker, fleet, generate, jetstream_stream, subjects_of
from worker.frontend import sse
from worker.frontend.answers import Answer
from worker.frontend.errors import (
    OpenAIError,
    client_gone,
    not_connected,
    transport_error,
    unknown_model,
)
from worker.frontend.metrics import FrontendMetrics
from worker.frontend.schemas import ChatCompletionRequest, CompletionRequest
from worker.frontend.settings import FrontendSettings
from worker.frontend.streams import Batch, FrameSource, until_disconnected, watch_disconnect
from worker.frontend.tokenizer import ModelTokenizer
from worker.frontend.vllm_parsers import (
    ChatPlan,
    ParserNames,
    chat_plan,
    check_parsers,
    completion_guided_decoding,
)
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)

IsDisconnected = Callable[[], Awaitable[bool]]
"""The HTTP request's `is_disconnected`."""

Frames = AsyncGenerator[ResponseFrame, None]


class FrontendService:
    """`nc`: an open connection (tests); else `connect()` is awaited by `start()` and the
    connection it gives is closed by `stop()`. `router`: set by `start()` unless requests go to
    the queue group or JetStream."""

    def __init__(
        self,
        settings: FrontendSettings,
        tokenizer: ModelTokenizer,
        metrics: FrontendMetrics | None = None,
        nc: NATS | None = None,
        connect: Callable[[], Awaitable[NATS]] | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = metrics or FrontendMetrics()
        self.router: KvRouter | None = None
        self._nc = nc
        self._connect = connect
        self._owned: NATS | None = None
        self.parsers = ParserNames(
            settings.tool_call_parser, settings.enable_auto_tool_choice, settings.reasoning_parser
        )
        if self.parsers.any:  # as vllm serve: a parser that does not exist fails the start
            check_parsers(self.parsers, tokenizer.tokenizer)

    def chat_plan(self, body: ChatCompletionRequest) -> ChatPlan | None:
        """vLLM's handling of the request's structured outputs, tools and parsers (vllm is
        imported for it); None for a plain request when no parser runs."""
        if not (body.structured or body.uses_tools or self.parsers.any):
            return None
        return chat_plan(body, self.parsers, self.tokenizer.tokenizer)

    def completion_guided(self, body: CompletionRequest) -> GuidedDecoding | None:
        """A completions request's structured outputs as the wire's guided_decoding."""
        return completion_guided_decoding(body) if body.structured else None

    async def start(self) -> None:
        if self._nc is None and self._connect is not None:
            self._nc = self._owned = await self._connect()
        settings = self.settings
        if self._nc is not None and not settings.jetstream and settings.router != "queue":
            router = KvRouter(
                self._nc,
                subjects_of(settings.subject),
                mode=settings.router,
                load_weight=settings.load_weight,
            )
            await router.start()
            self.router = router

    async def stop(self) -> None:
        try:
            if self.router is not None:
                await self.router.stop()
        finally:
            if self._owned is not None:
                await self._owned.close()

    def connected(self) -> NATS | None:
        nc = self._nc
        return nc if nc is not None and nc.is_connected else None

    def connection(self) -> NATS:
        if (nc := self.connected()) is None:
            raise not_connected()
        return nc

    async def worker_metadata(self, window: float) -> dict[str, str] | None:
        """The discovery metadata of a worker of the subject that answers within `window`."""
        if (nc := self.connected()) is None:
            return None
        settings = self.settings
        return await find_worker(nc, settings.subject, window=window, jetstream=settings.jetstream)

    async def max_model_len(self) -> int | None:
        """The context length a worker of the subject reports in discovery; None if none
        answers in time (nothing here knows it otherwise: the engine is the workers')."""
        found = await self.worker_metadata(self.settings.discovery_window_s)
        try:
            return int(found["max_model_len"]) if found else None
        except (KeyError, ValueError):
            return None

    async def unhealthy(self) -> str | None:
        """Why the frontend cannot serve now; None when a worker of the subject answers
        discovery in time."""
        if self.connected() is None:
            return "not connected to NATS"
        timeout = self.settings.health_timeout_s
        if await self.worker_metadata(timeout) is None:
            return f"no worker of {self.settings.subject} answered within {timeout} s"
        return None

    async def members(self) -> list[fleet.Member]:
        """The workers of the subject that answer discovery (each with its adapters)."""
        nc = self.connection()
        return await fleet.members(
            nc, self.settings.subject, window=self.settings.discovery_window_s
        )

    async def adapters(self) -> dict[str, str]:
        """The LoRA adapters some worker of the subject holds: name → path."""
        if self.connected() is None:
            return {}
        return {name: path for m in await self.members() for name, path in m.adapters.items()}

    async def served_model(self, name: str | None) -> tuple[str, str | None]:
        """The name a response carries and the adapter the wire's `model` names (None: the base
        model). An adapter is one that a worker of the subject holds now (discovery); any other
        name is a 404, never answered by the base model."""
        if name is None or name in self.settings.model_names:
            return self.served_name(name), None
        if name in await self.adapters():
            return name, name
        raise unknown_model(name)

    async def command_all(self, request: ControlRequest) -> list[ControlReply]:
        """An admin command to every worker of the subject; each one's answer."""
        nc = self.connection()
        return await fleet.command_all(
            nc,
            self.settings.subject,
            request,
            window=self.settings.discovery_window_s,
            timeout=self.settings.timeout_s,
        )

    def served_name(self, name: str | None) -> str:
        """The name a response carries: the one asked for, or the first served one (vLLM's
        rule when `model` is left out); a name not served is a 404."""
        if name is None:
            return self.settings.model_names[0]
        if name not in self.settings.model_names:
            raise unknown_model(name)
        return name

    def log_accepted(self, request_id: str, model: str, user: str | None, prompts: int) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s: model %s, user %s, %d prompt(s)",
                loggable(request_id),
                loggable(model),
                "-" if user is None else loggable(user),
                prompts,
            )

    def publish(self, request: GenerateRequest) -> tuple[Frames, Callable[[], None] | None]:
        """The request sent (to the JetStream work queue, the worker the router picks, or the
        queue group): its frames, and what to call once they end (the router's count)."""
        nc, settings = self.connection(), self.settings
        if settings.jetstream:
            subjects = subjects_of(settings.subject)
            frames = jetstream_stream(
                nc,
                request,
                subjects=subjects,
                timeout=settings.timeout_s,
                migration_limit=settings.migration_limit,
                silence_timeout=settings.silence_timeout_s,
            )
            return frames, None
        subject, release = settings.subject, None
        if self.router is not None:
            route = self.router.route(request.token_ids, request.model)
            release = functools.partial(self.router.release, route)
            subject = route.subject or subject
            self.metrics.count_route(route)
        frames = generate(
            nc,
            request,
            subject=subject,
            timeout=settings.timeout_s,
            retries=settings.retries,
            migration_limit=settings.migration_limit,
            silence_timeout=settings.silence_timeout_s,
        )
        return frames, release

    async def start_request(
        self, watcher: asyncio.Task[None], request: GenerateRequest
    ) -> FrameSource:
        """The request sent and its first frame read; a refusal or failure is raised."""
        source, release = self.publish(request)
        frames = until_disconnected(watcher, source, request.request_id, release)
        try:
            first = await anext(frames)
        except StopAsyncIteration:
            raise client_gone() from None
        except BaseException as error:
            await frames.aclose()
            raise transport_error(error) from error
        if first.error:
            await frames.aclose()
            raise OpenAIError.from_worker(first.error.code, first.error.message)
        return FrameSource(frames, first)

    async def start_batch(
        self, is_disconnected: IsDisconnected, requests: Sequence[GenerateRequest]
    ) -> Batch:
        """Every prompt's request sent at once and its first frame read; any failure is the
        whole response's (the first, in prompt order), and the others are cancelled."""
        watcher = asyncio.create_task(watch_disconnect(is_disconnected))
        try:
            started = await asyncio.gather(
                *(self.start_request(watcher, r) for r in requests), return_exceptions=True
            )
        except BaseException:
            watcher.cancel()
            raise
        batch = Batch([s for s in started if isinstance(s, FrameSource)], watcher)
        if failures := [s for s in started if isinstance(s, BaseException)]:
            await batch.aclose()
            raise transport_error(failures[0])
        return batch

    async def complete(
        self,
        is_disconnected: IsDisconnected,
        answer: Answer[Any],
        requests: Sequence[GenerateRequest],
    ) -> dict[str, Any]:
        """The whole answer's body, once every frame arrived."""
        batch = await self.start_batch(is_disconnected, requests)
        await batch.fold(answer.feed)
        self.metrics.count_usage(answer.usage())
        return answer.body()

    async def stream(
        self,
        is_disconnected: IsDisconnected,
        answer: Answer[Any],
        requests: Sequence[GenerateRequest],
        *,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The answer's SSE events, once every prompt's first frame arrived."""
        batch = await self.start_batch(is_disconnected, requests)
        return sse.events(
            batch, answer, include_usage=include_usage, on_answered=self.metrics.count_usage
        )
