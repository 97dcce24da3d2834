"""Wire contract of the vLLM NATS worker: request and frame structs, codecs, subject names.

This package imports msgspec and nothing else, so a publisher in any environment can use it
without vllm or torch.
"""

from messages.codec import JSON_CONTENT_TYPE, MSGPACK_CONTENT_TYPE, Codec, codec_for
from messages.errors import ERRORS, ErrorCode, ErrorKind, is_refusal, is_retryable
from messages.frames import (
    FINISH_REASONS,
    ErrorInfo,
    FinishReason,
    ResponseFrame,
    TopLogprob,
    Usage,
)
from messages.request import (
    CancelRequest,
    GenerateRequest,
    GuidedDecoding,
    OutputOptions,
    SamplingOptions,
    StopConditions,
)
from messages.subjects import Subjects

__all__ = [
    "ERRORS",
    "FINISH_REASONS",
    "JSON_CONTENT_TYPE",
    "MSGPACK_CONTENT_TYPE",
    "CancelRequest",
    "Codec",
    "ErrorCode",
    "ErrorInfo",
    "ErrorKind",
    "FinishReason",
    "GenerateRequest",
    "GuidedDecoding",
    "OutputOptions",
    "ResponseFrame",
    "SamplingOptions",
    "StopConditions",
    "Subjects",
    "TopLogprob",
    "Usage",
    "codec_for",
    "is_refusal",
    "is_retryable",
]
