"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and the HTTP status of
each way a request fails: a broken field rule is a 400 naming the field in `param`; a worker's
error code has the status and type messages.errors gives it; a NATS timeout is a 504, frames
lost in transit a 502, NATS itself a 503; anything else a 500 (and logged)."""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import nats.errors

from messages.errors import kind
from worker.client import FrameOrderError, RequestError
from worker.frontend.schemas import UNION_SHAPES, InvalidField
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)

INVALID = "invalid_request_error"

# Union members add their type name to a field's path (`prompt.str`, `prompt.list[int]`): not
# part of the field.
_UNION_TAGS = ("str", "int", "function-after")


class OpenAIError(Exception):
    """A request's failure as OpenAI words it: the HTTP status and the error body's fields."""

    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: Any = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_worker(cls, code: str, message: str) -> OpenAIError:
        """A worker's error frame (or a refusal the client library raised)."""
        error = kind(code)
        return cls(error.http_status, message, error.openai_type, code=code)


def invalid(param: str, message: str) -> OpenAIError:
    """A 400 naming `param`; the message starts with it."""
    return OpenAIError(400, f"{param}: {message}", INVALID, param)


def unknown_model(name: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model", 404)


def missing_api_key() -> OpenAIError:
    return OpenAIError(
        401,
        "invalid or missing API key: send the header Authorization: Bearer <key>",
        "authentication_error",
        code="invalid_api_key",
    )


def not_connected() -> OpenAIError:
    return OpenAIError(503, "not connected to NATS", "service_unavailable")


def client_gone() -> OpenAIError:
    return OpenAIError(499, "client gone", "client_gone")


def _quoted(value: Any) -> str:
    return json.dumps(value, default=str)[:100]


def validation_error(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """The first broken rule of a body (pydantic's `errors()`), named by its field path
    (`messages.0.role: ...`)."""
    error = errors[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidField):
        return OpenAIError(400, cause.message, INVALID, cause.param)
    path = [str(part) for part in error.get("loc", ()) if part != "body"]
    shapes = [part for part in path if part in _UNION_TAGS or "[" in part]
    location = [part for part in path if part not in _UNION_TAGS and "[" not in part]
    param = ".".join(location) or None
    if shapes and location and location[0] in UNION_SHAPES:
        field_name = location[0]
        message = (
            f"{field_name}: must be {UNION_SHAPES[field_name]} (got {_quoted(error.get('input'))})"
        )
        return OpenAIError(400, message, INVALID, field_name)
    if error.get("type") == "extra_forbidden" and param:
        return invalid(
            param, "not supported by this frontend (unknown here, so refused, not ignored)"
        )
    message = f"{param}: {error.get('msg')}" if param else str(error.get("msg"))
    if "input" in error and param:
        message += f" (got {_quoted(error['input'])})"
    return OpenAIError(400, message, INVALID, param)


def transport_error(error: BaseException) -> OpenAIError:
    """What a failure to get a request's frames answers; a cancellation is raised again."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, RequestError):
        return OpenAIError.from_worker(error.code, error.message)
    if isinstance(error, nats.errors.TimeoutError):
        return OpenAIError(504, "no answer from a worker in time", "timeout")
    if isinstance(error, FrameOrderError):
        return OpenAIError(502, f"frames lost in transit: {error}", "internal_error")
    if isinstance(error, nats.errors.Error):
        return OpenAIError(503, f"NATS: {error!r}", "service_unavailable")
    if isinstance(error, asyncio.CancelledError):
        raise error
    described = f"{type(error).__name__}: {error}"
    # The message may quote a request; the traceback's lines are the program's own.
    log.error(
        "request failed: %s\n%s",
        loggable(described),
        "".join(traceback.format_tb(error.__traceback__)).rstrip(),
    )
    return OpenAIError(500, described, "internal_error")
