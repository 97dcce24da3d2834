"""`GET /v1/models`: the served names, with the context length a worker reports."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from worker.frontend.openai_shapes import model_list
from worker.frontend.routes.common import Service

router = APIRouter()


@router.get("/v1/models")
async def models(service: Service) -> dict[str, Any]:
    settings = service.settings
    return model_list(settings.model_names, settings.model_path, await service.max_model_len())
