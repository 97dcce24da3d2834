"""create_app: the frontend's FastAPI app. The routes (routes/) reach the FrontendService on
`app.state.service`; the Gate middleware checks the API key and counts every request; an
OpenAIError anywhere, or a body that breaks a rule, is answered as OpenAI's error body with its
status (and logged, every client-supplied string escaped)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from nats.aio.client import Client as NATS

from worker import __version__
from worker.frontend.errors import OpenAIError, validation_error
from worker.frontend.gate import Gate
from worker.frontend.metrics import FrontendMetrics
from worker.frontend.routes import ROUTERS, admin_routers
from worker.frontend.service import FrontendService
from worker.frontend.settings import FrontendSettings
from worker.frontend.tokenizer import ModelTokenizer
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)

__all__ = ["FrontendSettings", "create_app"]


def error_response(request: Request, error: OpenAIError) -> JSONResponse:
    log.info(
        "%s %s: %d %s",
        loggable(request.method),
        loggable(request.url.path),
        error.status,
        loggable(error.message),
    )
    return JSONResponse(error.body(), status_code=error.status)


async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(request, exc)


async def on_invalid_body(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(request, validation_error(exc.errors()))


def create_app(
    settings: FrontendSettings,
    tokenizer: ModelTokenizer | None,
    nc: NATS | None = None,
    connect: Callable[[], Awaitable[NATS]] | None = None,
    metrics: FrontendMetrics | None = None,
) -> FastAPI:
    """`tokenizer`: the configured model's (None: the frontend serves the models its workers
    announce, worker/frontend/catalog.py). `nc`: an open connection (tests); else `connect()`
    is awaited at start-up and the connection closed at shutdown. `metrics`: default, a
    registry of this app's own."""
    service = FrontendService(settings, tokenizer, metrics, nc=nc, connect=connect)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        app.state.router = service.router  # for introspection (tests)
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="vllm-nats-worker OpenAI frontend", version=__version__, lifespan=lifespan)
    app.state.service = service
    app.add_middleware(Gate, settings=settings, metrics=service.metrics)
    app.add_exception_handler(RequestValidationError, on_invalid_body)
    app.add_exception_handler(OpenAIError, on_openai_error)
    for router in (*ROUTERS, *admin_routers(settings)):
        app.include_router(router)
    return app
