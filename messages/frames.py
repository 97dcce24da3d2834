"""Response frames: what the worker publishes to a request's reply subject.

Frames are maps (msgspec Structs, not array_like) so that readers in other languages can address
fields by name. Optional fields that were not asked for are absent from the map (`UNSET`), while
`finish_reason` is always present: nil until the last frame of a choice.

Per-position invariant (the reason the lists exist side by side): in every frame,
`len(log_probs) == len(top_logprobs) == len(token_ids)` when logprobs were asked for, entry i
describing token_ids[i]; the same holds for the `prompt_*` lists, entry i describing prompt
position `prompt_position + i`. Consumers zip by position.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec
from msgspec import UNSET, UnsetType

from messages.errors import ErrorCode

# The field `TopLogprob.bytes` shadows the builtin inside the class body: annotate via an alias.
RawBytes = bytes

FinishReason = Literal["eos", "length", "stop", "cancelled", "error"]
FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)


# gc=False: rows are the most numerous objects on the hot path and hold only scalars, so they
# can never be part of a reference cycle; untracked, they cost less to make and to collect.
class TopLogprob(msgspec.Struct, frozen=True, gc=False):
    """One candidate at one position. `rank` is 1-based as in vLLM (1 = most likely).

    `bytes` are the token's true bytes (a byte-fallback token carries its real byte); `token` is
    their UTF-8 text, or the vocabulary piece (e.g. "<0xE2>") when they are not valid UTF-8 alone.
    """

    rank: int
    token_id: int
    token: str
    # float64 in msgpack; in JSON a non-finite value (e.g. -inf) is written as null.
    logprob: float | None
    bytes: RawBytes


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorInfo(msgspec.Struct, frozen=True):
    code: ErrorCode
    message: str


class ResponseFrame(msgspec.Struct, kw_only=True):
    request_id: str
    seq: int
    index: int = 0
    # JetStream mode only: the request's delivery attempt (1, 2, …). Frames of a new attempt
    # restart at seq 0 and replace the partial output of the attempt before.
    attempt: int | UnsetType = UNSET
    token_ids: list[int] = msgspec.field(default_factory=list)
    # Floats; None only where JSON had to write a non-finite value as null (see messages.codec).
    log_probs: list[float | None] | UnsetType = UNSET
    top_logprobs: list[list[TopLogprob]] | UnsetType = UNSET
    # Prompt logprobs, streamed before the first generated token; entry 0 of the prompt is nil
    # (nothing precedes the first token).
    prompt_position: int | UnsetType = UNSET
    prompt_log_probs: list[float | None] | UnsetType = UNSET
    prompt_top_logprobs: list[list[TopLogprob] | None] | UnsetType = UNSET
    finish_reason: FinishReason | None = None
    # With finish_reason "stop" only: the stop string the text matched, or the stop token id the
    # choice ended on (as vLLM's `stop_reason`). Absent for "eos" and every other reason.
    stop_reason: str | int | UnsetType = UNSET
    completion_usage: Usage | UnsetType = UNSET
    error: ErrorInfo | UnsetType = UNSET
