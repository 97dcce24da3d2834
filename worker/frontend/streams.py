"""One HTTP request's NATS requests as frame streams: each stopped (and so cancelled on the
worker) as soon as the HTTP client goes away, a batch's prompts read together.

Invariants:
- a stream that waits for its next frame sends nothing that could fail, so the client's
  departure is awaited (a `ClientGone` the route makes, one watcher per HTTP request);
- closing a stream closes the NATS request's frames (which publishes its cancel), whatever the
  reason: the client left, an error, the task cancelled, or a response dropped unread;
- nothing is made per frame on one prompt's path (no task, no `asyncio.wait`): this runs once
  per generated token of every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any

from messages.frames import ResponseFrame
from worker.frontend.errors import OpenAIError
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)


ClientGone = Callable[[], Coroutine[Any, Any, None]]
"""Returns once the caller is gone (or its response has ended): the transport's own signal,
made by the route (an HTTP request's disconnect), so that nothing here sees the transport."""


async def until_disconnected(
    watcher: asyncio.Task[None],
    frames: AsyncGenerator[ResponseFrame, None],
    request_id: str,
    on_end: Callable[[], None] | None = None,
) -> AsyncGenerator[ResponseFrame, None]:
    """`frames`, stopped as soon as `watcher` (a task of the request's `ClientGone`, shared
    by a batch's prompts) ends; `on_end` runs once when this ends, for whatever reason.

    The watcher's end cancels the task that waits for the next frame; that one cancellation is
    taken back (`uncancel`) and ends the frames, while any other cancellation of the task goes
    on."""
    gone = False
    waiting: asyncio.Task[Any] | None = None

    def on_gone(_: asyncio.Future[None]) -> None:
        nonlocal gone
        if watcher.cancelled():
            return  # the HTTP request ended normally
        gone = True
        if waiting is not None:
            waiting.cancel()

    watcher.add_done_callback(on_gone)
    try:
        while not gone:
            waiting = asyncio.current_task()
            try:
                frame = await anext(frames)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if gone and task is not None and task.uncancel() == 0:
                    break
                raise
            finally:
                waiting = None
            yield frame
            # Frames already queued are read without suspending: without this one loop pass
            # per frame, a stream drains its backlog while new requests wait (TTFT).
            await asyncio.sleep(0)
        log.info("HTTP client gone: cancelling request %s", loggable(request_id))
    finally:
        watcher.remove_done_callback(on_gone)
        try:
            await frames.aclose()
        finally:
            # Here, not in a caller: this generator is closed even when its consumer never
            # ran (a response cancelled before its first step), at the latest when collected.
            if on_end is not None:
                on_end()


class FrameSource:
    """One NATS request's frames with its first frame already read (so that a refusal is an
    HTTP status, not an event of a stream already begun)."""

    def __init__(self, frames: AsyncGenerator[ResponseFrame, None], first: ResponseFrame) -> None:
        self._frames = frames
        self.first = first

    async def all(self) -> AsyncGenerator[ResponseFrame, None]:
        yield self.first
        async for frame in self._frames:
            yield frame

    async def aclose(self) -> None:
        await self._frames.aclose()


class Batch:
    """One HTTP request's NATS requests (one per prompt of a completions batch, else one), each
    with its first frame read, and the one watcher of the HTTP client's disconnect."""

    def __init__(self, sources: list[FrameSource], watcher: asyncio.Task[None]) -> None:
        self.sources = sources
        self._watcher = watcher

    async def frames(self) -> AsyncGenerator[tuple[int, ResponseFrame], None]:
        """(prompt index, frame): every prompt's frames, interleaved as they arrive (each
        prompt's in its own order). Leaving early stops every prompt's request."""
        if len(self.sources) == 1:  # one prompt: no fan-in, no task per frame
            async with contextlib.aclosing(self.sources[0].all()) as stream:
                async for frame in stream:
                    yield 0, frame
            return
        async with contextlib.aclosing(_fan_in([s.all() for s in self.sources])) as merged:
            async for item in merged:
                yield item

    async def aclose(self) -> None:
        """Stops every prompt's request (a cancel for those still running). Idempotent."""
        try:
            for source in self.sources:
                await source.aclose()
        finally:
            self._watcher.cancel()

    async def fold(self, add: Callable[[int, ResponseFrame], object]) -> None:
        """Non-streaming: every frame through `add(prompt index, frame)`; a worker error frame
        is the HTTP error (the other prompts' requests are cancelled)."""
        try:
            async with contextlib.aclosing(self.frames()) as frames:
                async for index, frame in frames:
                    if frame.error:
                        raise OpenAIError.from_worker(frame.error.code, frame.error.message)
                    add(index, frame)
        finally:
            await self.aclose()


async def _fan_in(
    streams: list[AsyncGenerator[ResponseFrame, None]],
) -> AsyncGenerator[tuple[int, ResponseFrame], None]:
    """(stream index, frame) from every stream as they come; each stream's in its own order."""
    pending = {asyncio.ensure_future(anext(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for step in sorted(done, key=pending.__getitem__):
                index = pending.pop(step)
                try:
                    frame = step.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, frame
    finally:
        for step in pending:
            step.cancel()
        for step in pending:
            with contextlib.suppress(BaseException):
                await step
        for stream in streams:
            await stream.aclose()
