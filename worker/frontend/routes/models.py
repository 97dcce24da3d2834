"""`GET /v1/models`: every model a live worker serves (and the one the frontend was started
with), with the context length its workers report, then the LoRA adapters the workers hold
(their `parent` the model they hold them for, as in vLLM's server)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from worker.frontend.openai_shapes import model_cards
from worker.frontend.routes.common import Service

router = APIRouter()


@router.get("/v1/models")
async def models(service: Service) -> dict[str, Any]:
    return model_cards(service.catalog.cards())
