"""A streamed answer as server-sent events: the opening chunks, one chunk per frame that makes
one, the usage chunk if asked, then `data: [DONE]`. Past the headers a failure can only be an
error event (OpenAI's error body), and the stream still ends with [DONE]."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from worker.frontend.answers import Answer
from worker.frontend.errors import OpenAIError, transport_error
from worker.frontend.streams import Batch

DONE = b"data: [DONE]\n\n"

_JSON = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event. msgspec's encoder: compact, UTF-8, a non-finite float as null (stdlib json
    writes `-Infinity`, which is not JSON), and cheap per chunk."""
    return b"data: " + _JSON.encode(payload) + b"\n\n"


async def events(
    batch: Batch,
    answer: Answer[Any],
    *,
    include_usage: bool,
    on_answered: Callable[[dict[str, int]], None],
) -> AsyncIterator[bytes]:
    """The stream of `answer` fed by `batch`; `on_answered(usage)` once it ended without error.
    Leaving early closes `batch` (a cancel per prompt)."""
    try:
        for opening in answer.opening_chunks():
            yield sse(opening)
        failed = False
        async with contextlib.aclosing(batch.frames()) as frames:
            async for index, frame in frames:
                if frame.error:
                    yield sse(OpenAIError.from_worker(frame.error.code, frame.error.message).body())
                    failed = True
                    break
                chunk = answer.next_chunk(index, frame)
                if chunk is not None:
                    yield sse(chunk)
        if not failed:
            on_answered(answer.usage())
            if include_usage:
                yield sse(answer.usage_chunk())
    except Exception as error:
        yield sse(transport_error(error).body())
    finally:
        await batch.aclose()
    yield DONE
