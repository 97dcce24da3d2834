"""Routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (streaming or not), and
vLLM's `/tokenize`, `/detokenize`, `/health`, `/metrics`, `/version`.

Each request is tokenized here, sent over NATS with `worker.client.generate` (which retries a
refusal on another worker while nothing was returned yet) and converted by openai_shapes. A
completions batch (a list of prompts) is one NATS request per prompt, answered as one response:
choice `prompt_index * n + j`, as vLLM numbers them. Invariants:
- the first frame of every prompt is awaited before any HTTP status is chosen, so a request the
  worker refuses (invalid, overloaded everywhere) is an OpenAI error body with a 4xx/5xx status,
  streaming or not; one prompt's error is the whole response's (the others are cancelled);
- an HTTP client that goes away (or a request that stops for any reason) closes the frame
  iterators, which publish their cancels: the engine is freed within a round trip. If this
  process dies instead, its NATS inbox disappears and the worker's liveness probe aborts them;
- with an API key, nothing under `/v1` runs without it (401 before any route).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import pydantic
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from nats.aio.client import Client as NATS
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from messages.errors import kind
from messages.frames import ResponseFrame
from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
from worker import __version__
from worker.client import (
    FrameOrderError,
    RequestError,
    find_worker,
    generate,
    jetstream_stream,
    subjects_of,
)
from worker.client.router import KvRouter
from worker.frontend.metrics import FrontendMetrics, route_label
from worker.frontend.openai_shapes import (
    ChatChoice,
    CompletionChoice,
    PromptEcho,
    prompt_echo,
    usage,
)
from worker.frontend.schemas import (
    UNION_SHAPES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    InvalidField,
    SamplingFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from worker.frontend.settings import FrontendSettings
from worker.frontend.tokenizer import ChatTemplateMissing, ModelTokenizer

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
_JSON = msgspec.json.Encoder()


__all__ = ["FrontendSettings", "create_app"]


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
    # Union members add their type name to the path (`prompt.str`, `prompt.list[int]`): not
    # part of the field.
    tags = ("str", "int", "function-after")
    shapes = [part for part in location if part in tags or "[" in part]
    location = [part for part in location if part not in tags and "[" not in part]
    param = ".".join(location) or None
    if shapes and location and location[0] in UNION_SHAPES:
        field_name = location[0]
        got = json.dumps(error.get("input"), default=str)[:100]
        message = f"{field_name}: must be {UNION_SHAPES[field_name]} (got {got})"
        return OpenAIError(400, message, "invalid_request_error", field_name)
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


def _stop_conditions(body: SamplingFields, max_tokens: int | None) -> StopConditions:
    return StopConditions(
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
        stop_token_ids=body.stop_token_ids,
        stop=body.stop_strings,
        include_stop_str_in_output=body.include_stop_str_in_output or None,
    )


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
        logit_bias=body.token_bias,
    )


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _until_disconnected(
    watcher: asyncio.Task[None],
    frames: AsyncGenerator[ResponseFrame, None],
    on_end: Callable[[], None] | None = None,
) -> AsyncGenerator[ResponseFrame, None]:
    """`frames`, stopped (and so cancelled on the worker) as soon as `watcher` (the HTTP
    request's one `_watch_disconnect`, shared by a batch's prompts) ends. Polling is needed: a
    stream that waits for its next frame sends nothing that could fail. Closing this closes
    `frames` too, whatever the reason (disconnect, error, task cancelled).

    The watcher's end cancels the task that waits for the next frame; that one cancellation is
    taken back (`uncancel`) and ends the frames, while any other cancellation of the task goes
    on. Nothing is made per frame: racing each frame against the watcher made a task and an
    `asyncio.wait` per token, a sixth of a frontend process's time under load (bench/RESULTS.md,
    P8 fourth run)."""
    gone = False
    waiting: asyncio.Task[Any] | None = None

    def on_gone(_: asyncio.Future[None]) -> None:
        nonlocal gone
        if watcher.cancelled():
            return  # the HTTP request ended normally
        gone = True
        if waiting is not None:
            waiting.cancel()

    watcher.add_done_callback(on_gone)
    try:
        while not gone:
            waiting = asyncio.current_task()
            try:
                frame = await anext(frames)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if gone and task is not None and task.uncancel() == 0:
                    break
                raise
            finally:
                waiting = None
            yield frame
            # Frames already queued are read without suspending: without this one loop pass
            # per frame, a stream drains its backlog while new requests wait (TTFT).
            await asyncio.sleep(0)
        log.info("HTTP client gone: cancelling its request")
    finally:
        watcher.remove_done_callback(on_gone)
        try:
            await frames.aclose()
        finally:
            # Here, not in a caller: this generator is closed even when its consumer never
            # ran (a response cancelled before its first step), at the latest when collected.
            if on_end is not None:
                on_end()


class FrameSource:
    """One request's frames with its first frame already read (see the module's invariants)."""

    def __init__(self, frames: AsyncGenerator[ResponseFrame, None], first: ResponseFrame) -> None:
        self._frames = frames
        self.first = first

    async def all(self) -> AsyncGenerator[ResponseFrame, None]:
        yield self.first
        async for frame in self._frames:
            yield frame

    async def aclose(self) -> None:
        await self._frames.aclose()


class Batch:
    """One HTTP request's NATS requests (one per prompt of a completions batch, else one), each
    with its first frame read, and the one watcher of the HTTP client's disconnect."""

    def __init__(self, sources: list[FrameSource], watcher: asyncio.Task[None]) -> None:
        self.sources = sources
        self._watcher = watcher

    async def frames(self) -> AsyncGenerator[tuple[int, ResponseFrame], None]:
        """(prompt index, frame): every prompt's frames, interleaved as they arrive (each
        prompt's in its own order). Leaving early stops every prompt's request."""
        if len(self.sources) == 1:  # one prompt: no fan-in, no task per frame
            async with contextlib.aclosing(self.sources[0].all()) as stream:
                async for frame in stream:
                    yield 0, frame
            return
        streams = [source.all() for source in self.sources]
        pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for step in sorted(done, key=pending.__getitem__):
                    index = pending.pop(step)
                    try:
                        frame = step.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
                    yield index, frame
        finally:
            for step in pending:
                step.cancel()
            for step in pending:
                with contextlib.suppress(BaseException):
                    await step
            for stream in streams:
                await stream.aclose()

    async def aclose(self) -> None:
        """Stops every prompt's request (a cancel for those still running). Idempotent."""
        try:
            for source in self.sources:
                await source.aclose()
        finally:
            self._watcher.cancel()

    async def fold(self, add: Callable[[int, ResponseFrame], object]) -> None:
        """Non-streaming: every frame through `add(prompt index, frame)`; a worker error frame
        is the HTTP error (the other prompts' requests are cancelled)."""
        try:
            async with contextlib.aclosing(self.frames()) as frames:
                async for index, frame in frames:
                    if frame.error:
                        raise OpenAIError.from_worker(frame.error.code, frame.error.message)
                    add(index, frame)
        finally:
            await self.aclose()


