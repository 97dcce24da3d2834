"""Rules a decoded request must meet against the running engine's and the operator's limits.

Type and sign rules are already enforced by the msgspec decoder (messages/request.py); these need
the engine. The worker applies them when a request arrives (before admission), so a bad request
never costs engine time or a concurrency slot. Each violation raises InvalidRequest naming the
field and the rule.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from messages.embeddings import EmbedRequest
from messages.request import (
    GUIDED_DECODING_BACKENDS,
    GUIDED_DECODING_CONSTRAINTS,
    GenerateRequest,
    GuidedDecoding,
)
from worker.engine.contract import EngineLimits, InvalidRequest


def _check_vocab(
    field: str, token_ids: Iterable[int], vocab_size: int, *, indexed: bool = True
) -> None:
    """Every id below `vocab_size`; the error names the field and, for a list (`indexed`), the
    position (a map's keys have none)."""
    for position, token_id in enumerate(token_ids):
        if token_id >= vocab_size:
            raise InvalidRequest(
                f"{field}[{position}]" if indexed else field,
                f"token id {token_id} is outside the vocabulary (must be < {vocab_size})",
            )


def max_new_tokens(request: GenerateRequest, limits: EngineLimits) -> int:
    """The request's max_tokens, or what the context has room for (within the operator's cap)."""
    room = limits.max_model_len - len(request.token_ids)
    if limits.max_tokens_limit is not None and request.stop_conditions.max_tokens is None:
        room = min(room, limits.max_tokens_limit)
    return request.stop_conditions.max_tokens or room


def admit(request: GenerateRequest, limits: EngineLimits) -> GenerateRequest:
    """Checks the request and fills in its effective max_tokens (so the engine never needs the
    operator's limits). Raises InvalidRequest."""
    check_request(request, limits)
    request.stop_conditions.max_tokens = max_new_tokens(request, limits)
    return request


def check_request(request: GenerateRequest, limits: EngineLimits) -> None:
    sampling = request.sampling_options
    stop = request.stop_conditions
    output = request.output_options

    if request.continued_tokens is not None and request.continued_tokens >= len(request.token_ids):
        raise InvalidRequest(
            "continued_tokens",
            f"must be < the number of token_ids ({len(request.token_ids)}), "
            f"got {request.continued_tokens}",
        )
    if sampling.n > limits.max_n:
        raise InvalidRequest("sampling_options.n", f"must be <= {limits.max_n}, got {sampling.n}")
    if sampling.use_beam_search:
        raise InvalidRequest("sampling_options.use_beam_search", "beam search is not supported")
    if sampling.guided_decoding is not None:
        check_guided_decoding(sampling.guided_decoding)
    for field, k in (
        ("output_options.logprobs", output.logprobs),
        ("output_options.prompt_logprobs", output.prompt_logprobs),
    ):
        if k is not None and k > limits.max_logprobs:
            raise InvalidRequest(
                field, f"must be <= {limits.max_logprobs} (the engine's max_logprobs), got {k}"
            )

    _check_vocab("token_ids", request.token_ids, limits.vocab_size)
    _check_vocab("eos_token_ids", request.eos_token_ids, limits.vocab_size)
    _check_vocab("stop_conditions.stop_token_ids", stop.stop_token_ids or (), limits.vocab_size)
    _check_vocab(
        "stop_conditions.stop_token_ids_hidden", stop.stop_token_ids_hidden or (), limits.vocab_size
    )

    _check_vocab(
        "sampling_options.logit_bias",
        sorted(sampling.logit_bias or ()),
        limits.vocab_size,
        indexed=False,
    )

    prompt_len = len(request.token_ids)
    if prompt_len >= limits.max_model_len:
        raise InvalidRequest(
            "token_ids",
            f"prompt of {prompt_len} tokens leaves no room to generate: "
            f"must be < max_model_len {limits.max_model_len}",
        )
    if stop.max_tokens is not None and prompt_len + stop.max_tokens > limits.max_model_len:
        raise InvalidRequest(
            "stop_conditions.max_tokens",
            f"prompt ({prompt_len}) + max_tokens ({stop.max_tokens}) must be <= "
            f"max_model_len {limits.max_model_len}",
        )
    cap = limits.max_tokens_limit
    if cap is not None and max_new_tokens(request, limits) > cap:
        raise InvalidRequest(
            "stop_conditions.max_tokens",
            f"must be <= {cap} (the worker's max_tokens limit), got {stop.max_tokens}",
        )
    if stop.min_tokens is not None and stop.min_tokens > max_new_tokens(request, limits):
        raise InvalidRequest(
            "stop_conditions.min_tokens",
            f"must be <= max_tokens ({max_new_tokens(request, limits)}), got {stop.min_tokens}",
        )


GUIDED = "sampling_options.guided_decoding"


# The most inputs one embedding request may carry: one engine request each, all admitted at once
# under the request's one concurrency slot (vLLM's server takes any number; a long list here
# is split by the frontend or the caller).
MAX_EMBED_INPUTS = 2048


def check_embed(request: EmbedRequest, limits: EngineLimits) -> None:
    """The rules of an embedding request against the engine: a pooling model, inputs within
    the vocabulary and the context, `dimensions` only for a Matryoshka model."""
    if limits.kind != "embed":
        raise InvalidRequest("request", f"this worker serves {limits.kind} requests, not embed")
    if len(request.inputs) > MAX_EMBED_INPUTS:
        raise InvalidRequest("inputs", f"at most {MAX_EMBED_INPUTS} inputs per request")
    for index, tokens in enumerate(request.inputs):
        if len(tokens) > limits.max_model_len:
            raise InvalidRequest(
                f"inputs[{index}]",
                f"{len(tokens)} tokens exceed the model's max_model_len {limits.max_model_len}",
            )
        _check_vocab(f"inputs[{index}]", tokens, limits.vocab_size)
    if request.dimensions is not None and not limits.matryoshka:
        raise InvalidRequest(
            "dimensions",
            f"model {limits.model} does not support Matryoshka embeddings: leave it out",
        )


def _json_object(field: str, value: dict[str, object] | str, what: str) -> None:
    """`value` is a JSON object, or a string holding one (what vLLM's backends parse)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as error:
            raise InvalidRequest(
                field, f"a string must hold {what} (a JSON object): {error}"
            ) from error
        if not isinstance(value, dict):
            raise InvalidRequest(
                field, f"a string must hold {what} (a JSON object), got {type(value).__name__}"
            )
        return
    try:  # msgpack can carry what JSON cannot (bytes, NaN, extension types)
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidRequest(field, f"must be {what} in plain JSON: {error}") from error


def check_guided_decoding(guided: GuidedDecoding) -> None:
    """The rules of a guided_decoding that need no engine: exactly one constraint, each of its
    kind; what the backend cannot compile is the engine's to refuse (worker/engine)."""
    constraints = guided.constraints()
    if not constraints:
        raise InvalidRequest(
            GUIDED, f"sets no constraint: set one of {', '.join(GUIDED_DECODING_CONSTRAINTS)}"
        )
    if len(constraints) > 1:
        raise InvalidRequest(
            GUIDED,
            f"sets {' and '.join(constraints)}: only one constraint may be set "
            "(backend and whitespace_pattern may accompany it)",
        )
    if guided.json is not None:
        _json_object(f"{GUIDED}.json", guided.json, "a JSON schema")
    if guided.choice is not None and not guided.choice:
        raise InvalidRequest(f"{GUIDED}.choice", "must not be empty")
    if guided.grammar is not None and not guided.grammar.strip():
        raise InvalidRequest(f"{GUIDED}.grammar", "must not be empty")
    if guided.json_object is False:
        raise InvalidRequest(
            f"{GUIDED}.json_object", "must be true when set (leave it out for no constraint)"
        )
    if guided.structural_tag is not None:
        _json_object(f"{GUIDED}.structural_tag", guided.structural_tag, "a structural tag")
    if guided.backend is not None and guided.backend not in GUIDED_DECODING_BACKENDS:
        raise InvalidRequest(
            f"{GUIDED}.backend",
            f"must be one of vLLM's structured-output backends "
            f"({', '.join(GUIDED_DECODING_BACKENDS)}), got {guided.backend!r}",
        )
