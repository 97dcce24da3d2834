"""The generation request, field for field as Dynamo's `PreprocessedRequest` names them.

Decoding is strict on known fields (no str→int coercion, bools are not ints) and ignores unknown
fields, since frontends add routing fields of their own. Rules that need no engine (signs, empty
lists) live here as msgspec constraints, so a decode error already names the field and the rule;
rules that depend on the engine (max_logprobs, vocabulary size, max_model_len) are checked by the
worker against the running engine.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

TokenId = Annotated[int, msgspec.Meta(ge=0)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0)]


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample; None means the engine's default."""

    n: PositiveInt = 1
    temperature: NonNegativeFloat | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    # -1 and 0 both mean "no top-k", as in vLLM.
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    # Known to Dynamo's frontends but not served here: refused with a clear error, never ignored.
    use_beam_search: bool | None = None
    guided_decoding: msgspec.Raw | None = None


class StopConditions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """When to stop. `max_tokens` None means: up to the model's context length."""

    max_tokens: PositiveInt | None = None
    min_tokens: NonNegativeInt | None = None
    stop_token_ids: list[TokenId] | None = None
    # Dynamo's frontends send their stop tokens under this name; merged with stop_token_ids.
    stop_token_ids_hidden: list[TokenId] | None = None
    ignore_eos: bool | None = None
    # Stop strings need detokenization, which this worker leaves to the frontend: refused if set.
    stop: list[str] | None = None


class OutputOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What to return besides token ids.

    `logprobs = k`: one `log_probs` entry and one `top_logprobs` row (top k plus the sampled
    token) per generated token. `prompt_logprobs = k`: the same for every prompt position.
    """

    logprobs: NonNegativeInt | None = None
    prompt_logprobs: NonNegativeInt | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stop_conditions: StopConditions = msgspec.field(default_factory=StopConditions)
    output_options: OutputOptions = msgspec.field(default_factory=OutputOptions)
    # Extra end-of-sequence ids (besides the model's own); hitting one ends with "eos".
    eos_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    annotations: list[str] = msgspec.field(default_factory=list)
    # Relative, from the worker's receipt (no clock skew between hosts): past it the request is
    # aborted and each open choice ends with finish_reason "cancelled", error code
    # "deadline_exceeded".
    timeout_ms: PositiveInt | None = None


class CancelRequest(msgspec.Struct, kw_only=True):
    """Published on `Subjects.cancel` (every worker listens, no queue group)."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