@dataclass
class Reply:
    """What every response body and chunk of one request shares: the envelope and the usage."""

    request_id: str
    model: str
    prompt_tokens: int
    choices: Sequence[CompletionChoice | ChatChoice]
    metrics: FrontendMetrics
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

    def count_tokens(self) -> None:
        """Adds an answered request's usage to the metrics."""
        usage = self.usage()
        self.metrics.tokens.labels("prompt").inc(usage["prompt_tokens"])
        self.metrics.tokens.labels("completion").inc(usage["completion_tokens"])

    def stream(
        self,
        source: Batch,
        object_: str,
        chunk_of: Callable[[int, ResponseFrame], dict[str, Any] | None],
        *,
        include_usage: bool,
        opening: Sequence[dict[str, Any]] = (),
    ) -> StreamingResponse:
        """SSE: the `opening` chunks, one chunk per frame that `chunk_of(prompt index, frame)`
        makes one of, then usage if asked, then [DONE]. Past the headers a failure can only be
        an error event, and the stream still ends with [DONE]; leaving early closes `source`
        (a cancel per prompt)."""

        async def events() -> AsyncIterator[bytes]:
            try:
                for opener in opening:
                    yield _sse(self.envelope(object_, [opener]))
                failed = False
                async with contextlib.aclosing(source.frames()) as frames:
                    async for index, frame in frames:
                        if frame.error:
                            error = OpenAIError.from_worker(frame.error.code, frame.error.message)
                            yield _sse(error.body())
                            failed = True
                            break
                        chunk = chunk_of(index, frame)
                        if chunk is not None:
                            yield _sse(self.envelope(object_, [chunk]))
                if not failed:
                    self.count_tokens()
                    if include_usage:
                        yield _sse(self.body(object_, []))
            except Exception as error:
                yield _sse(_transport_error(error).body())
            finally:
                await source.aclose()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


