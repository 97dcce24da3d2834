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
version: the task is handed the begun coroutine behind a wrapper whose first `send` gives back
what the first step yielded, so the task itself waits on that future, cancels it and checks it
as if the coroutine had yielded it in the task's own step. What differs from a task's own first
step: during it, `asyncio.current_task()` is the caller's task (an `asyncio.timeout` or
`TaskGroup` entered there would act on the caller; nothing on the request path does, checked in
worker/service.py `_serve`, worker/session.py `RequestSession.run`, the vLLM adapter's
`generate` and vLLM 0.32's `AsyncLLM.generate` and `add_request`), and it runs in a copy of the
caller's context, which the task then keeps.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")

_TAKEN = object()
"""`_Begun._first` once the task has had it."""


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
    return _task_in(context, _Begun(coro, waiting_on), name)


def _task_in(
    context: contextvars.Context, coro: Coroutine[Any, Any, T], name: str | None = None
) -> asyncio.Task[T]:
    """A task that runs in (a copy of) `context`: create_task's own `context=` is 3.11+."""
    return context.run(asyncio.create_task, coro, name=name)


class _Begun(Coroutine[Any, Any, T]):
    """`coro` past its first step, for a task to drive. The first `send` returns what that step
    yielded (a future still marked as awaited, or None for a bare yield), so the task waits on
    it, resets it and cancels it (with the message) itself; a task cancelled before its first
    step cancels that future, and the coroutine meets the cancellation at its own await."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, T], first: Any) -> None:
        self._coro = coro
        self._first = first

    def send(self, value: Any) -> Any:
        first, self._first = self._first, _TAKEN
        if first is not _TAKEN:
            return first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        first, self._first = self._first, _TAKEN
        if (
            first is not _TAKEN
            and isinstance(typ, asyncio.CancelledError)
            and asyncio.isfuture(first)
            and first.cancel(*typ.args[:1])
        ):
            return first
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._first = _TAKEN
        self._coro.close()

    def __await__(self) -> Generator[Any, None, T]:
        return self

    def __iter__(self) -> _Begun[T]:
        return self

    def __next__(self) -> Any:
        # Python 3.12's C task sends None through tp_iternext.
        return self.send(None)

    def __getattr__(self, name: str) -> Any:
        # cr_frame, cr_code, __qualname__: what a task's repr and debugging read. Its own
        # slots unset (a copy being built) must not recurse through here.
        if name in _Begun.__slots__:
            raise AttributeError(name)
        return getattr(self._coro, name)


async def _value(value: T) -> T:
    return value


async def _raise(error: BaseException) -> Any:
    raise error
