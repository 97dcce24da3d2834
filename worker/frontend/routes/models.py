"""`GET /v1/models`: the served names, with the context length a worker reports, and the LoRA
adapters the workers hold (their `parent` the first served name, as in vLLM's server)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from worker.frontend.openai_shapes import adapter_cards, model_list
from worker.frontend.routes.common import Service

router = APIRouter()


@router.get("/v1/models")
async def models(service: Service) -> dict[str, Any]:
    settings = service.settings
    listed = model_list(settings.model_names, settings.model_path, await service.max_model_len())
    listed["data"] += adapter_cards(await service.adapters(), settings.model_names[0])
    return listed
