"""Fake engines, for transport-level tests and benchmarks only (never served by the CLI).

Each implements the engine contract (worker/engine/contract.py) without a model:
- `PacedFakeEngine` streams `max_tokens` tokens, one every `step_s`, with logprob rows when
  asked, so requests stay in flight for a known time: what liveness and outage tests and the
  probe-load benchmark need at a concurrency the real engine on a CPU cannot reach;
- `SyntheticFastEngine` emits fixed tokens and rows as fast as it can (the transport ceiling,
  bench/p3_transport.py);
- `AlwaysFailingFakeEngine` fails every request (retry and JetStream redelivery tests);
- `FakePrefixCache`: an LRU cache of prompt blocks with engine-like events (stored with parent
  hashes and token ids, removed, cleared), given to `PacedFakeEngine` so KV-aware routing is
  tested fast; the end-to-end tests read the real engine's events.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from messages.frames import FinishReason, TopLogprob
from messages.kv import AllCleared, BlockHash, BlocksRemoved, BlocksStored, KvEvent
from messages.request import GenerateRequest
from worker.engine.contract import (
    ChoiceDelta,
    EngineFailure,
    EngineLimits,
    EngineLoad,
    EngineStep,
)


class FakePrefixCache:
    """A fake engine's prefix cache (transport-level tests only): full prompt blocks, chained by
    an engine hash of its own (salted, so a router that used it instead of chaining the token
    ids itself would never match), evicted least recently used beyond `capacity` blocks."""

    def __init__(self, block_size: int = 4, capacity: int = 256) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self.blocks: OrderedDict[int, tuple[int | None, list[int]]] = OrderedDict()
        self._readers: list[asyncio.Queue[list[KvEvent]]] = []

    def admit(self, token_ids: Sequence[int]) -> int:
        """Caches the prompt's full blocks; returns how many were cached already."""
        size = self.block_size
        parent: int | None = None
        hit = 0
        new_hashes: list[BlockHash] = []
        new_tokens: list[int] = []
        new_parent: int | None = None
        for start in range(0, len(token_ids) - size + 1, size):
            tokens = list(token_ids[start : start + size])
            block_hash = hash(("fake-engine", parent, tuple(tokens)))
            if block_hash in self.blocks:
                self.blocks.move_to_end(block_hash)
                if not new_hashes:
                    hit += 1
            else:
                if not new_hashes:
                    new_parent = parent
                self.blocks[block_hash] = (parent, tokens)
                new_hashes.append(block_hash)
                new_tokens.extend(tokens)
            parent = block_hash
        events: list[KvEvent] = []
        if new_hashes:
            events.append(BlocksStored(new_hashes, new_parent, new_tokens))
        evicted: list[BlockHash] = []
        while len(self.blocks) > self.capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        if evicted:
            events.append(BlocksRemoved(evicted))
        self._emit(events)
        return hit

    def clear(self) -> None:
        self.blocks.clear()
        self._emit([AllCleared()])

    def _emit(self, events: list[KvEvent]) -> None:
        if events:
            for reader in self._readers:
                reader.put_nowait(events)

    def batches(self) -> AsyncIterator[list[KvEvent]]:
        # Registered now (not at the first iteration): nothing stored after this call is missed.
        queue: asyncio.Queue[list[KvEvent]] = asyncio.Queue()
        self._readers.append(queue)
        held: list[KvEvent] = [
            BlocksStored([h], parent, tokens) for h, (parent, tokens) in self.blocks.items()
        ]
        return self._read(queue, held)

    async def _read(
        self, queue: asyncio.Queue[list[KvEvent]], held: list[KvEvent]
    ) -> AsyncIterator[list[KvEvent]]:
        try:
            if held:  # what a late reader missed, as vLLM's replay buffer gives it
                yield held
            while True:
                yield await queue.get()
        finally:
            self._readers.remove(queue)


class PacedFakeEngine:
    def __init__(self, step_s: float = 0.05, cache: FakePrefixCache | None = None) -> None:
        self.step_s = step_s
        self.cache = cache
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
        if self.cache is not None:
            self.cache.admit(request.token_ids)
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

    def kv_events(self) -> FakePrefixCache | None:
        return self.cache

    def load(self) -> EngineLoad | None:
        usage = len(self.cache.blocks) / self.cache.capacity if self.cache else 0.0
        return EngineLoad(self.running, 0, usage)

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

    def kv_events(self) -> None:
        return None

    def load(self) -> None:
        return None

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

    def kv_events(self) -> None:
        return None

    def load(self) -> None:
        return None

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
