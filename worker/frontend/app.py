"""Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (streaming or not).

Each request is tokenized here, sent over NATS with `worker.client.generate` (which retries a
refusal on another worker while nothing was returned yet) and converted by openai_shapes.
Invariants:
- the first frame is awaited before any HTTP status is chosen, so a request the worker refuses
  (invalid, overloaded everywhere) is an OpenAI error body with a 4xx/5xx status, streaming or not;
- an HTTP client that goes away (or a request that stops for any reason) closes the frame
  iterator, which publishes a cancel: the engine is freed within a round trip. If this process
  dies instead, its NATS inbox disappears and the worker's liveness probe aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from nats.aio.client import Client as NATS

from messages.errors import kind
from messages.frames import ResponseFrame
from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
from messages.subjects import Subjects
from worker.client import FrameOrderError, RequestError, generate, jetstream_stream, subjects_of
from worker.frontend.openai_shapes import (
    ChatChoice,
    CompletionChoice,
    PromptEcho,
    prompt_echo,
    usage,
)
from worker.frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidField,
    SamplingFields,
)
from worker.frontend.tokenizer import ChatTemplateMissing, ModelTokenizer

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class FrontendSettings:
    model_name: str
    subject: str = Subjects().generate
    timeout_s: float = 60.0
    """Longest wait for the next frame."""
    retries: int = 2
    """Further attempts on other workers after a retryable refusal (overloaded, shutdown)."""
    jetstream: bool = False
    """Publish to the subject's JetStream work queue (workers in `--mode jetstream`)."""


class OpenAIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: Any = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_worker(cls, code: str, message: str) -> OpenAIError:
        error = kind(code)
        return cls(error.http_status, message, error.openai_type, code=code)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first broken rule, named by its field path (`messages.0.role: ...`)."""
    error = exc.errors()[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidField):
        return OpenAIError(400, cause.message, "invalid_request_error", cause.param)
    location = [str(part) for part in error.get("loc", ()) if part != "body"]
    # Union members add their type name to the path (`prompt.str`): not part of the field.
    location = [part for part in location if part not in ("str", "list[int]", "function-after")]
    param = ".".join(location) or None
    if error.get("type") == "extra_forbidden" and param:
        return OpenAIError(
            400,
            f"{param}: not supported by this frontend (unknown here, so refused, not ignored)",
            "invalid_request_error",
            param,
        )
    message = f"{param}: {error.get('msg')}" if param else str(error.get("msg"))
    if "input" in error and param:
        message += f" (got {json.dumps(error['input'], default=str)[:100]})"
    return OpenAIError(400, message, "invalid_request_error", param)


def _sampling(body: SamplingFields) -> SamplingOptions:
    return SamplingOptions(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
    )


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _until_disconnected(
    request: Request, frames: AsyncGenerator[ResponseFrame, None]
) -> AsyncGenerator[ResponseFrame, None]:
    """`frames`, stopped (and so cancelled on the worker) as soon as the HTTP client is gone.
    Polling is needed: a stream that waits for its next frame sends nothing that could fail.
    Closing this closes `frames` too, whatever the reason (disconnect, error, task cancelled)."""
    watcher = asyncio.create_task(_watch_disconnect(request))
    step: asyncio.Future[ResponseFrame] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(frames))
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                log.info("HTTP client gone: cancelling its request")
                return
            try:
                frame = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield frame
    finally:
        watcher.cancel()
        if step is not None and not step.done():
            # The generator cannot be closed while a step of it runs: end that step first.
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
        await frames.aclose()


class FrameSource:
    """One request's frames with its first frame already read (see the module's invariants)."""

    def __init__(self, frames: AsyncGenerator[ResponseFrame, None], first: ResponseFrame) -> None:
        self._frames = frames
        self.first = first

    async def all(self) -> AsyncIterator[ResponseFrame]:
        yield self.first
        async for frame in self._frames:
            yield frame

    async def aclose(self) -> None:
        await self._frames.aclose()

    async def fold(self, add: Callable[[ResponseFrame], object]) -> None:
        """Non-streaming: every frame through `add`; a worker error frame is the HTTP error."""
        async for frame in self.all():
            if frame.error:
                raise OpenAIError.from_worker(frame.error.code, frame.error.message)
            add(frame)


@dataclass
class Reply:
    """What every response body and chunk of one request shares: the envelope and the usage."""

    request_id: str
    model: str
    prompt_tokens: int
    choices: Sequence[CompletionChoice | ChatChoice]
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, object_: str, choice_list: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choice_list,
        }

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, sum(c.completion_tokens for c in self.choices))

    def body(self, object_: str, choice_list: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.envelope(object_, choice_list), "usage": self.usage()}

    def stream(
        self,
        source: FrameSource,
        object_: str,
        chunk_of: Callable[[ResponseFrame], dict[str, Any] | None],
        *,
        include_usage: bool,
        opening: Sequence[dict[str, Any]] = (),
    ) -> StreamingResponse:
        """SSE: the `opening` chunks, one chunk per frame that `chunk_of` makes one of, then
        usage if asked, then [DONE]. Past the headers a failure can only be an error event,
        and the stream still ends with [DONE]; leaving early closes `source` (a cancel)."""

        async def events() -> AsyncIterator[str]:
            try:
                for opener in opening:
                    yield _sse(self.envelope(object_, [opener]))
                async for frame in source.all():
                    if frame.error:
                        error = OpenAIError.from_worker(frame.error.code, frame.error.message)
                        yield _sse(error.body())
                        break
                    chunk = chunk_of(frame)
                    if chunk is not None:
                        yield _sse(self.envelope(object_, [chunk]))
                else:
                    if include_usage:
                        yield _sse(self.body(object_, []))
            except Exception as error:
                yield _sse(_transport_error(error).body())
            finally:
                await source.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def create_app(
    settings: FrontendSettings,
    tokenizer: ModelTokenizer,
    nc: NATS | None = None,
    connect: Callable[[], Awaitable[NATS]] | None = None,
) -> FastAPI:
    """`nc`: an open connection (tests); else `connect()` is awaited at start-up and the
    connection closed at shutdown."""
    state: dict[str, NATS] = {}
    if nc is not None:
        state["nc"] = nc

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        owned = None
        if "nc" not in state and connect is not None:
            owned = state["nc"] = await connect()
        try:
            yield
        finally:
            if owned is not None:
                await owned.close()

    app = FastAPI(title="vllm-nats-worker OpenAI frontend", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def check_model(name: str) -> None:
        if name != settings.model_name:
            raise OpenAIError(
                404, f"The model `{name}` does not exist.", "NotFoundError", "model", 404
            )

    async def start(request: Request, generate_request: GenerateRequest) -> FrameSource:
        if "nc" not in state or not state["nc"].is_connected:
            raise OpenAIError(503, "not connected to NATS", "service_unavailable")
        if settings.jetstream:
            source = jetstream_stream(
                state["nc"],
                generate_request,
                subjects=subjects_of(settings.subject),
                timeout=settings.timeout_s,
            )
        else:
            source = generate(
                state["nc"],
                generate_request,
                subject=settings.subject,
                timeout=settings.timeout_s,
                retries=settings.retries,
            )
        frames = _until_disconnected(request, source)
        try:
            first = await anext(frames)
        except StopAsyncIteration:
            raise OpenAIError(499, "client gone", "client_gone") from None
        except BaseException as error:
            await frames.aclose()
            raise _transport_error(error) from error
        if first.error:
            await frames.aclose()
            raise OpenAIError.from_worker(first.error.code, first.error.message)
        return FrameSource(frames, first)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm-nats-worker",
                }
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids, prompt_text = tokenizer.encode_prompt(body.prompt), body.prompt
        else:
            prompt_ids, prompt_text = list(body.prompt), None
        if not prompt_ids:
            raise OpenAIError(400, "prompt: must not be empty", "invalid_request_error", "prompt")
        k = body.logprobs
        generate_request = GenerateRequest(
            request_id=f"cmpl-{uuid.uuid4().hex}",
            token_ids=prompt_ids,
            sampling_options=_sampling(body),
            stop_conditions=StopConditions(
                max_tokens=body.max_tokens,
                min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos,
                stop_token_ids=body.stop_token_ids,
            ),
            output_options=OutputOptions(
                logprobs=k, prompt_logprobs=k if body.echo and k is not None else None
            ),
        )
        source = await start(request, generate_request)
        choices: list[CompletionChoice] = [CompletionChoice(i, tokenizer, k) for i in range(body.n)]
        reply = Reply(generate_request.request_id, settings.model_name, len(prompt_ids), choices)
        prompt_log_probs: list[float | None] = []
        prompt_rows: list[Any] = []

        def feed(frame: ResponseFrame) -> tuple[CompletionChoice, str, dict[str, Any]] | None:
            """Folds one frame in; None for prompt-logprob frames (they precede all tokens)."""
            if frame.prompt_log_probs:
                prompt_log_probs.extend(frame.prompt_log_probs)
                prompt_rows.extend(frame.prompt_top_logprobs or [])
                return None
            choice = choices[frame.index]
            if body.echo and choice.echo is None:
                choice.echo = echo()
            delta, logprobs = choice.add(frame)
            return choice, delta, logprobs

        def echo() -> PromptEcho:
            return prompt_echo(
                tokenizer, prompt_ids, prompt_text, prompt_log_probs, prompt_rows, k is not None
            )

        if not body.stream:
            await source.fold(feed)
            return JSONResponse(reply.body("text_completion", [c.choice() for c in choices]))

        def chunk_of(frame: ResponseFrame) -> dict[str, Any] | None:
            fed = feed(frame)
            if fed is None:
                return None
            choice, delta, logprobs = fed
            if not delta and not logprobs["tokens"] and frame.finish_reason is None:
                return None
            return {
                "index": choice.index,
                "text": delta,
                "logprobs": logprobs if k is not None else None,
                "finish_reason": choice.finish_reason if frame.finish_reason else None,
            }

        return reply.stream(source, "text_completion", chunk_of, include_usage=body.include_usage)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = tokenizer.encode_chat(messages, body.chat_template_kwargs or {})
        except ChatTemplateMissing as error:
            raise OpenAIError(
                400, f"messages: {error}", "invalid_request_error", "messages"
            ) from error
        except Exception as error:  # a template that rejects these messages (roles, order)
            raise OpenAIError(
                400,
                f"messages: the chat template failed: {error}",
                "invalid_request_error",
                "messages",
            ) from error
        k = (body.top_logprobs or 0) if body.logprobs else None
        generate_request = GenerateRequest(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            token_ids=prompt_ids,
            sampling_options=_sampling(body),
            stop_conditions=StopConditions(
                max_tokens=body.token_limit,
                min_tokens=body.min_tokens,
                ignore_eos=body.ignore_eos,
                stop_token_ids=body.stop_token_ids,
            ),
            output_options=OutputOptions(logprobs=k),
        )
        source = await start(request, generate_request)
        choices = [ChatChoice(i, tokenizer, k) for i in range(body.n)]
        reply = Reply(generate_request.request_id, settings.model_name, len(prompt_ids), choices)

        if not body.stream:
            await source.fold(lambda frame: choices[frame.index].add(frame))
            return JSONResponse(reply.body("chat.completion", [c.message() for c in choices]))

        def chunk_of(frame: ResponseFrame) -> dict[str, Any] | None:
            choice = choices[frame.index]
            delta, entries = choice.add(frame)
            if not delta and not entries and frame.finish_reason is None:
                return None
            return {
                "index": choice.index,
                "delta": {"content": delta},
                "logprobs": {"content": entries} if k is not None else None,
                "finish_reason": choice.finish_reason if frame.finish_reason else None,
            }

        # OpenAI's first chunk per choice carries the role alone.
        opening = [
            {
                "index": choice.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for choice in choices
        ]
        return reply.stream(
            source,
            "chat.completion.chunk",
            chunk_of,
            include_usage=body.include_usage,
            opening=opening,
        )

    return app


def _transport_error(error: BaseException) -> OpenAIError:
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, RequestError):
        return OpenAIError.from_worker(error.code, error.message)
    if isinstance(error, nats.errors.TimeoutError):
        return OpenAIError(504, "no answer from a worker in time", "timeout")
    if isinstance(error, FrameOrderError):
        return OpenAIError(502, f"frames lost in transit: {error}", "internal_error")
    if isinstance(error, nats.errors.Error):
        return OpenAIError(503, f"NATS: {error!r}", "service_unavailable")
    if isinstance(error, asyncio.CancelledError):
        raise error
    log.exception("request failed", exc_info=error)
    return OpenAIError(500, f"{type(error).__name__}: {error}", "internal_error")


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
