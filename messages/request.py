"""The generation request, field for field as Dynamo's `PreprocessedRequest` names them.

Decoding is strict on known fields (no str→int coercion, bools are not ints) and ignores unknown
fields, since frontends add routing fields of their own. Rules that need no engine (signs, empty
lists) live here as msgspec constraints, so a decode error already names the field and the rule;
rules that depend on the engine (max_logprobs, vocabulary size, max_model_len) are checked by the
worker against the running engine.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import msgspec

# Integers the engine stores in fixed-width tensors or sends over its own msgpack transport are
# bounded here, at decode time: a JSON integer past 64 bits would otherwise pass and fail deep in
# vLLM as an empty, retryable engine error. Counts and ids that the running engine bounds more
# tightly (vocabulary, context length, max_logprobs, the operator's max_n) are checked against
# it on admission (worker/validation.py); the caps here only keep them in machine range.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=INT32_MAX)]
# Finite: msgpack can carry inf and NaN, which no sampling parameter means (NaN fails ge anyway).
FLOAT_MAX = sys.float_info.max
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0.0, le=FLOAT_MAX)]
# vLLM refuses an empty stop string ("stop cannot contain an empty string").
StopString = Annotated[str, msgspec.Meta(min_length=1)]
# OpenAI's range for a logit bias; vLLM's OpenAI server clamps to it, the wire refuses beyond it
# (a frontend that takes vLLM's requests clamps first: worker/frontend/schemas.py).
LOGIT_BIAS_MAX = 100.0
LogitBias = Annotated[float, msgspec.Meta(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]


# The structured-output backends vLLM knows (its StructuredOutputsConfig.backend), for
# `GuidedDecoding.backend`.
GUIDED_DECODING_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
# The fields of GuidedDecoding that are a constraint; exactly one must be set.
GUIDED_DECODING_CONSTRAINTS = (
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "structural_tag",
)


class GuidedDecoding(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Structured outputs, as Dynamo's `GuidedDecodingOptions` names them (plus vLLM's
    `json_object`); run with vLLM's own StructuredOutputsParams.

    Exactly one constraint: `json`, `regex`, `choice`, `grammar`, `json_object` or
    `structural_tag`; `backend` and `whitespace_pattern` are modifiers that may accompany it. The
    rules that need no engine are checked on arrival (worker/validation.py); what the backend
    cannot compile is refused by the engine adapter, naming this field.
    """

    # A JSON schema: an object, or a string holding one. `{}` (the schema that allows anything)
    # asks for any JSON value.
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], msgspec.Meta(min_length=1)] | None = None
    # EBNF (GBNF) or Lark, as vLLM's backends take it.
    grammar: str | None = None
    # vLLM's `json_object` (OpenAI's response_format json_object): any JSON object. Only `true`.
    json_object: bool | None = None
    # xgrammar's structural tag: an object, or a string holding one (newer Dynamo sends either).
    structural_tag: dict[str, Any] | str | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None

    def constraints(self) -> list[str]:
        """The names of the constraints that are set, in GUIDED_DECODING_CONSTRAINTS' order."""
        return [name for name in GUIDED_DECODING_CONSTRAINTS if getattr(self, name) is not None]


class SamplingOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample; None means the engine's default."""

    n: PositiveInt = 1
    temperature: NonNegativeFloat | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    # -1 and 0 both mean "no top-k", as in vLLM; vLLM keeps top_k in an int32 tensor (values
    # past the vocabulary mean no top-k too).
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    # vLLM seeds a torch.Generator (int64), as its OpenAI server bounds `seed`.
    seed: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0, le=FLOAT_MAX)] | None = None
    # Token id → a bias added to that token's logit before sampling (vLLM's logit_bias). In
    # JSON the keys are strings of the ids (`{"42": 5.0}`), in msgpack integers; the ids are
    # checked against the vocabulary on arrival.
    logit_bias: dict[TokenId, LogitBias] | None = None
    # Known to Dynamo's frontends but not served here: refused with a clear error, never ignored.
    use_beam_search: bool | None = None
    # Structured outputs (vLLM's StructuredOutputsParams), Dynamo's field name.
    guided_decoding: GuidedDecoding | None = None


class StopConditions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """When to stop. `max_tokens` None means: up to the model's context length."""

    max_tokens: PositiveInt | None = None
    min_tokens: NonNegativeInt | None = None
    stop_token_ids: list[TokenId] | None = None
    # Dynamo's frontends send their stop tokens under this name; merged with stop_token_ids.
    stop_token_ids_hidden: list[TokenId] | None = None
    ignore_eos: bool | None = None
    # Stop strings, matched by vLLM on its own detokenized text (as `vllm serve`): the choice
    # ends at the token that completes the first match, finish_reason "stop", its final frame's
    # `stop_reason` the matched string. The tokens (and logprobs) sent include that token; where
    # the text is cut is the frontend's business (without the string unless
    # include_stop_str_in_output).
    stop: list[StopString] | None = None
    include_stop_str_in_output: bool | None = None


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
    # The model to run, as Dynamo's PreprocessedRequest names it: the worker's served model name
    # or one of its LoRA adapters (loaded by --lora-modules or at run time). None or the served
    # name: the base model. Any other name is refused with `model_not_found`, never answered by
    # the base model.
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    sampling_options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    stop_conditions: StopConditions = msgspec.field(default_factory=StopConditions)
    output_options: OutputOptions = msgspec.field(default_factory=OutputOptions)
    # Extra end-of-sequence ids (besides the model's own); hitting one ends with "eos".
    eos_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    annotations: list[str] = msgspec.field(default_factory=list)
    # Relative, from the worker's receipt (no clock skew between hosts): past it the request is
    # aborted and each open choice ends with finish_reason "cancelled", error code
    # "deadline_exceeded". At most INT32_MAX ms (~24.8 days).
    timeout_ms: PositiveInt | None = None
    # A continuation (worker.client's migration): how many tokens at the end of `token_ids` are
    # this request's own earlier output, so that a stop string straddling the seam still ends
    # it (vLLM matches stop strings on its output text only). Must be < len(token_ids).
    continued_tokens: NonNegativeInt | None = None


class CancelRequest(msgspec.Struct, kw_only=True):
    """Published on `Subjects.cancel` (every worker listens, no queue group).

    A cancel reaches only the request(s) with this request_id whose reply subject is
    `reply_subject`: request ids are chosen by publishers and may collide (two publishers, a
    retry), while the reply subject is the publisher's own inbox, which nobody else knows.
    """

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    reply_subject: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
