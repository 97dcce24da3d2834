"""Error codes and what each one means, decided here once for every party.

A worker ends a failed request with one error frame carrying one of these codes; the client
library, the HTTP frontend and the JetStream intake all look the code up here instead of keeping
lists of their own:
- `retryable`: another worker (or a later JetStream attempt) may succeed; the request itself is
  fine. A work queue NAKs a retryable failure while attempts are left and TERMs everything else
  (`disposition`).
- `refusal`: the worker refused the request before running it (nothing was generated), so a
  client may resend it elsewhere at once without losing output.
- `http_status` / `openai_type`: what the OpenAI-compatible frontend answers.
- `meaning`: the message used when a failure has no text of its own (a frame's message is never
  empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

ErrorCode = Literal[
    "invalid_request",
    "engine_error",
    "overloaded",
    "worker_shutdown",
    "internal_error",
    "deadline_exceeded",
    "client_gone",
    "no_workers",
    "worker_lost",
    "model_not_found",
]
ERROR_CODES: tuple[str, ...] = get_args(ErrorCode)


@dataclass(frozen=True)
class ErrorKind:
    retryable: bool
    refusal: bool
    http_status: int
    openai_type: str
    meaning: str


ERRORS: dict[str, ErrorKind] = {
    "invalid_request": ErrorKind(
        False, False, 400, "invalid_request_error", "the request breaks a rule"
    ),
    "engine_error": ErrorKind(True, False, 500, "internal_error", "the engine failed the request"),
    "overloaded": ErrorKind(
        True, True, 503, "service_unavailable", "the worker is at its concurrency limit"
    ),
    "worker_shutdown": ErrorKind(
        True, True, 503, "service_unavailable", "the worker is shutting down"
    ),
    "internal_error": ErrorKind(True, False, 500, "internal_error", "the worker failed"),
    "deadline_exceeded": ErrorKind(False, False, 504, "timeout", "the request's deadline passed"),
    "client_gone": ErrorKind(False, False, 499, "client_gone", "nobody listens for the answer"),
    # Never in a frame: NATS answered the request itself with "no responders" (a status-503
    # message) because nothing subscribes to its subject. A refusal: nothing ran, and a worker
    # that comes up (or the right subject) can serve it.
    "no_workers": ErrorKind(True, True, 503, "service_unavailable", "no worker serves the subject"),
    # Never in a frame: the client heard nothing from the worker serving its request (no frame,
    # no heartbeat) for its silence timeout, and could not continue the request on another
    # worker (migration off, its limit reached, or a request it cannot continue).
    "worker_lost": ErrorKind(
        True, False, 503, "service_unavailable", "the worker serving the request went silent"
    ),
    # The request's `model` names neither the worker's model nor an adapter it holds. Another
    # worker may hold the adapter (a router's picture is a moment old): retryable there, and
    # nothing ran. vLLM's server answers an unknown model 404 NotFoundError.
    "model_not_found": ErrorKind(
        True, True, 404, "NotFoundError", "no such model or adapter on this worker"
    ),
}
_UNKNOWN = ErrorKind(False, False, 500, "internal_error", "unknown error")


def kind(code: str) -> ErrorKind:
    """The properties of `code`; an unknown code (a newer worker's) is final and a 500."""
    return ERRORS.get(code, _UNKNOWN)


def is_retryable(code: str) -> bool:
    return kind(code).retryable


def is_refusal(code: str) -> bool:
    return kind(code).refusal


Disposition = Literal["ack", "nak", "term"]


def disposition(code: str | None, *, attempts_left: bool) -> Disposition:
    """What a work queue (JetStream) does with a request that ended with `code` (None: it was
    answered in full): redeliver a retryable failure while attempts are left, else settle."""
    if code is None:
        return "ack"
    if kind(code).retryable and attempts_left:
        return "nak"
    return "term"
