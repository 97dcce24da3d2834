"""A task started eagerly: its coroutine runs in the caller's turn up to its first real wait,
and on from there as an ordinary task.

Why: a request's task created with `asyncio.create_task` takes its first step after everything
already ready in the event loop, which under load is the frames of every other stream's last
engine step, so the request reaches vLLM's `add_request` one full pass of the loop late
(`nats_worker_admission_wait_seconds`; 8 ms of a 54–62 ms first token in one CPU process at 64
streams). Started eagerly, its admission (engine inputs, and `add_request`'s send to the engine
core, which does not wait when the socket takes the message) happens in the intake's own turn,
ahead of that output work.

Python 3.12's `asyncio.eager_task_factory` does this, but the project runs on 3.10+; this is the
same idea with the public coroutine protocol only (`send`, `throw`), one code path on every
version. What differs from a task's own first step: during it, `asyncio.current_task()` is the
caller's task (nothing on the request path reads it), and it runs in a copy of the caller's
context, which the task then keeps.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def start_eagerly(coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
    """Runs `coro` now up to its first suspension and returns the task that runs the rest (a
    coroutine that ends or raises in that first step gives a task with that result)."""
    context = contextvars.copy_context()
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration as stop:
        return _task_in(context, _value(stop.value), name)
    except BaseException as error:  # CancelledError too: the task then ends cancelled
        return _task_in(context, _raise(error), name)
    task = _task_in(context, _go_on(coro, waiting_on), name)
    task.add_done_callback(lambda _: _cancel_if_left(coro, context))
    return task


def _task_in(
    context: contextvars.Context, coro: Coroutine[Any, Any, T], name: str | None = None
) -> asyncio.Task[T]:
    """A task that runs in (a copy of) `context`: create_task's own `context=` is 3.11+."""
    return context.run(asyncio.create_task, coro, name=name)


async def _go_on(coro: Coroutine[Any, Any, T], waiting_on: Any) -> T:
    """Drives a started coroutine as its task would: waits until what it yielded (a future, or
    None for one pass of the loop) is done and resumes it; a cancellation of this task cancels
    that future and is thrown into the coroutine, where it surfaces at its await.

    The future is waited on through a future of this task's own: the coroutine's await has
    already marked it as handed to a task, and awaiting it a second time would fail."""
    loop = asyncio.get_running_loop()
    while True:
        cancelled: asyncio.CancelledError | None = None
        try:
            if waiting_on is None:
                await asyncio.sleep(0)
            else:
                woken = loop.create_future()
                waiting_on.add_done_callback(functools.partial(_wake, woken))
                try:
                    await woken
                except asyncio.CancelledError:
                    waiting_on.cancel()
                    raise
        except asyncio.CancelledError as error:
            cancelled = error
        try:
            waiting_on = coro.send(None) if cancelled is None else coro.throw(cancelled)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


def _wake(woken: asyncio.Future[None], _: Any) -> None:
    if not woken.done():
        woken.set_result(None)


def _cancel_if_left(coro: Coroutine[Any, Any, Any], context: contextvars.Context) -> None:
    """A task cancelled before its first step never resumed the coroutine, which had already
    begun (a request admitted to the engine): it gets the cancellation now, in a task of its
    own, so its own clean-up (the engine's abort) runs."""
    if inspect.getcoroutinestate(coro) != inspect.CORO_SUSPENDED:
        return
    try:
        waiting_on = context.run(coro.throw, asyncio.CancelledError())
    except BaseException:  # StopIteration or the cancellation itself: it ended
        return
    _task_in(context, _go_on(coro, waiting_on)).add_done_callback(_ignore_outcome)


def _ignore_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: its cancellation already ended the caller's task


async def _value(value: T) -> T:
    return value


async def _raise(error: BaseException) -> Any:
    raise error
