"""Gate: the ASGI middleware in front of every route. With an API key, nothing under `/v1`
runs without it (401 before any route; the other routes stay open, as in vLLM's server); every
HTTP request is counted in the metrics (status, duration to the end of its body, in flight; a
streamed one also its time to the first body bytes, the first SSE event). Pure ASGI, not
BaseHTTPMiddleware, so streams and disconnect polling pass through untouched."""

from __future__ import annotations

import hmac
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.frontend.errors import missing_api_key
from worker.frontend.metrics import FrontendMetrics, route_label
from worker.frontend.settings import FrontendSettings


class Gate:
    def __init__(self, app: ASGIApp, settings: FrontendSettings, metrics: FrontendMetrics):
        self.app = app
        self.expected = f"Bearer {settings.api_key}".encode() if settings.api_key else None
        self.metrics = metrics

    def authorized(self, scope: Scope) -> bool:
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
        awaiting_first_event = False  # a streamed response whose first body bytes are not out

        async def sending(message: Message) -> None:
            nonlocal status, awaiting_first_event
            if message["type"] == "http.response.start":
                status = message["status"]
                awaiting_first_event = any(
                    name == b"content-type" and value.startswith(b"text/event-stream")
                    for name, value in message.get("headers", ())
                )
            elif awaiting_first_event and message.get("body"):
                awaiting_first_event = False
                self.metrics.first_token.labels(route).observe(time.monotonic() - started)
            await send(message)

        self.metrics.in_flight.inc()
        try:
            if self.authorized(scope):
                await self.app(scope, receive, sending)
            else:
                error = missing_api_key()
                await JSONResponse(error.body(), status_code=error.status)(scope, receive, sending)
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.duration.labels(route).observe(time.monotonic() - started)
