"""A pooling model's embeddings: EmbedRequest → one vLLM `encode` per input → packed vectors.

As vLLM's `/v1/embeddings` (OpenAIServingEmbedding) runs them: every input its own engine
request with `PoolingParams(task="embed", dimensions, use_activation)`, all at once, the
vectors in input order. An error in any input fails the request and aborts the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from vllm import PoolingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from messages.embeddings import EmbedRequest
from worker.engine.admin import VllmAdmin
from worker.engine.contract import EngineDead, EngineFailure
from worker.engine.vllm_errors import INPUT_ERRORS, input_error, invalid
from worker.errors import describe


class VllmEmbedder:
    def __init__(self, llm: AsyncLLM, prompt: Callable[[list[int]], Any], admin: VllmAdmin) -> None:
        self._llm = llm
        self._prompt = prompt
        self._admin = admin

    async def embed(self, request: EmbedRequest, engine_request_id: str) -> list[bytes]:
        lora = self._admin.lora_request(request.model)
        params = PoolingParams(
            task="embed", dimensions=request.dimensions, use_activation=request.use_activation
        )
        if request.dimensions is not None:
            # Checked once here, so the refusal names the field (the engine checks it per input).
            try:
                params.clone().verify(self._llm.model_config)
            except (*INPUT_ERRORS, TypeError) as error:  # TypeError: an older verify signature
                if not isinstance(error, TypeError):
                    raise invalid(error, "dimensions") from error
        tasks = [
            asyncio.ensure_future(self._one(tokens, params, f"{engine_request_id}-{index}", lora))
            for index, tokens in enumerate(request.inputs)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one failed (or the request was cancelled): abort the rest
                task.cancel()

    async def _one(
        self, tokens: list[int], params: PoolingParams, request_id: str, lora: Any
    ) -> bytes:
        try:
            prompt = self._prompt(tokens)
        except INPUT_ERRORS as error:
            raise invalid(error, "inputs") from error
        last = None
        try:
            async for output in self._llm.encode(prompt, params, request_id, lora_request=lora):
                last = output
        except EngineDeadError as error:
            raise EngineDead(str(error) or "vLLM engine is dead") from error
        except Exception as error:
            cause = input_error(error)
            if cause is not None:
                raise invalid(cause, "inputs") from error
            if self._llm.errored:
                raise EngineDead(f"vLLM engine failed: {describe(error)}") from error
            raise EngineFailure(describe(error)) from error
        if last is None:
            raise EngineFailure("the engine ended an embedding request without its vector")
        # vLLM's server sends `.tolist()` of this tensor as JSON floats, or its float32 bytes as
        # base64: the vector is float32 either way.
        data = last.outputs.data
        return bytes(data.detach().to("cpu").float().contiguous().numpy().astype("<f4").tobytes())
