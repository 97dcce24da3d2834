"""Fake engines, for transport-level tests and benchmarks only (never served by the CLI).

Each implements the engine contract (worker/engine/contract.py) without a model:
- `PacedFakeEngine` streams `max_tokens` tokens, one every `step_s`, with logprob rows when
  asked, so requests stay in flight for a known time: what liveness and outage tests and the
  probe-load benchmark need at a concurrency the real engine on a CPU cannot reach;
- `SyntheticFastEngine` emits fixed tokens and rows as fast as it can (the transport ceiling,
  bench/p3_transport.py);
- `AlwaysFailingFakeEngine` fails every request (retry and JetStream redelivery tests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from messages.frames import FinishReason, TopLogprob
from messages.request import GenerateRequest
from worker.engine.contract import ChoiceDelta, EngineFailure, EngineLimits, EngineStep


class PacedFakeEngine:
    def __init__(self, step_s: float = 0.05) -> None:
        self.step_s = step_s
        self.limits = EngineLimits(
            model="paced-fake", max_logprobs=20, vocab_size=1024, max_model_len=1 << 20
        )
        self.running = 0

    async def generate(
        self, request: GenerateRequest, engine_request_id: str
    ) -> AsyncGenerator[EngineStep, None]:
        k = request.output_options.logprobs
        total = request.stop_conditions.max_tokens or 16
        n = request.sampling_options.n
        self.running += 1
        try:
            for i in range(total):
                await asyncio.sleep(self.step_s)
                token = 100 + i % 50
                rows: list[list[TopLogprob] | None] | None = None
                if k is not None:
                    rows = [
                        [TopLogprob(1, token, f"t{token}", -0.5, b"t")]
                        + [
                            TopLogprob(r, 200 + r, f"t{200 + r}", -1.0 * r, b"u")
                            for r in range(2, k + 1)
                        ]
                    ]
                finish: FinishReason | None = "length" if i == total - 1 else None
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


class SyntheticFastEngine:
    """A fake engine for transport benchmarks only: fixed tokens and rows, no model."""

    def __init__(self, yield_every: int = 1) -> None:
        self.yield_every = yield_every
        self.limits = EngineLimits(
            model="synthetic",
            max_logprobs=20,
            vocab_size=1024,
            max_model_len=4096,
            engine="synthetic",
        )
        self._row = {
            k: [TopLogprob(r, 100 + r, f"tok{r}", -0.1 * r, b"tok") for r in range(1, k + 1)]
            for k in (0, 1, 5, 20)
        }

    async def generate(
        self, request: GenerateRequest, engine_request_id: str
    ) -> AsyncGenerator[EngineStep, None]:
        k = request.output_options.logprobs
        total = request.stop_conditions.max_tokens or 16
        row = self._row.get(k or 0) or self._row[20][: k or 0]
        every = self.yield_every
        for i in range(total):
            if every and i % every == 0:
                await asyncio.sleep(0)  # a step boundary: other requests' steps interleave
            last = i == total - 1
            yield EngineStep(
                None,
                [
                    ChoiceDelta(
                        0,
                        [101],
                        None if k is None else [-0.1],
                        None if k is None else [row],
                        "length" if last else None,
                    )
                ],
            )

    async def abort(self, engine_request_id: str) -> None:
        pass

    def num_unfinished_requests(self) -> int:
        return 0

    async def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class AlwaysFailingFakeEngine:
    """A fake engine (transport-level test only): every request fails as an engine error."""

    def __init__(self) -> None:
        self.limits = EngineLimits(
            model="fake", max_logprobs=20, vocab_size=1024, max_model_len=512
        )
        self.calls = 0

    async def generate(
        self, request: GenerateRequest, engine_request_id: str
    ) -> AsyncGenerator[EngineStep, None]:
        self.calls += 1
        raise EngineFailure("fake engine: this request always fails")
        yield  # pragma: no cover

    async def abort(self, engine_request_id: str) -> None:
        return None

    def num_unfinished_requests(self) -> int:
        return 0

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
