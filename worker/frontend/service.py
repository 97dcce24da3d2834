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
from contextlib import aclosing
from typing import Any, TypeVar

from nats.aio.client import Client as NATS

from messages.control import ControlReply, ControlRequest
from messages.embeddings import EmbedRequest
from messages.frames import ResponseFrame
from messages.request import GenerateRequest, GuidedDecoding
from messages.subjects import SERVICE_NAME
from worker.client import (
    Embeddings,
    KvRouter,
    RequestError,
    embed,
    find_worker,
    fleet,
    generate,
    jetstream_embed,
    jetstream_stream,
    subjects_of,
)
from worker.client.library import discovery_answers
from worker.frontend import sse
from worker.frontend.answers import Answer
from worker.frontend.catalog import ModelCatalog, ServedModel, Target
from worker.frontend.errors import (
    OpenAIError,
    client_gone,
    not_connected,
    transport_error,
)
from worker.frontend.metrics import FrontendMetrics
from worker.frontend.schemas import ChatCompletionRequest, CompletionRequest
from worker.frontend.settings import FrontendSettings
from worker.frontend.streams import Batch, ClientGone, FrameSource, until_disconnected
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
T = TypeVar("T")

Frames = AsyncGenerator[ResponseFrame, None]


async def _settled(step: Awaitable[T]) -> T | Exception:
    """What `asyncio.gather(..., return_exceptions=True)` gives for one awaitable, without a
    task; a cancellation still propagates."""
    try:
        return await step
    except Exception as error:
        return error


