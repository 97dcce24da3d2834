"""worker.eager.start_eagerly: the coroutine's first step runs in the caller's turn, ahead of
what the event loop already had ready; the rest, its result, its errors and its cancellation
behave as in a task created the ordinary way."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from worker.eager import start_eagerly

pytestmark = pytest.mark.timeout(10)


async def test_the_first_step_runs_before_start_returns_and_ahead_of_ready_work() -> None:
    order: list[str] = []
    gate = asyncio.Event()

    async def request() -> str:
        order.append("admitted")
        await gate.wait()
        order.append("streamed")
        return "done"

    async def output_work() -> None:
        order.append("frames")

    frames = asyncio.create_task(output_work())  # ready before the request arrives
    task = start_eagerly(request())
    assert order == ["admitted"]
    await frames
    gate.set()
    assert await task == "done"
    assert order == ["admitted", "frames", "streamed"]


async def test_an_ordinary_task_would_have_waited_behind_the_ready_work() -> None:
    """The contrast that makes the test above mean something."""
    order: list[str] = []

    async def request() -> None:
        order.append("admitted")

    async def output_work() -> None:
        order.append("frames")

    frames = asyncio.create_task(output_work())
    await asyncio.create_task(request())
    await frames
    assert order == ["frames", "admitted"]


async def test_a_coroutine_that_ends_or_raises_in_its_first_step_gives_that_result() -> None:
    async def at_once() -> int:
        return 7

    async def fails() -> None:
        raise ValueError("token_ids: empty")

    assert await start_eagerly(at_once()) == 7
    with pytest.raises(ValueError, match="token_ids: empty"):
        await start_eagerly(fails())


async def test_results_errors_and_bare_yields_after_the_first_step() -> None:
    async def steps() -> int:
        await asyncio.sleep(0)  # a bare yield
        await asyncio.sleep(0.01)  # a future
        return 3

    async def fails_later() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("engine_error")

    assert await start_eagerly(steps()) == 3
    with pytest.raises(RuntimeError, match="engine_error"):
        await start_eagerly(fails_later())


async def test_a_future_that_fails_raises_at_the_coroutines_own_await() -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    seen: list[str] = []

    async def waits() -> None:
        try:
            await future
        except KeyError as error:
            seen.append(f"caught {error}")
            raise

    task = start_eagerly(waits())
    future.set_exception(KeyError("gone"))
    with pytest.raises(KeyError):
        await task
    assert seen == ["caught 'gone'"]


async def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    cleaned: list[str] = []

    async def request() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # the engine's abort is awaited
            cleaned.append("aborted")
            raise

    task = start_eagerly(request())
    await asyncio.sleep(0.01)
    task.cancel("client_gone")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert cleaned == ["aborted"]


async def test_a_task_cancelled_before_its_first_step_cancels_the_begun_coroutine_in_the_task() -> (
    None
):
    """The coroutine had already begun (admitted to the engine) when its task was cancelled,
    before the task's own first step: it meets the cancellation (with its message) at its own
    await, inside the task, and what it then returns is the task's result (RequestSession.run
    answers a cancel it asked for and returns its Outcome)."""
    log: list[str] = []

    async def request() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError as error:
            log.append(f"cancelled: {error.args[0]}")
            await asyncio.sleep(0.01)  # the engine's abort, the cancel frame
            log.append("frame sent")
            return "outcome"
        return "not cancelled"

    task = start_eagerly(request())
    task.cancel("client_gone")  # before the loop ran the task at all
    assert await task == "outcome"
    assert log == ["cancelled: client_gone", "frame sent"]


async def test_a_cancelled_coroutine_resumes_only_after_the_task_it_awaits_has_ended() -> None:
    """As with an ordinary task: the cancellation goes through the awaited child, and the
    parent sees the child's own end (here its value: it swallowed the cancellation)."""
    log: list[str] = []

    async def child() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)
            log.append("child cleaned")
        return "child value"

    async def parent() -> None:
        log.append(f"parent got {await asyncio.create_task(child())!r}")

    task = start_eagerly(parent())
    await asyncio.sleep(0.01)
    task.cancel()
    await task
    assert log == ["child cleaned", "parent got 'child value'"]


async def test_a_future_the_coroutine_waits_on_can_be_awaited_by_others_too() -> None:
    loop = asyncio.get_running_loop()
    shared: asyncio.Future[str] = loop.create_future()
    got: list[str] = []

    async def waits(who: str) -> None:
        got.append(f"{who} {await shared}")

    first = start_eagerly(waits("a"))
    second = asyncio.create_task(waits("b"))
    await asyncio.sleep(0.01)
    shared.set_result("done")
    await asyncio.gather(first, second)
    assert sorted(got) == ["a done", "b done"]


async def test_a_task_that_swallows_its_cancellation_goes_on() -> None:
    async def stubborn() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.01)
        return "finished anyway"

    task = start_eagerly(stubborn())
    await asyncio.sleep(0.01)
    task.cancel()
    assert await task == "finished anyway"


async def test_the_first_steps_context_is_the_tasks() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="caller")

    async def sets() -> str:
        var.set("request")
        await asyncio.sleep(0)
        return var.get()

    assert await start_eagerly(sets()) == "request"
    assert var.get() == "caller"  # the caller's own context is untouched
