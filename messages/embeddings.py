"""The embedding request and its result, for workers of a pooling model (vLLM's `--runner
pooling` / `--convert embed`), which serve them on their own endpoint (`embed` by default).

Many inputs per request, each a list of token ids (the frontend tokenizes, as for generation).
The answer is one EmbedResult frame (more when it would pass the server's max_payload: each
carries the vectors of inputs `index`, `index + 1`, …, and only the last has `finish_reason`
"stop" and `usage`), or the error frame every request shares: `finish_reason` "error" and
`error` {code, message}, which decodes as an EmbedResult too. Frames are numbered by `seq`
and, in JetStream mode, carry the delivery `attempt`, as generation frames do.

Vectors are packed: little-endian float32, `dimensions` of them per input (`pack`/`unpack`).
"""

from __future__ import annotations

import array
import sys
from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

from messages.frames import ErrorInfo
from messages.request import PositiveInt, TokenId

# An input is never empty (vLLM refuses an empty prompt).
EmbedInput = Annotated[list[TokenId], msgspec.Meta(min_length=1)]


class EmbedRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    inputs: Annotated[list[EmbedInput], msgspec.Meta(min_length=1)]
    # The served model name (or absent), or a LoRA adapter the worker holds, as for generation.
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    # vLLM's pooling parameters, by their names: `dimensions` shortens the vectors of a
    # Matryoshka model (refused for any other), `use_activation` False skips the pooler's
    # normalization (None: the model's default, normalized).
    dimensions: PositiveInt | None = None
    use_activation: bool | None = None
    # Relative, from the worker's receipt; past it the request ends with `deadline_exceeded`.
    timeout_ms: PositiveInt | None = None
    annotations: list[str] = msgspec.field(default_factory=list)


class EmbedUsage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    total_tokens: int


class EmbedResult(msgspec.Struct, kw_only=True):
    request_id: str
    seq: int
    # The position in `inputs` of this frame's first vector.
    index: int = 0
    attempt: int | UnsetType = UNSET
    embeddings: list[bytes] = msgspec.field(default_factory=list)
    dimensions: int = 0
    finish_reason: Literal["stop", "error"] | None = None
    usage: EmbedUsage | UnsetType = UNSET
    error: ErrorInfo | UnsetType = UNSET


def pack(vector: list[float]) -> bytes:
    """Little-endian float32, as the wire carries a vector."""
    packed = array.array("f", vector)
    if sys.byteorder == "big":  # pragma: no cover - every host we run is little-endian
        packed.byteswap()
    return packed.tobytes()


def unpack(data: bytes) -> list[float]:
    """The floats of one packed vector."""
    if len(data) % 4:
        raise ValueError(f"a packed float32 vector has a length divisible by 4, not {len(data)}")
    values = array.array("f")
    values.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        values.byteswap()
    return values.tolist()
