"""The publisher side: send a GenerateRequest over NATS and read its frames.

Needs only nats-py and `messages` (no vllm or torch). It subscribes to its own inbox before
publishing (so no frame can be missed), checks `seq` order, enforces a per-frame timeout, and
stops at the request's end: every choice finished, or one error frame.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from messages.codec import JSON, MSGPACK, Codec
from messages.frames import ResponseFrame, TopLogprob, Usage
from messages.request import GenerateRequest
from messages.subjects import Subjects


class FrameOrderError(RuntimeError):
    """A frame arrived out of `seq` order, or one is missing."""


class RequestError(RuntimeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


async def stream_frames(
    nc: NATS,
    subject: str,
    payload: bytes,
    *,
    codec: Codec = MSGPACK,
    choices: int = 1,
    timeout: float = 60.0,
) -> AsyncIterator[ResponseFrame]:
    """Frames of one request, in order, until all `choices` finished or an error frame."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    headers = {"Content-Type": codec.content_type} if codec is JSON else None
    try:
        await nc.publish(subject, payload, reply=inbox, headers=headers)
        expected_seq = 0
        finished: set[int] = set()
        while True:
            msg = await subscription.next_msg(timeout=timeout)
            frame = codec.decode_frame(msg.data)
            if frame.seq != expected_seq:
                raise FrameOrderError(f"expected seq {expected_seq}, got {frame.seq}")
            expected_seq += 1
            yield frame
            if frame.finish_reason == "error":
                return
            if frame.finish_reason is not None:
                finished.add(frame.index)
                if len(finished) >= choices:
                    return
    finally:
        await subscription.unsubscribe()


@dataclass
class Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass
class Completion:
    """All frames of a request folded together (what a non-streaming caller wants)."""

    request_id: str
    frames: list[ResponseFrame]
    choices: list[Choice]
    prompt_log_probs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[TopLogprob] | None] = field(default_factory=list)
    error: RequestError | None = None


def fold(request_id: str, frames: list[ResponseFrame], choices: int) -> Completion:
    result = Completion(request_id, frames, [Choice(i) for i in range(choices)])
    for frame in frames:
        if frame.error:
            result.error = RequestError(frame.error.code, frame.error.message)
        if frame.prompt_log_probs:
            if frame.prompt_position != len(result.prompt_log_probs):
                raise FrameOrderError("prompt logprob frames out of position order")
            result.prompt_log_probs += frame.prompt_log_probs
            result.prompt_top_logprobs += frame.prompt_top_logprobs or []
        if frame.finish_reason == "error":
            continue
        choice = result.choices[frame.index]
        choice.token_ids += frame.token_ids
        if frame.log_probs:
            choice.log_probs += frame.log_probs
        if frame.top_logprobs:
            choice.top_logprobs += frame.top_logprobs
        if frame.finish_reason is not None:
            choice.finish_reason = frame.finish_reason
            choice.usage = frame.completion_usage or None
    return result


async def generate(
    nc: NATS,
    request: GenerateRequest,
    *,
    subject: str | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
) -> AsyncIterator[ResponseFrame]:
    """`async for frame in generate(nc, request)`: the request's frames as they stream."""
    async for frame in stream_frames(
        nc,
        subject or Subjects().generate,
        codec.encode(request),
        codec=codec,
        choices=request.sampling_options.n,
        timeout=timeout,
    ):
        yield frame


async def complete(
    nc: NATS,
    request: GenerateRequest,
    *,
    subject: str | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
) -> Completion:
    frames = [f async for f in generate(nc, request, subject=subject, codec=codec, timeout=timeout)]
    return fold(request.request_id, frames, request.sampling_options.n)
