"""Frame numbering, encoding and splitting to the server's max_payload.

Invariant: every published frame is at most `max_payload` bytes, and `seq` counts 0,1,2… over the
request's published frames, so a client sees gaps and reordering. A frame too big is split by
position (its per-position lists are cut together, so alignment is kept), an embedding result by
input; only the last piece keeps the finish reason, usage and error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from msgspec import UNSET

from messages.codec import Codec
from messages.embeddings import EmbedResult
from messages.frames import ResponseFrame
from worker.errors import WorkerError

Publish = Callable[[bytes], Awaitable[None]]
Frame = ResponseFrame | EmbedResult


class Undeliverable(WorkerError, RuntimeError):
    """A frame cannot reach its client (gone, or the broker unreachable for too long): nothing
    more, not even an error frame, can be sent for this request."""

    code = "client_gone"


class FrameTooLarge(WorkerError, RuntimeError):
    """A single position does not fit in max_payload (the server's limit is absurdly small)."""

    code = "engine_error"


def split_embeddings(frame: EmbedResult) -> tuple[EmbedResult, EmbedResult]:
    """Two frames holding the same vectors, in order; the second keeps the ending."""
    count = len(frame.embeddings)
    if count < 2:
        raise FrameTooLarge("one embedding exceeds max_payload")
    half = count // 2
    head = msgspec.structs.replace(
        frame, embeddings=frame.embeddings[:half], finish_reason=None, usage=UNSET, error=UNSET
    )
    tail = msgspec.structs.replace(
        frame, index=frame.index + half, embeddings=frame.embeddings[half:]
    )
    return head, tail


def split_frame(frame: ResponseFrame) -> tuple[ResponseFrame, ResponseFrame]:
    """Two frames covering the same positions, in order; the second keeps the ending."""
    replace = msgspec.structs.replace
    if frame.prompt_log_probs is not UNSET:
        count = len(frame.prompt_log_probs)
        if count < 2:
            raise FrameTooLarge("one prompt position exceeds max_payload")
        half = count // 2
        start = frame.prompt_position if frame.prompt_position is not UNSET else 0
        top = frame.prompt_top_logprobs
        head = replace(
            frame,
            prompt_log_probs=frame.prompt_log_probs[:half],
            prompt_top_logprobs=top[:half] if top is not UNSET else UNSET,
            finish_reason=None,
            completion_usage=UNSET,
            error=UNSET,
        )
        tail = replace(
            frame,
            prompt_position=start + half,
            prompt_log_probs=frame.prompt_log_probs[half:],
            prompt_top_logprobs=top[half:] if top is not UNSET else UNSET,
        )
        return head, tail
    count = len(frame.token_ids)
    if count < 2:
        raise FrameTooLarge("one generated position exceeds max_payload")
    half = count // 2
    lps, generated_top = frame.log_probs, frame.top_logprobs
    head = replace(
        frame,
        token_ids=frame.token_ids[:half],
        log_probs=lps[:half] if lps is not UNSET else UNSET,
        top_logprobs=generated_top[:half] if generated_top is not UNSET else UNSET,
        finish_reason=None,
        completion_usage=UNSET,
        error=UNSET,
    )
    tail = replace(
        frame,
        token_ids=frame.token_ids[half:],
        log_probs=lps[half:] if lps is not UNSET else UNSET,
        top_logprobs=generated_top[half:] if generated_top is not UNSET else UNSET,
    )
    return head, tail


class FrameWriter:
    """Publishes one request's frames to its reply subject."""

    def __init__(
        self, codec: Codec, max_payload: int, publish: Publish, attempt: int | None = None
    ) -> None:
        self.codec = codec
        self.max_payload = max_payload
        self._publish = publish
        self.attempt = attempt
        self.next_seq = 0
        self.frames_sent = 0

    def encode(self, frame: Frame) -> list[bytes]:
        """Encoded pieces of `frame`, numbered from next_seq, which advances only when every
        piece fits: a frame that cannot be split small enough uses up no seq number, so the
        error frame that follows comes next in order."""
        pieces = self._encode_from(frame, self.next_seq)
        self.next_seq += len(pieces)
        return pieces

    def _encode_from(self, frame: Frame, seq: int) -> list[bytes]:
        frame.seq = seq
        if self.attempt is not None:
            frame.attempt = self.attempt
        data = self.codec.encode(frame)
        if len(data) <= self.max_payload:
            return [data]
        head: Frame
        tail: Frame
        if isinstance(frame, EmbedResult):
            head, tail = split_embeddings(frame)
        else:
            head, tail = split_frame(frame)
        first = self._encode_from(head, seq)
        return first + self._encode_from(tail, seq + len(first))

    async def send(self, frame: Frame) -> None:
        for data in self.encode(frame):
            await self._publish(data)
            self.frames_sent += 1
