"""`GET /health`, `GET /metrics` (Prometheus) and `GET /version`."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from worker import __version__
from worker.frontend.routes.common import Service

router = APIRouter()

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/health", response_model=None)
async def health(service: Service) -> JSONResponse:
    """200 when a worker of the subject answers discovery in time, else 503 and why."""
    if reason := await service.unhealthy():
        return JSONResponse({"status": "unavailable", "reason": reason}, 503)
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def prometheus_metrics(service: Service) -> Response:
    settings = service.settings
    return Response(service.metrics.exposition(settings.metrics_dir), media_type=PROMETHEUS_TEXT)
