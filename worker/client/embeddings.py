"""The publisher side of embeddings: send an EmbedRequest, read its EmbedResult frames.

An embedding request has no partial output a caller could have seen, so every retryable end
(a refusal, a worker lost or shut down mid-request, an engine error) is answered by sending the
whole request again, to another worker where discovery names one, up to `retries` times; the
caller sees one answer or one RequestError. Frames are read as generation frames are
(worker.client.reader: probes and heartbeats skipped, `seq` checked, a silent worker lost).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS

from messages.codec import JSON, MSGPACK, Codec
from messages.embeddings import EmbedRequest, EmbedResult, unpack
from messages.errors import is_retryable
from messages.subjects import EMBED_ENDPOINT, REPLY_HEADER, Subjects
from worker.client.library import other_workers, publish_cancel
from worker.client.migration import SILENCE_TIMEOUT_S
from worker.client.reader import (
    FrameOrder,
    FrameOrderError,
    Inbox,
    RequestError,
    frame_payloads,
)
from worker.shared.log_text import loggable

DEFAULT_SUBJECTS = Subjects(endpoint=EMBED_ENDPOINT)


@dataclass(frozen=True)
class Embeddings:
    """One request's vectors, in input order, packed (messages.embeddings.pack)."""

    request_id: str
    vectors: list[bytes]
    dimensions: int
    prompt_tokens: int

    def floats(self) -> list[list[float]]:
        return [unpack(vector) for vector in self.vectors]


async def embed(
    nc: NATS,
    request: EmbedRequest,
    *,
    subject: str | None = None,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
    retries: int = 2,
    discovery_window: float = 0.25,
    silence_timeout: float | None = SILENCE_TIMEOUT_S,
) -> Embeddings:
    """The request's embeddings from a worker of `subject` (the queue group, or an instance
    subject under it; default `llm.vllm.embed`). Raises RequestError with the code of a final
    error, or of the last retryable one once `retries` are spent."""
    base = Subjects.parse(subject or DEFAULT_SUBJECTS.generate)[0]
    target = subject or base.generate
    tried: set[str] = set()
    failures: list[str] = []
    for attempt in range(retries + 1):
        try:
            return await _one_answer(nc, request, target, base, codec, timeout, silence_timeout)
        except RequestError as error:
            if not is_retryable(error.code) or attempt == retries:
                if failures:
                    failures.append(f"{target}: {error.message}")
                    raise RequestError(
                        error.code, f"failed after {attempt + 1} attempt(s): " + "; ".join(failures)
                    ) from error
                raise
            failures.append(f"{target}: {error.message}")
            instance = Subjects.parse(target)[1]
            if instance is not None:
                tried.add(instance)
            others = await other_workers(nc, base.generate, tried, discovery_window)
            target = min(others, key=lambda w: w.in_flight).subject if others else base.generate
    raise AssertionError("unreachable")


async def _one_answer(
    nc: NATS,
    request: EmbedRequest,
    target: str,
    subjects: Subjects,
    codec: Codec,
    timeout: float,
    silence: float | None,
) -> Embeddings:
    headers = {"Content-Type": codec.content_type} if codec is JSON else {}

    async def send(inbox: str) -> None:
        await nc.publish(target, codec.encode(request), reply=inbox, headers=headers or None)

    return await _answer(nc, request, subjects, codec, send, timeout, silence, queued=False)


async def jetstream_embed(
    nc: NATS,
    request: EmbedRequest,
    *,
    subjects: Subjects = DEFAULT_SUBJECTS,
    codec: Codec = MSGPACK,
    timeout: float = 60.0,
) -> Embeddings:
    """Publishes to the work queue of a `--mode jetstream` embedding worker (with a JetStream
    ack) and reads the answer of the last delivery attempt: the queue redelivers a request whose
    worker died, and the frames of a newer attempt replace the older one's."""

    async def send(inbox: str) -> None:
        headers = {REPLY_HEADER: inbox}
        if codec is JSON:
            headers["Content-Type"] = codec.content_type
        await nc.jetstream().publish(subjects.queue, codec.encode(request), headers=headers)

    return await _answer(nc, request, subjects, codec, send, timeout, None, queued=True)


async def _answer(
    nc: NATS,
    request: EmbedRequest,
    subjects: Subjects,
    codec: Codec,
    send: Callable[[str], Awaitable[None]],
    timeout: float,
    silence: float | None,
    *,
    queued: bool,
) -> Embeddings:
    """The request sent by `send(inbox)` and its answer read from the inbox (subscribed first,
    so nothing is missed); leaving before the answer cancels it on the worker. `queued`: it may
    wait in a work queue (no silence counted before the first message) and be redelivered."""
    inbox = nc.new_inbox()
    subscription = await Inbox.open(nc, inbox)
    answered = False
    try:
        await send(inbox)
        payloads = frame_payloads(subscription, timeout, silence, quiet_until_heard=queued)
        result = await _fold(request, _frames(payloads, codec, attempts=queued))
        answered = True
        return result
    finally:
        if not answered:
            await publish_cancel(nc, subjects.cancel, request.request_id, inbox)
        await subscription.unsubscribe()


async def _frames(
    payloads: AsyncGenerator[bytes, None], codec: Codec, *, attempts: bool
) -> AsyncGenerator[EmbedResult, None]:
    """The frames of the request in `seq` order, a newer attempt's restarting the count (the
    frames of an older attempt are skipped), until one with a finish reason."""
    order = FrameOrder(attempts)
    async for data in payloads:
        frame = codec.decode_as(data, EmbedResult)
        if not order.take(frame.seq, frame.attempt):
            continue
        yield frame
        if frame.finish_reason is not None:
            return


async def _fold(request: EmbedRequest, frames: AsyncGenerator[EmbedResult, None]) -> Embeddings:
    vectors: list[bytes] = []
    async for frame in frames:
        if frame.error:
            raise RequestError(frame.error.code, frame.error.message)
        if frame.index == 0:
            vectors = []  # a newer attempt starts over
        if frame.index != len(vectors):
            raise FrameOrderError(f"vectors from {frame.index} after {len(vectors)} of them")
        vectors += frame.embeddings
        if frame.finish_reason == "stop":
            if len(vectors) != len(request.inputs):
                raise RequestError(
                    "internal_error",
                    f"{len(vectors)} vectors for {len(request.inputs)} inputs of request "
                    f"{loggable(request.request_id)}",
                )
            prompt_tokens = frame.usage.prompt_tokens if frame.usage else 0
            return Embeddings(request.request_id, vectors, frame.dimensions, prompt_tokens)
    raise RequestError("internal_error", "the answer ended without a final frame")
