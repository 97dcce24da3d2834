"""Fake engines, for transport-level tests and benchmarks only (never served by the CLI).

Each implements the engine contract (worker/engine/contract.py) without a model:
- `PacedFakeEngine` streams `max_tokens` tokens, one every `step_s`, with logprob rows when
  asked, so requests stay in flight for a known time: what liveness and outage tests and the
  probe-load benchmark need at a concurrency the real engine on a CPU cannot reach;
- `SyntheticFastEngine` emits fixed tokens and rows as fast as it can (the transport ceiling,
  bench/transport_ceiling.py);
- `AlwaysFailingFakeEngine` fails every request (retry and JetStream redelivery tests);
- `FakePrefixCache`: an LRU cache of prompt blocks with engine-like events (stored with parent
  hashes and token ids, removed, cleared), given to `PacedFakeEngine` so KV-aware routing is
  tested fast; the end-to-end tests read the real engine's events;
- `ScriptedFakeEngine` streams the steps a test wrote (prompt rows, stop reasons, a choice that
  ends in error, a stream cut short) and may then raise (an engine failure, a dead engine); it
  records each request and each stream closed before its end (an abort);
- `FakeEmbedder`: vectors that are a function of the input's tokens, after a wait, for the
  transport tests of embedding requests (`fake_embedding_engine`);
- `MemoryReply`: the service core's `Reply` (worker/service.py) in memory, so the request path
  (worker/service.py, worker/session.py) is unit-tested without a nats-server: it keeps every
  published frame, and a test declares its client gone or its frames undeliverable.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from messages.embeddings import EmbedRequest, pack
from messages.frames import FinishReason, TopLogprob
from messages.kv import AllCleared, BlockHash, BlocksRemoved, BlocksStored, KvEvent
from messages.request import GenerateRequest
from worker.engine.contract import (
    AdminError,
    ChoiceDelta,
    Embedder,
    EngineAdmin,
    EngineDead,
    EngineFailure,
    EngineLimits,
    EngineLoad,
    EngineStep,
    InvalidRequest,
)
from worker.framing import Undeliverable


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
    admin: EngineAdmin | None = None  # no admin commands (worker/nats/control.py)
    embedder: Embedder | None = None

    def __init__(
        self,
        step_s: float = 0.05,
        cache: FakePrefixCache | None = None,
        *,
        limits: EngineLimits | None = None,
        prefill_s: float = 0.0,
    ) -> None:
        """`limits`: what requests are validated against (default: a context of 2**20 tokens);
        e.g. the tiny model's, where a test checks the refusals the real engine's limits give.
        `prefill_s`: a wait before the first token (a long prompt, a queue).

        A token is a function of its position in the context (prompt included), as a greedy
        model's is of the context: a continuation whose prompt holds the tokens already
        generated goes on with the tokens the undisturbed request would have had."""
        self.step_s = step_s
        self.prefill_s = prefill_s
        self.cache = cache
        self.limits = limits or EngineLimits(
            model="paced-fake", max_logprobs=20, vocab_size=1024, max_model_len=1 << 20
        )
        self.running = 0
        self.requests = 0
        """Requests started so far."""

    async def generate(
        self, request: GenerateRequest, engine_request_id: str
    ) -> AsyncGenerator[EngineStep, None]:
        k = request.output_options.logprobs
        total = request.stop_conditions.max_tokens or 16
        n = request.sampling_options.n
        if self.cache is not None:
            self.cache.admit(request.token_ids)
        self.running += 1
        self.requests += 1
        try:
            await asyncio.sleep(self.prefill_s)
            for i in range(total):
                await asyncio.sleep(self.step_s)
                token = 100 + (len(request.token_ids) + i) % 50
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

    admin: EngineAdmin | None = None  # no admin commands (worker/nats/control.py)
    embedder: Embedder | None = None

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

    admin: EngineAdmin | None = None  # no admin commands (worker/nats/control.py)
    embedder: Embedder | None = None

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


class FakeAdmin:
    """Admin commands of a fake engine (tests only): adapters in a dict, a sleep flag, and
    vLLM's server's refusals for a second load of a name and an unknown name."""

    def __init__(self, base: str = "scripted-fake") -> None:
        self.base = base
        self.loaded: dict[str, str] = {}
        self.sleeping = False
        self.resets = 0

    def adapters(self) -> dict[str, str]:
        return dict(self.loaded)

    async def load_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None:
        if name == self.base:
            raise AdminError(
                "invalid_request", f"The lora adapter '{name}' conflicts with a served base model."
            )
        if name in self.loaded and not load_inplace:
            raise AdminError(
                "invalid_request", f"The lora adapter '{name}' has already been loaded."
            )
        self.loaded[name] = path

    async def unload_adapter(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise AdminError("model_not_found", f"The lora adapter '{name}' cannot be found.")

    async def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    async def sleep(self, level: int) -> None:
        self.sleeping = True

    async def wake_up(self, tags: list[str] | None) -> None:
        self.sleeping = False

    async def is_sleeping(self) -> bool:
        return self.sleeping


class ScriptedFakeEngine:
    """A fake engine (tests only) that streams the same written steps for every request, one
    every `step_s`, then raises `then_raise` if given (e.g. EngineFailure, EngineDead) or ends.

    It records what the service handed it (`requests`: the request and its engine request id)
    and how many streams were closed before their end (`closed_early`: the session aborted the
    engine request). `dead`, when set, is what `check_health` raises.
    """

    admin: EngineAdmin | None = None  # no admin commands (worker/nats/control.py)
    embedder: Embedder | None = None

    def __init__(
        self,
        steps: Sequence[EngineStep] = (),
        *,
        limits: EngineLimits | None = None,
        step_s: float = 0.0,
        then_raise: BaseException | None = None,
    ) -> None:
        self.steps = list(steps)
        self.limits = limits or EngineLimits(
            model="scripted-fake", max_logprobs=20, vocab_size=1024, max_model_len=512
        )
        self.step_s = step_s
        self.then_raise = then_raise
        self.requests: list[tuple[GenerateRequest, str]] = []
        self.closed_early = 0
        self.running = 0
        self.dead: EngineDead | None = None

    async def generate(
        self, request: GenerateRequest, engine_request_id: str
    ) -> AsyncGenerator[EngineStep, None]:
        self.requests.append((request, engine_request_id))
        self.running += 1
        try:
            for step in self.steps:
                await asyncio.sleep(self.step_s)
                yield step
            if self.then_raise is not None:
                raise self.then_raise
        except (GeneratorExit, asyncio.CancelledError):
            self.closed_early += 1  # closed at a step (aclose) or cancelled between steps
            raise
        finally:
            self.running -= 1

    def num_unfinished_requests(self) -> int:
        return self.running

    def kv_events(self) -> None:
        return None

    def load(self) -> EngineLoad:
        return EngineLoad(self.running, 0, 0.0)

    async def check_health(self) -> None:
        if self.dead is not None:
            raise self.dead

    def shutdown(self) -> None:
        return None


class FakeEmbedder:
    """Embeddings without a model (transport tests only): input i's vector is
    `[len(tokens), first token, last token, 0, …]`, `dimensions` long (shortened when a request
    asks), after `delay_s`. It counts the inputs it embedded."""

    def __init__(self, dimensions: int = 8, delay_s: float = 0.0) -> None:
        self.dimensions = dimensions
        self.delay_s = delay_s
        self.embedded = 0

    async def embed(self, request: EmbedRequest, engine_request_id: str) -> list[bytes]:
        size = request.dimensions or self.dimensions
        if size > self.dimensions:
            raise InvalidRequest("dimensions", f"must be <= {self.dimensions}")
        await asyncio.sleep(self.delay_s)
        self.embedded += len(request.inputs)
        vectors = []
        for tokens in request.inputs:
            values = [float(len(tokens)), float(tokens[0]), float(tokens[-1])]
            values += [0.0] * self.dimensions
            vectors.append(pack(values[:size]))
        return vectors


def fake_embedding_engine(
    embedder: FakeEmbedder | None = None, max_model_len: int = 512
) -> PacedFakeEngine:
    """A PacedFakeEngine of kind "embed" with a FakeEmbedder (transport tests only)."""
    engine = PacedFakeEngine(
        limits=EngineLimits(
            model="fake-embed",
            max_logprobs=0,
            vocab_size=1024,
            max_model_len=max_model_len,
            kind="embed",
            matryoshka=True,
        )
    )
    engine.embedder = embedder or FakeEmbedder()
    return engine


class MemoryReply:
    """A request's reply subject in memory: the service core's `Reply` (worker/service.py) for
    unit tests of the request path, where worker/nats/liveness.py's `NatsReply` needs a server.

    `published` holds every frame as encoded bytes, in order. `go_away()` is what the liveness
    prober does when the client is found gone: the watcher's `on_gone` runs once (not after
    `release`). Publishing fails with `Undeliverable` after `undeliverable_after` frames (None:
    never), as a publish fails when the broker stays unreachable.
    """

    def __init__(
        self, subject: str = "_INBOX.memory.1", *, undeliverable_after: int | None = None
    ) -> None:
        self.subject = subject
        self.undeliverable_after = undeliverable_after
        self.published: list[bytes] = []
        self.on_gone: Callable[[], None] | None = None
        self.released = False
        self._gone_called = False
        self._arrived = asyncio.Event()

    async def publish(self, data: bytes) -> None:
        limit = self.undeliverable_after
        if limit is not None and len(self.published) >= limit:
            raise Undeliverable(f"nobody listens on {self.subject}")
        self.published.append(data)
        self._arrived.set()

    def watch(self, on_gone: Callable[[], None]) -> None:
        self.on_gone = on_gone

    def release(self) -> None:
        self.released = True

    def go_away(self) -> None:
        """The client is gone: calls `on_gone` once, if the request is still watched."""
        if self.on_gone is not None and not self.released and not self._gone_called:
            self._gone_called = True
            self.on_gone()

    async def wait_for_frames(self, count: int, timeout: float = 5.0) -> None:
        """Returns once at least `count` frames were published; TimeoutError after `timeout`."""

        async def enough() -> None:
            while len(self.published) < count:
                self._arrived.clear()
                await self._arrived.wait()

        await asyncio.wait_for(enough(), timeout)
