"""vLLM's refusals of a request → InvalidRequest naming the wire field (vLLM 0.24 and 0.32)."""

from __future__ import annotations

from worker.engine.contract import InvalidRequest
from worker.errors import describe

try:  # vLLM >= 0.11 raises its own validation error type, which is not a ValueError.
    from vllm.exceptions import VLLMValidationError as _VllmValidationError
except ImportError:  # pragma: no cover - older vLLM
    _VllmValidationError = ValueError
try:  # the base of every "the request is at fault" error, where vLLM has one
    from vllm.exceptions import VLLMClientError as _VllmClientError
except ImportError:  # pragma: no cover - older vLLM
    _VllmClientError = _VllmValidationError

# What vLLM raises for a request it refuses as invalid, before its first output: its own client
# errors, and (older vLLM, or input processing) a plain ValueError. The newest vLLM wraps the
# latter in a bare EngineGenerateError, so the cause is looked at too.
INPUT_ERRORS = (ValueError, _VllmValidationError, _VllmClientError)
# vLLM parameter name → the request field a client set, so engine-side errors name our field.
FIELD_OF_PARAMETER = {
    "n": "sampling_options.n",
    "temperature": "sampling_options.temperature",
    "top_p": "sampling_options.top_p",
    "top_k": "sampling_options.top_k",
    "min_p": "sampling_options.min_p",
    "seed": "sampling_options.seed",
    "presence_penalty": "sampling_options.presence_penalty",
    "frequency_penalty": "sampling_options.frequency_penalty",
    "repetition_penalty": "sampling_options.repetition_penalty",
    "max_tokens": "stop_conditions.max_tokens",
    "min_tokens": "stop_conditions.min_tokens",
    "stop_token_ids": "stop_conditions.stop_token_ids",
    "stop": "stop_conditions.stop",
    "logprobs": "output_options.logprobs",
    "prompt_logprobs": "output_options.prompt_logprobs",
    "input_tokens": "token_ids",
    "dimensions": "dimensions",
}


def invalid(error: BaseException, default_field: str) -> InvalidRequest:
    """The InvalidRequest for a vLLM input error, naming the field vLLM's `parameter` maps to."""
    parameter = getattr(error, "parameter", None)
    field = FIELD_OF_PARAMETER.get(parameter or "", default_field)
    return InvalidRequest(field, str(error) or describe(error))


def input_error(error: BaseException) -> BaseException | None:
    """The vLLM input-validation error behind `error` (itself or its cause), if it is one."""
    for candidate in (error, error.__cause__):
        if isinstance(candidate, INPUT_ERRORS):
            return candidate
    return None
