"""The frontend's disconnect watcher (worker/frontend/routes/common.py) and the frame streams it
stops (worker/frontend/streams.py), driven by an ASGI `receive` made of a queue: the messages a
server hands a route after its body."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.types import Message, Receive

from messages.frames import ResponseFrame
from worker.frontend.routes.common import watch_disconnect
from worker.frontend.streams import until_disconnected


def queued_receive() -> tuple[asyncio.Queue[Message], Receive]:
    queue: asyncio.Queue[Message] = asyncio.Queue()

    async def receive() -> Message:
        return await queue.get()

    return queue, receive


async def test_the_watcher_waits_for_http_disconnect_and_skips_unread_body() -> None:
    queue, receive = queued_receive()
    watcher = asyncio.create_task(watch_disconnect(receive))
    queue.put_nowait({"type": "http.request", "body": b"left", "more_body": False})
    await asyncio.sleep(0.05)
    assert not watcher.done()  # no message said the client left: nothing polled, still waiting
    queue.put_nowait({"type": "http.disconnect"})
    await asyncio.wait_for(watcher, 1)


async def test_a_client_gone_mid_wait_ends_the_frames_closes_them_and_runs_on_end() -> None:
    queue, receive = queued_receive()
    watcher = asyncio.create_task(watch_disconnect(receive))
    closed = asyncio.Event()
    ended: list[bool] = []

    async def frames() -> AsyncGenerator[ResponseFrame, None]:
        try:
            yield ResponseFrame(request_id="cmpl-1", seq=0, token_ids=[7])
            await asyncio.Event().wait()  # the worker's next frame never comes
            yield ResponseFrame(request_id="cmpl-1", seq=1, token_ids=[8])
        finally:
            closed.set()  # closing the frames is what cancels the worker's request

    async def read() -> list[ResponseFrame]:
        stream = until_disconnected(watcher, frames(), "cmpl-1", lambda: ended.append(True))
        return [frame async for frame in stream]

    reading = asyncio.create_task(read())
    await asyncio.sleep(0.05)
    queue.put_nowait({"type": "http.disconnect"})
    got = await asyncio.wait_for(reading, 1)
    assert [frame.token_ids for frame in got] == [[7]]
    assert closed.is_set() and ended == [True]
    assert not reading.cancelled()


async def test_a_watcher_cancelled_at_the_response_end_stops_nothing() -> None:
    _, receive = queued_receive()
    watcher = asyncio.create_task(watch_disconnect(receive))

    async def frames() -> AsyncGenerator[ResponseFrame, None]:
        yield ResponseFrame(request_id="cmpl-2", seq=0, token_ids=[1])
        await asyncio.sleep(0.05)
        yield ResponseFrame(request_id="cmpl-2", seq=1, token_ids=[2], finish_reason="length")

    stream = until_disconnected(watcher, frames(), "cmpl-2")
    first = await anext(stream)
    watcher.cancel()  # the HTTP request ended normally
    rest = [frame async for frame in stream]
    assert [first.token_ids, *(frame.token_ids for frame in rest)] == [[1], [2]]
    assert rest[-1].finish_reason == "length"