class FrontendService:
    """`nc`: an open connection (tests); else `connect()` is awaited by `start()` and the
    connection it gives is closed by `stop()`. `tokenizer`: the configured model's (`--model`);
    None when the frontend serves only the models it discovers (worker/frontend/catalog.py)."""

    def __init__(
        self,
        settings: FrontendSettings,
        tokenizer: ModelTokenizer | None,
        metrics: FrontendMetrics | None = None,
        nc: NATS | None = None,
        connect: Callable[[], Awaitable[NATS]] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or FrontendMetrics()
        self._nc = nc
        self._connect = connect
        self._owned: NATS | None = None
        configured = None
        if settings.model_names and tokenizer is not None:
            configured = ServedModel(
                settings.model_names,
                "generate",
                settings.subject,
                settings.jetstream,
                settings.model_path,
                tokenizer,
                configured=True,
            )
        self.catalog = ModelCatalog(settings, configured)
        self.parsers = ParserNames(
            settings.tool_call_parser, settings.enable_auto_tool_choice, settings.reasoning_parser
        )
        if self.parsers.any and tokenizer is not None:
            check_parsers(self.parsers, tokenizer.tokenizer)  # as vllm serve: fail the start

    @property
    def router(self) -> KvRouter | None:
        """The configured model's KV router (None in queue or JetStream mode)."""
        configured = self.catalog.configured
        return configured.router if configured is not None else None

    def chat_plan(self, body: ChatCompletionRequest, model: ServedModel) -> ChatPlan | None:
        """vLLM's handling of the request's structured outputs, tools and parsers (vllm is
        imported for it); None for a plain request when no parser runs."""
        if not (body.structured or body.uses_tools or self.parsers.any):
            return None
        return chat_plan(body, self.parsers, model.tokenizer.tokenizer)

    def completion_guided(self, body: CompletionRequest) -> GuidedDecoding | None:
        """A completions request's structured outputs as the wire's guided_decoding."""
        return completion_guided_decoding(body) if body.structured else None

    async def start(self) -> None:
        if self._nc is None and self._connect is not None:
            self._nc = self._owned = await self._connect()
        if self._nc is not None:
            await self.catalog.start(self._nc, self.settings.discovery_refresh_s)

    async def stop(self) -> None:
        try:
            await self.catalog.stop()
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

    async def target(self, name: str | None, kind: str | None = "generate") -> Target:
        """The model (and adapter) a request's `model` names; 404 for one no worker serves.
        `kind` None: a model of any kind."""
        return await self.catalog.resolve(name, kind)

    async def max_model_len(self, model: ServedModel) -> int | None:
        """The context length a worker of the model reports in discovery; None if none answers
        (nothing here knows it otherwise: the engine is the workers')."""
        if (length := self.catalog.max_model_len(model.subject)) is not None:
            return length
        if (nc := self.connected()) is None:
            return None
        found = await find_worker(
            nc, model.subject, window=self.settings.discovery_window_s, jetstream=model.jetstream
        )
        try:
            return int(found["max_model_len"]) if found else None
        except (KeyError, ValueError):
            return None

    async def unhealthy(self) -> str | None:
        """Why the frontend cannot serve now; None when a worker of the configured model (any
        worker, without one) answers discovery in time."""
        if (nc := self.connected()) is None:
            return "not connected to NATS"
        settings = self.settings
        timeout = settings.health_timeout_s
        configured = self.catalog.configured
        if configured is None:
            # The first answer is enough: /health does not wait out the whole window.
            async with aclosing(
                discovery_answers(nc, f"$SRV.PING.{SERVICE_NAME}", timeout)
            ) as pongs:
                async for _ in pongs:
                    return None
            return f"no worker answered discovery within {timeout} s"
        if (
            await find_worker(
                nc, configured.subject, window=timeout, jetstream=configured.jetstream
            )
            is None
        ):
            return f"no worker of {configured.subject} answered within {timeout} s"
        return None

    async def command_all(self, model: ServedModel, request: ControlRequest) -> list[ControlReply]:
        """An admin command to every worker of the model; each one's answer."""
        nc = self.connection()
        replies = await fleet.command_all(
            nc,
            model.subject,
            request,
            window=self.settings.discovery_window_s,
            timeout=self.settings.timeout_s,
        )
        await self.catalog.refresh()  # what the workers hold now (adapters)
        return replies

    async def embed(self, model: ServedModel, request: EmbedRequest) -> Embeddings:
        """The request's vectors from a worker of the model (retried whole on another worker
        for any retryable end, worker/client/embeddings.py); its error as an OpenAIError."""
        nc, settings = self.connection(), self.settings
        try:
            if model.jetstream:
                return await jetstream_embed(
                    nc, request, subjects=subjects_of(model.subject), timeout=settings.timeout_s
                )
            return await embed(
                nc,
                request,
                subject=model.subject,
                timeout=settings.timeout_s,
                retries=settings.retries,
                discovery_window=settings.discovery_window_s,
                silence_timeout=settings.silence_timeout_s,
            )
        except RequestError as error:
            raise OpenAIError.from_worker(error.code, error.message) from error
        except Exception as error:
            raise transport_error(error) from error

    def log_accepted(self, request_id: str, model: str, user: str | None, prompts: int) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request %s: model %s, user %s, %d prompt(s)",
                loggable(request_id),
                loggable(model),
                "-" if user is None else loggable(user),
                prompts,
            )

    def publish(
        self, model: ServedModel, request: GenerateRequest
    ) -> tuple[Frames, Callable[[], None] | None]:
        """The request sent (to the JetStream work queue, the worker the router picks, or the
        queue group): its frames, and what to call once they end (the router's count)."""
        nc, settings = self.connection(), self.settings
        if model.jetstream:
            subjects = subjects_of(model.subject)
            frames = jetstream_stream(
                nc,
                request,
                subjects=subjects,
                timeout=settings.timeout_s,
                migration_limit=settings.migration_limit,
                silence_timeout=settings.silence_timeout_s,
            )
            return frames, None
        subject, release = model.subject, None
        if (router := model.router) is not None:
            route = router.route(request.token_ids, request.model)
            release = functools.partial(router.release, route)
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
        self, watcher: asyncio.Task[None], model: ServedModel, request: GenerateRequest
    ) -> FrameSource:
        """The request sent and its first frame read; a refusal or failure is raised."""
        source, release = self.publish(model, request)
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
        self,
        client_gone: ClientGone,
        model: ServedModel,
        requests: Sequence[GenerateRequest],
    ) -> Batch:
        """Every prompt's request sent at once and its first frame read; any failure is the
        whole response's (the first, in prompt order), and the others are cancelled."""
        watcher = asyncio.create_task(client_gone())
        try:
            started: list[FrameSource | BaseException]
            if len(requests) == 1:
                # One prompt (nearly every request) is started in this task: a task of its own
                # would first wait a turn of the event loop, behind every stream's frames.
                started = [await _settled(self.start_request(watcher, model, requests[0]))]
            else:
                started = await asyncio.gather(
                    *(self.start_request(watcher, model, r) for r in requests),
                    return_exceptions=True,
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
        client_gone: ClientGone,
        answer: Answer[Any],
        model: ServedModel,
        requests: Sequence[GenerateRequest],
    ) -> dict[str, Any]:
        """The whole answer's body, once every frame arrived."""
        batch = await self.start_batch(client_gone, model, requests)
        await batch.fold(answer.feed)
        self.metrics.count_usage(answer.usage())
        return answer.body()

    async def stream(
        self,
        client_gone: ClientGone,
        answer: Answer[Any],
        model: ServedModel,
        requests: Sequence[GenerateRequest],
        *,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The answer's SSE events, once every prompt's first frame arrived."""
        batch = await self.start_batch(client_gone, model, requests)
        return sse.events(
            batch, answer, include_usage=include_usage, on_answered=self.metrics.count_usage
        )
