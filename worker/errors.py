"""The worker's exceptions: each carries the wire error code (messages/errors.py) it ends a
request with, so the session maps any of them to a frame in one place."""

from __future__ import annotations

from typing import ClassVar

from messages.errors import ErrorCode


class WorkerError(Exception):
    """A failure of one request that the worker anticipated; `code` is what the client gets."""

    code: ClassVar[ErrorCode] = "internal_error"


def describe(error: BaseException) -> str:
    """`Type: message` of an error, never empty: an exception without text (vLLM's
    EngineGenerateError is raised bare) is described by its cause, or by its type alone."""
    text = str(error)
    cause = error.__cause__ or error.__context__
    if not text and cause is not None and cause is not error:
        return f"{type(error).__name__}: {describe(cause)}"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
