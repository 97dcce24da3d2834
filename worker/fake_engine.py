"""A fake engine, for transport-level tests and benchmarks only (never served by the CLI).

`PacedFakeEngine` streams `max_tokens` tokens, one every `step_s`, with logprob rows when asked,
so requests stay in flight for a known time without a model: what liveness and outage tests
and the probe-load benchmark need at a concurrency the real engine on a CPU cannot reach.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from messages.frames import TopLogprob
from messages.request import GenerateRequest
from worker.engine_api import ChoiceDelta, EngineLimits, EngineStep


class PacedFakeEngine:
    def __init__(self, step_s: float = 0.05) -> None:
        self.step_s = step_s
        self.limits = EngineLimits(
            model="paced-fake", max_logprobs=20, vocab_size=1024, max_model_len=1 << 20
        )
        self.running = 0

    async def generate(
        self, request: GenerateRequest, engine_request_id: str
    ) -> AsyncIterator[EngineStep]:
        k = request.output_options.logprobs
        total = request.stop_conditions.max_tokens or 16
        n = request.sampling_options.n
        self.running += 1
        try:
            for i in range(total):
                await asyncio.sleep(self.step_s)
                token = 100 + i % 50
                rows = None
                if k is not None:
                    rows = [
                        [TopLogprob(1, token, f"t{token}", -0.5, b"t")]
                        + [
                            TopLogprob(r, 200 + r, f"t{200 + r}", -1.0 * r, b"u")
                            for r in range(2, k + 1)
                        ]
                    ]
                finish = "length" if i == total - 1 else None
                yield EngineStep(
                    None,
                    [
                        ChoiceDelta(index, [token], None if k is None else [-0.5], rows, finish)
                        for index in range(n)
                    ],
                )
        finally:
            self.running -= 1

    async def abort(self, engine_request_id: str) -> None:
        return None

    def num_unfinished_requests(self) -> int:
        return self.running

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
