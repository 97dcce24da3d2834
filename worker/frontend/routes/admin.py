"""vLLM's admin routes, done to every worker of the subject (worker/client/fleet.py):
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM's server), `/reset_prefix_cache`, `/sleep`,
`/wake_up` and `/is_sleeping` (only with VLLM_SERVER_DEV_MODE). Without its switch a router
is not mounted (`admin_routers`): its routes are 404, as in vLLM's server.

They reach the workers of one model: the `model` a LoRA body or a dev route's query names (this
frontend's addition to vLLM's routes, for a frontend of several models), else the default model
(the configured one, or the first generator discovered). Each worker answers for itself: a
command that succeeds everywhere answers as vLLM's server does; one that fails on any worker
answers with the first failure's status and names every worker that failed and why. No worker
of the model: 503 `no_workers`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from messages.control import ControlReply, ControlRequest
from worker.frontend.errors import OpenAIError
from worker.frontend.routes.common import Service
from worker.frontend.service import FrontendService
from worker.frontend.settings import FrontendSettings

lora_router = APIRouter()
dev_router = APIRouter()


class LoadLoRAAdapter(BaseModel):
    """vLLM's LoadLoRAAdapterRequest, by its field names."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False
    model: str | None = None  # whose workers load it (not vLLM's: see the module's docstring)


class UnloadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # accepted as vLLM accepts it; names decide here
    model: str | None = None


async def _everywhere(
    service: FrontendService, request: ControlRequest, model: str | None
) -> list[ControlReply]:
    """`request` run on every worker of the model; raises the first failure, naming every
    worker that failed (its instance id, code and message)."""
    target = await service.target(model, None)
    if target.adapter is not None:
        raise OpenAIError(400, f"model: `{model}` is an adapter, not a model", "BadRequestError")
    replies = await service.command_all(target.model, request)
    if not replies:
        raise OpenAIError.from_worker(
            "no_workers", f"no worker of {target.model.subject} answered discovery"
        )
    failed = [r for r in replies if r.error is not None]
    if failed:
        first = failed[0].error
        assert first is not None
        detail = "; ".join(
            f"{r.instance_id}: {r.error.code}: {r.error.message}" for r in failed if r.error
        )
        raise OpenAIError.from_worker(
            first.code, f"{len(failed)} of {len(replies)} workers failed: {detail}"
        )
    return replies


@lora_router.post("/v1/load_lora_adapter", response_model=None)
async def load_lora_adapter(body: LoadLoRAAdapter, service: Service) -> Response:
    await _everywhere(
        service,
        ControlRequest(
            command="load_lora_adapter",
            lora_name=body.lora_name,
            lora_path=body.lora_path,
            load_inplace=body.load_inplace,
        ),
        body.model,
    )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@lora_router.post("/v1/unload_lora_adapter", response_model=None)
async def unload_lora_adapter(body: UnloadLoRAAdapter, service: Service) -> Response:
    await _everywhere(
        service, ControlRequest(command="unload_lora_adapter", lora_name=body.lora_name), body.model
    )
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


@dev_router.post("/reset_prefix_cache", response_model=None)
async def reset_prefix_cache(service: Service, model: str | None = None) -> Response:
    replies = await _everywhere(service, ControlRequest(command="reset_prefix_cache"), model)
    if not all(r.reset for r in replies):
        busy = [r.instance_id for r in replies if not r.reset]
        raise OpenAIError(
            500,
            f"the prefix cache could not be reset on {', '.join(busy)} (requests hold blocks)",
            "InternalServerError",
        )
    return Response(status_code=200)


@dev_router.post("/sleep", response_model=None)
async def sleep(service: Service, level: int = 1, model: str | None = None) -> Response:
    if level not in (1, 2):
        raise OpenAIError(400, "level: must be 1 or 2", "BadRequestError", "level")
    await _everywhere(service, ControlRequest(command="sleep", level=level), model)
    return Response(status_code=200)


@dev_router.post("/wake_up", response_model=None)
async def wake_up(
    service: Service, tags: list[str] | None = None, model: str | None = None
) -> Response:
    await _everywhere(service, ControlRequest(command="wake_up", tags=tags), model)
    return Response(status_code=200)


@dev_router.get("/is_sleeping", response_model=None)
async def is_sleeping(service: Service, model: str | None = None) -> JSONResponse:
    """vLLM's `{"is_sleeping": …}` (true when every worker sleeps) and each worker's own."""
    replies = await _everywhere(service, ControlRequest(command="is_sleeping"), model)
    each: dict[str, Any] = {r.instance_id: bool(r.is_sleeping) for r in replies}
    return JSONResponse({"is_sleeping": all(each.values()), "workers": each})


def admin_routers(settings: FrontendSettings) -> tuple[APIRouter, ...]:
    """The admin routers the settings' switches open."""
    opened = []
    if settings.allow_runtime_lora_updating:
        opened.append(lora_router)
    if settings.server_dev_mode:
        opened.append(dev_router)
    return tuple(opened)