class Gate:
    """ASGI middleware in front of every route: the API key (`/v1/*` only, as vLLM's server)
    and the request metrics (status, duration to the end of the body, in flight). Pure ASGI,
    not BaseHTTPMiddleware, so streams and disconnect polling pass through untouched."""

    def __init__(self, app: ASGIApp, settings: FrontendSettings, metrics: FrontendMetrics):
        self.app = app
        self.expected = f"Bearer {settings.api_key}".encode() if settings.api_key else None
        self.metrics = metrics

    def _authorized(self, scope: Scope) -> bool:
        if self.expected is None or not scope["path"].startswith("/v1"):
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])
        started = time.monotonic()
        status = 500  # unless a response starts

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            if self._authorized(scope):
                await self.app(scope, receive, sending)
            else:
                error = OpenAIError(
                    401,
                    "invalid or missing API key: send the header Authorization: Bearer <key>",
                    "authentication_error",
                    code="invalid_api_key",
                )
                await JSONResponse(error.body(), status_code=401)(scope, receive, sending)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.duration.labels(route).observe(time.monotonic() - started)


def create_app(
    settings: FrontendSettings,
    tokenizer: ModelTokenizer,
    nc: NATS | None = None,
    connect: Callable[[], Awaitable[NATS]] | None = None,
    metrics: FrontendMetrics | None = None,
) -> FastAPI:
    """`nc`: an open connection (tests); else `connect()` is awaited at start-up and the
    connection closed at shutdown. `metrics`: default, a registry of this app's own."""
    state: dict[str, NATS] = {}
    if nc is not None:
        state["nc"] = nc
    metrics = metrics or FrontendMetrics()
    routers: list[KvRouter] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        owned = None
        if "nc" not in state and connect is not None:
            owned = state["nc"] = await connect()
        if "nc" in state and not settings.jetstream and settings.router != "queue":
            router = KvRouter(
                state["nc"],
                subjects_of(settings.subject),
                mode=settings.router,
                load_weight=settings.load_weight,
            )
            await router.start()
            routers.append(router)
            app.state.router = router  # for introspection (tests)
        try:
            yield
        finally:
            for router in routers:
                await router.stop()
            if owned is not None:
                await owned.close()

    app = FastAPI(title="vllm-nats-worker OpenAI frontend", version=__version__, lifespan=lifespan)
    app.add_middleware(Gate, settings=settings, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    def served_name(name: str | None) -> str:
        """The name a response carries: the one asked for, or the first served one (vLLM's
        rule when `model` is left out); a name not served is a 404."""
        if name is None:
            return settings.model_names[0]
        if name not in settings.model_names:
            raise OpenAIError(
                404, f"The model `{name}` does not exist.", "NotFoundError", "model", 404
            )
        return name

    def connected() -> NATS | None:
        nc = state.get("nc")
        return nc if nc is not None and nc.is_connected else None

    def connection() -> NATS:
        if (nc := connected()) is None:
            raise OpenAIError(503, "not connected to NATS", "service_unavailable")
        return nc

    async def a_worker(nc: NATS, window: float) -> dict[str, str] | None:
        """The discovery metadata of a worker of the subject that answers within `window`."""
        return await find_worker(nc, settings.subject, window=window, jetstream=settings.jetstream)

    async def max_model_len() -> int | None:
        """The context length a worker of the subject reports in discovery; None if none
        answers in time (nothing here knows it otherwise: the engine is the workers')."""
        if (nc := connected()) is None:
            return None
        found = await a_worker(nc, settings.discovery_window_s)
        try:
            return int(found["max_model_len"]) if found else None
        except (KeyError, ValueError):
            return None

    async def start(watcher: asyncio.Task[None], generate_request: GenerateRequest) -> FrameSource:
        nc = connection()
        release: Callable[[], None] | None = None
        if settings.jetstream:
            source = jetstream_stream(
                nc,
                generate_request,
                subjects=subjects_of(settings.subject),
                timeout=settings.timeout_s,
            )
        else:
            subject = settings.subject
            if routers:
                route = routers[0].route(generate_request.token_ids)
                release = functools.partial(routers[0].release, route)
                subject = route.subject or subject
                metrics.count_route(route)
            source = generate(
                nc,
                generate_request,
                subject=subject,
                timeout=settings.timeout_s,
                retries=settings.retries,
            )
        frames = _until_disconnected(watcher, source, release)
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

    async def start_batch(request: Request, generate_requests: list[GenerateRequest]) -> Batch:
        """Every prompt's request sent at once and its first frame read; any failure is the
        whole response's (the first, in prompt order), and the others are cancelled."""
        watcher = asyncio.create_task(_watch_disconnect(request))
        try:
            started = await asyncio.gather(
                *(start(watcher, r) for r in generate_requests), return_exceptions=True
            )
        except BaseException:
            watcher.cancel()
            raise
        sources = [s for s in started if isinstance(s, FrameSource)]
        batch = Batch(sources, watcher)
        if failures := [s for s in started if isinstance(s, BaseException)]:
            await batch.aclose()
            raise _transport_error(failures[0])
        return batch

    @app.get("/health", response_model=None)
    async def health() -> JSONResponse:
        """200 when a worker of the subject answers discovery in time, else 503 and why."""
        if (nc := connected()) is None:
            return JSONResponse({"status": "unavailable", "reason": "not connected to NATS"}, 503)
        if await a_worker(nc, settings.health_timeout_s) is None:
            reason = (
                f"no worker of {settings.subject} answered within {settings.health_timeout_s} s"
            )
            return JSONResponse({"status": "unavailable", "reason": reason}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(
            metrics.exposition(settings.metrics_dir),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        context = await max_model_len()
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm-nats-worker",
                    "root": settings.model_path or name,
                    "parent": None,
                    "max_model_len": context,
                }
                for name in settings.model_names
            ],
        }

    def encode_messages(messages: list[ChatMessage], **options: Any) -> list[int]:
        try:
            return tokenizer.encode_chat(
                [{"role": m.role, "content": m.text()} for m in messages], **options
            )
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

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any] = Body(...)) -> dict[str, Any]:  # noqa: B008
        """vLLM's two shapes: `prompt` (TokenizeCompletionRequest) or `messages`
        (TokenizeChatRequest), told apart by which of them the body has."""
        shape = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            parsed = shape.model_validate(body)
        except pydantic.ValidationError as error:
            raise RequestValidationError(error.errors()) from error
        served_name(parsed.model)
        if isinstance(parsed, TokenizeChatRequest):
            token_ids = encode_messages(
                parsed.messages,
                template_kwargs=parsed.chat_template_kwargs,
                add_generation_prompt=parsed.add_generation_prompt,
                add_special_tokens=parsed.add_special_tokens,
            )
        else:
            token_ids = tokenizer.encode_prompt(parsed.prompt, parsed.add_special_tokens)
        return {
            "count": len(token_ids),
            "max_model_len": await max_model_len(),
            "tokens": token_ids,
            "token_strs": tokenizer.token_strs(token_ids) if parsed.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        served_name(body.model)
        for position, token_id in enumerate(body.tokens):
            if token_id >= len(tokenizer):
                raise OpenAIError(
                    400,
                    f"tokens.{position}: token id {token_id} is outside the tokenizer's "
                    f"vocabulary (must be < {len(tokenizer)})",
                    "invalid_request_error",
                    f"tokens.{position}",
                )
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/v1/completions", response_model=None)
    async def completions(
        body: CompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        model = served_name(body.model)
        prompts: list[tuple[list[int], str | None]] = []
        for position, prompt in enumerate(body.prompts):
            if isinstance(prompt, str):
                prompts.append((tokenizer.encode_prompt(prompt), prompt))
            else:
                prompts.append((list(prompt), None))
            if not prompts[-1][0]:
                param = f"prompt.{position}" if body.batched else "prompt"
                raise OpenAIError(
                    400, f"{param}: must not be empty", "invalid_request_error", param
                )
        k = body.logprobs
        # Prompt scoring (echo, max_tokens 0): the wire's max_tokens is >= 1, so one token is
        # generated and dropped, as vLLM's server does; only the prompt and its logprobs return.
        scoring = body.scoring
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generate_requests = [
            GenerateRequest(
                request_id=f"{request_id}-{i}" if body.batched else request_id,
                token_ids=prompt_ids,
                sampling_options=_sampling(body),
                stop_conditions=_stop_conditions(body, 1 if scoring else body.max_tokens),
                output_options=OutputOptions(
                    logprobs=None if scoring else k,
                    prompt_logprobs=k if body.echo and k is not None else None,
                ),
            )
            for i, (prompt_ids, _) in enumerate(prompts)
        ]
        source = await start_batch(request, generate_requests)
        n = body.n
        choices = [
            CompletionChoice(
                p * n + j,
                tokenizer,
                k,
                score_only=scoring,
                stop=body.stop_strings,
                include_stop=body.include_stop_str_in_output,
            )
            for p in range(len(prompts))
            for j in range(n)
        ]
        reply = Reply(request_id, model, sum(len(ids) for ids, _ in prompts), choices, metrics)
        # Each prompt's logprobs and rows, filled by the frames that precede its tokens.
        prompt_logprobs: list[tuple[list[float | None], list[Any]]] = [([], []) for _ in prompts]

        def feed(
            prompt: int, frame: ResponseFrame
        ) -> tuple[CompletionChoice, str, dict[str, Any]] | None:
            """Folds one frame in; None for prompt-logprob frames (they precede all tokens)."""
            if frame.prompt_log_probs:
                prompt_logprobs[prompt][0].extend(frame.prompt_log_probs)
                prompt_logprobs[prompt][1].extend(frame.prompt_top_logprobs or [])
                return None
            choice = choices[prompt * n + frame.index]
            if body.echo and choice.echo is None:
                choice.echo = echo(prompt)
            delta, logprobs = choice.add(frame)
            return choice, delta, logprobs

        def echo(prompt: int) -> PromptEcho:
            prompt_ids, prompt_text = prompts[prompt]
            log_probs, rows = prompt_logprobs[prompt]
            return prompt_echo(tokenizer, prompt_ids, prompt_text, log_probs, rows, k is not None)

        if not body.stream:
            await source.fold(feed)
            reply.count_tokens()
            return JSONResponse(reply.body("text_completion", [c.choice() for c in choices]))

        def chunk_of(prompt: int, frame: ResponseFrame) -> dict[str, Any] | None:
            fed = feed(prompt, frame)
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
                "stop_reason": choice.stop_reason if frame.finish_reason else None,
            }

        return reply.stream(source, "text_completion", chunk_of, include_usage=body.include_usage)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request
    ) -> JSONResponse | StreamingResponse:
        model = served_name(body.model)
        prompt_ids = encode_messages(body.messages, template_kwargs=body.chat_template_kwargs)
        k = (body.top_logprobs or 0) if body.logprobs else None
        generate_request = GenerateRequest(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            token_ids=prompt_ids,
            sampling_options=_sampling(body),
            stop_conditions=_stop_conditions(body, body.token_limit),
            output_options=OutputOptions(logprobs=k),
        )
        source = await start_batch(request, [generate_request])
        choices = [
            ChatChoice(
                i,
                tokenizer,
                k,
                stop=body.stop_strings,
                include_stop=body.include_stop_str_in_output,
            )
            for i in range(body.n)
        ]
        reply = Reply(generate_request.request_id, model, len(prompt_ids), choices, metrics)

        if not body.stream:
            await source.fold(lambda _, frame: choices[frame.index].add(frame))
            reply.count_tokens()
            return JSONResponse(reply.body("chat.completion", [c.message() for c in choices]))

        def chunk_of(_: int, frame: ResponseFrame) -> dict[str, Any] | None:
            choice = choices[frame.index]
            delta, entries = choice.add(frame)
            if not delta and not entries and frame.finish_reason is None:
                return None
            return {
                "index": choice.index,
                "delta": {"content": delta},
                "logprobs": {"content": entries} if k is not None else None,
                "finish_reason": choice.finish_reason if frame.finish_reason else None,
                "stop_reason": choice.stop_reason if frame.finish_reason else None,
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


def _sse(payload: dict[str, Any]) -> bytes:
    """One SSE event. msgspec's encoder: compact, UTF-8, a non-finite float as null (stdlib json
    writes `-Infinity`, which is not JSON), and about 5× faster per chunk."""
    return b"data: " + _JSON.encode(payload) + b"\n\n"
