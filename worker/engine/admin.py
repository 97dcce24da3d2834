"""The admin commands of one vLLM engine (`EngineAdmin`, worker/engine/contract.py): its LoRA
adapters, its prefix cache and sleep mode, as vLLM's admin routes run them.

Adapters are kept as Dynamo's vLLM handlers keep them: a name → `LoRARequest` map beside the
engine, with the checks and words of vLLM's
server (its `OpenAIServingModels`: a name that is the base model's, a second load of a name, an
unknown name). vLLM's own class is not used: its map changed shape between the releases this
worker runs on (a list, then a dict), and its error type with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from vllm.lora.request import LoRARequest

from messages.errors import ErrorCode
from worker.engine.contract import AdminError, ModelNotFound
from worker.errors import describe
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)


def lora_id_of(name: str) -> int:
    """The engine's int id of the adapter `name`: derived from the name (as Dynamo derives it),
    not counted as vLLM's server counts, so that every process of `--worker-processes` (each a
    client of one engine core, each told of a load) gives an adapter the same id."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % (2**31 - 1) + 1


class VllmAdmin:
    """Admin commands and the adapter map of one engine; `base_names` are the served names a
    request's `model` may give for the base model."""

    def __init__(self, llm: Any, base_names: frozenset[str]) -> None:
        self._llm = llm
        self._base = base_names
        self._loras: dict[str, LoRARequest] = {}
        # One load or unload of a name at a time (vLLM's server locks per name too); a name's
        # lock lives while commands of it run or wait (`_one_at_a_time`), so names a client
        # made up leave nothing behind.
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, name: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(name) or (asyncio.Lock(), 0)
        self._locks[name] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model. ModelNotFound for
        any other name: a request is never answered by the base model in an adapter's stead."""
        if model is None or model in self._base:
            return None
        found = self._loras.get(model)
        if found is None:
            raise ModelNotFound(model)
        return found

    def adapters(self) -> dict[str, str]:
        return {name: request.lora_path for name, request in self._loras.items()}

    async def load_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None:
        if not name or not path:
            raise AdminError(
                "invalid_request", "Both 'lora_name' and 'lora_path' must be provided."
            )
        if name in self._base:
            raise AdminError(
                "invalid_request", f"The lora adapter '{name}' conflicts with a served base model."
            )
        async with self._one_at_a_time(name):
            previous = self._loras.get(name)
            if previous is not None and not load_inplace:
                raise AdminError(
                    "invalid_request",
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True.",
                )
            lora_id = lora_id_of(name)
            extra = {"load_inplace": True} if load_inplace else {}
            request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, **extra)
            try:
                # Loads it now (vLLM's server does the same): a bad adapter fails here, not in
                # the first request that names it.
                await self._llm.add_lora(request)
            except Exception as error:
                # vLLM's server answers a path with no adapter 404 and any other failure 500;
                # here that other failure (a rank above --max-lora-rank, a wrong shape) is the
                # caller's to fix, not retryable: invalid_request.
                text = describe(error)
                missing = "not found" in text.lower() or "no adapter found" in text.lower()
                code: ErrorCode = "model_not_found" if missing else "invalid_request"
                raise AdminError(code, text) from error
            self._loras[name] = request
        log.info("loaded LoRA adapter %s from %s (id %d)", loggable(name), loggable(path), lora_id)

    async def load_static(self, modules: list[Any]) -> None:
        """`--lora-modules` (vLLM's LoRAModulePath list): each loaded before the worker serves,
        any failure failing the start, as in `vllm serve`."""
        for module in modules:
            try:
                await self.load_adapter(module.name, module.path)
            except AdminError as error:
                raise ValueError(f"--lora-modules {module.name}={module.path}: {error}") from None

    async def unload_adapter(self, name: str) -> None:
        async with self._one_at_a_time(name):
            request = self._loras.pop(name, None)
            if request is None:
                raise AdminError("model_not_found", f"The lora adapter '{name}' cannot be found.")
            # vLLM's server only forgets the name; the engine's slot is freed here too, as
            # Dynamo's handlers do.
            await self._llm.remove_lora(request.lora_int_id)
        log.info("unloaded LoRA adapter %s", loggable(name))

    async def reset_prefix_cache(self) -> bool:
        # vLLM 0.32 says whether it could (False while running requests hold blocks); older
        # releases return nothing.
        return (await self._llm.reset_prefix_cache()) is not False

    async def sleep(self, level: int) -> None:
        try:
            await self._llm.sleep(level)
        except Exception as error:
            raise AdminError("invalid_request", describe(error)) from error

    async def wake_up(self, tags: list[str] | None) -> None:
        try:
            await self._llm.wake_up(tags)
        except Exception as error:
            raise AdminError("invalid_request", describe(error)) from error

    async def is_sleeping(self) -> bool:
        return bool(await self._llm.is_sleeping())
