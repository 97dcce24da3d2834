"""The engine contract the request lifecycle is written against (no vllm import here).

`worker/engine/vllm_adapter.py` implements it over vLLM's AsyncLLM; transport-level tests and
benchmarks may implement it with a clearly named fake (worker/dev/fakes.py). Everything the session
needs from an engine is here: its limits, a stream of steps per request, and abort.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from messages.embeddings import EmbedRequest
from messages.errors import ErrorCode
from messages.frames import FinishReason, TopLogprob
from messages.kv import KvEvent
from messages.request import GenerateRequest
from worker.errors import WorkerError


class InvalidRequest(WorkerError, ValueError):
    """A request that breaks a rule; the message names the field and the rule."""

    code = "invalid_request"

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


class EngineFailure(WorkerError, RuntimeError):
    """The engine failed this request (it may still serve others)."""

    code = "engine_error"


class ModelNotFound(WorkerError, LookupError):
    """The request's `model` is neither the engine's model nor an adapter it holds."""

    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"model: The model `{model}` does not exist.")  # vLLM's words
        self.model = model


class AdminError(RuntimeError):
    """An admin command the engine refused or failed, with the error code that says which
    (`invalid_request`, `model_not_found`, `engine_error`) and vLLM's message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.error_code: ErrorCode = code


class EngineDead(WorkerError, RuntimeError):
    """The engine is gone: the worker must answer in-flight requests and exit non-zero."""

    code = "engine_error"


EngineKind = Literal["generate", "embed"]
"""What a worker's engine serves: generation (GenerateRequest) or embeddings (EmbedRequest, a
pooling model: vLLM's `--runner pooling`)."""


@dataclass(frozen=True)
class EngineLimits:
    """The running engine's real limits, which requests are validated against."""

    model: str
    max_logprobs: int
    vocab_size: int
    max_model_len: int
    max_n: int = 16
    max_tokens_limit: int | None = None
    """Operator cap on max_tokens, on top of the context length."""
    engine: str = ""
    """Engine name and version, e.g. "vllm 0.32.0"."""
    kind: EngineKind = "generate"
    tokenizer: str = ""
    """Where the model's tokenizer is (its path or hub name), for frontends that discover it."""
    matryoshka: bool = False
    """Embeddings only: whether a request may shorten the vectors (`dimensions`)."""


@dataclass(frozen=True)
class PromptRows:
    """Prompt logprobs for every prompt position; entry 0 is None (nothing precedes it)."""

    log_probs: list[float | None]
    top_logprobs: list[list[TopLogprob] | None]


@dataclass(frozen=True)
class ChoiceDelta:
    """New tokens of one choice since its previous delta, with rows aligned by position."""

    index: int
    token_ids: list[int]
    log_probs: list[float | None] | None
    top_logprobs: list[list[TopLogprob] | None] | None
    finish_reason: FinishReason | None
    # With finish_reason "stop": the matched stop string or stop token id (vLLM's stop_reason).
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class EngineStep:
    prompt: PromptRows | None
    choices: list[ChoiceDelta]


@dataclass(frozen=True)
class EngineLoad:
    """The engine scheduler's latest view (vLLM's SchedulerStats)."""

    running: int
    waiting: int
    kv_usage: float
    """Share of the KV cache in use, 0..1."""


class KvEventSource(Protocol):
    """The engine's prefix-cache events (worker/engine/kv_events.py), for KV-aware routing."""

    block_size: int

    def batches(self) -> AsyncIterator[list[KvEvent]]:
        """Each step's events, from the engine's start (as far as it still holds them) on."""
        ...


class EngineAdmin(Protocol):
    """What a fleet's control plane asks of an engine: vLLM's admin routes (LoRA adapters, the
    prefix cache, sleep). Each raises AdminError for what the engine refuses."""

    def adapters(self) -> dict[str, str]:
        """The adapters the engine holds: name → the path it was loaded from."""
        ...

    async def load_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    async def reset_prefix_cache(self) -> bool:
        """False when the engine could not (requests still hold cached blocks)."""
        ...

    async def sleep(self, level: int) -> None: ...

    async def wake_up(self, tags: list[str] | None) -> None: ...

    async def is_sleeping(self) -> bool: ...


class Embedder(Protocol):
    """A pooling model's embeddings (engines of kind "embed")."""

    async def embed(self, request: EmbedRequest, engine_request_id: str) -> list[bytes]:
        """One packed float32 vector per input, in input order (messages.embeddings.pack).
        Raises InvalidRequest for what the engine refuses, naming the field."""
        ...


class Engine(Protocol):
    limits: EngineLimits
    # None: the engine has no admin commands (the transport tests' fakes); the control plane
    # answers them with an error.
    admin: EngineAdmin | None
    # Set exactly when limits.kind is "embed".
    embedder: Embedder | None

    def generate(
        self, request: GenerateRequest, engine_request_id: str
    ) -> AsyncGenerator[EngineStep, None]:
        """Validates (raising InvalidRequest before any step) and streams the request's steps.

        Closing the iterator early aborts the request in the engine.
        """
        ...

    def num_unfinished_requests(self) -> int: ...

    async def check_health(self) -> None: ...

    def kv_events(self) -> KvEventSource | None:
        """A new reader of the engine's cache events; None when it publishes none."""
        ...

    def load(self) -> EngineLoad | None:
        """None when the engine does not report its scheduler's state."""
        ...

    def shutdown(self) -> None: ...
