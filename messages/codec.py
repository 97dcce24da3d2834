"""Encoding by Content-Type: msgpack by default, JSON when the request says so.

One Encoder/Decoder per (format, type), made once: msgspec's are reusable and thread-safe.
JSON note: JSON has no NaN or infinity, so a non-finite logprob (e.g. -inf) is written as `null`;
msgpack keeps it as a float64. `bytes` fields are msgpack `bin` and base64 strings in JSON.

A message with an empty body on a reply subject is not a frame: it is the worker's liveness probe
(a NATS request whose "no responders" answer tells the worker that the client is gone). Readers
skip empty messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import msgspec

from messages.frames import ResponseFrame
from messages.request import CancelRequest, GenerateRequest

MSGPACK_CONTENT_TYPE = "application/msgpack"
JSON_CONTENT_TYPE = "application/json"


_T = TypeVar("_T")
_Decoder: TypeAlias = "msgspec.msgpack.Decoder[_T] | msgspec.json.Decoder[_T]"


@dataclass(frozen=True)
class Codec:
    content_type: str
    _encoder: msgspec.msgpack.Encoder | msgspec.json.Encoder
    _request_decoder: (
        msgspec.msgpack.Decoder[GenerateRequest] | msgspec.json.Decoder[GenerateRequest]
    )
    _frame_decoder: msgspec.msgpack.Decoder[ResponseFrame] | msgspec.json.Decoder[ResponseFrame]
    _cancel_decoder: msgspec.msgpack.Decoder[CancelRequest] | msgspec.json.Decoder[CancelRequest]

    def encode(self, obj: Any) -> bytes:
        return self._encoder.encode(obj)

    def decode_request(self, data: bytes) -> GenerateRequest:
        """Raises msgspec.DecodeError / ValidationError naming the field and the rule."""
        return self._request_decoder.decode(data)

    def decode_frame(self, data: bytes) -> ResponseFrame:
        return self._frame_decoder.decode(data)

    def decode_cancel(self, data: bytes) -> CancelRequest:
        return self._cancel_decoder.decode(data)

    def decode_as(self, data: bytes, kind: type[_T]) -> _T:
        """Any other message of the contract (the control plane's: rare, so no decoder is
        kept for it)."""
        if self.content_type == JSON_CONTENT_TYPE:
            return msgspec.json.decode(data, type=kind)
        return msgspec.msgpack.decode(data, type=kind)


MSGPACK = Codec(
    MSGPACK_CONTENT_TYPE,
    msgspec.msgpack.Encoder(),
    msgspec.msgpack.Decoder(GenerateRequest),
    msgspec.msgpack.Decoder(ResponseFrame),
    msgspec.msgpack.Decoder(CancelRequest),
)
JSON = Codec(
    JSON_CONTENT_TYPE,
    msgspec.json.Encoder(),
    msgspec.json.Decoder(GenerateRequest),
    msgspec.json.Decoder(ResponseFrame),
    msgspec.json.Decoder(CancelRequest),
)


_JSON_OBJECT_START = frozenset(b" \t\r\n{")


def codec_for(headers: Mapping[str, str] | None, data: bytes = b"") -> Codec:
    """JSON if the message's Content-Type says JSON (parameters like charset allowed), or if
    there is no Content-Type and the body starts like a JSON object (`nats req SUBJECT '{...}'`
    without `-H`): a request in msgpack is a map, whose first byte is never `{` (0x7b, a
    positive fixint) or JSON whitespace. Any other Content-Type is msgpack's."""
    content_type = ""
    if headers:
        content_type = headers.get("Content-Type") or headers.get("content-type") or ""
    if content_type:
        if content_type.split(";", 1)[0].strip().lower() == JSON_CONTENT_TYPE:
            return JSON
        return MSGPACK
    if data and data[0] in _JSON_OBJECT_START:
        return JSON
    return MSGPACK
