"""One request's life (worker/session.py) on written engine steps: `RequestSession` over a
`ScriptedFakeEngine`, its frames going through a FrameWriter to a `MemoryReply`.

The invariants of the session's module text: prompt rows before the first token, one final frame
per choice with its usage, one error frame ending everything, an interrupt or cancel closing the
engine stream, retryable failures left to a later attempt, nothing sent past an undeliverable
frame.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from messages.codec import MSGPACK
from messages.frames import TopLogprob
from messages.request import GenerateRequest
from worker.client.requests import make_request
from worker.dev.fakes import MemoryReply, ScriptedFakeEngine
from worker.engine.contract import (
    ChoiceDelta,
    EngineDead,
    EngineFailure,
    EngineStep,
    InvalidRequest,
    PromptRows,
)
from worker.framing import FrameWriter
from worker.metrics import WorkerMetrics
from worker.session import Outcome, RequestSession

PROMPT = [1, 300, 301]


def row(token_id: int) -> list[TopLogprob]:
    return [TopLogprob(1, token_id, f"t{token_id}", -0.25, b"t"), TopLogprob(2, 9, "n", -2.0, b"n")]


def delta(
    index: int, tokens: list[int], finish: Any = None, stop_reason: str | int | None = None
) -> ChoiceDelta:
    return ChoiceDelta(
        index, tokens, [-0.25] * len(tokens), [row(t) for t in tokens], finish, stop_reason
    )


def steps(*choices: ChoiceDelta | list[ChoiceDelta]) -> list[EngineStep]:
    return [EngineStep(None, c if isinstance(c, list) else [c]) for c in choices]


def session_on(
    engine: ScriptedFakeEngine,
    request: GenerateRequest,
    *,
    reply: MemoryReply | None = None,
    final_attempt: bool = True,
    metrics: WorkerMetrics | None = None,
    arrived: float | None = None,
) -> tuple[RequestSession, MemoryReply]:
    reply = reply or MemoryReply()
    writer = FrameWriter(MSGPACK, 1 << 20, reply.publish)
    session = RequestSession(
        request, engine, writer, "engine-1", metrics, final_attempt, arrived=arrived
    )
    return session, reply


def wire(reply: MemoryReply) -> list[dict[str, Any]]:
    return [msgspec.msgpack.decode(data) for data in reply.published]


async def running(session: RequestSession, reply: MemoryReply, frames: int) -> asyncio.Task:
    """The session in its own task, once `frames` frames were sent."""
    task = asyncio.create_task(session.run())
    await reply.wait_for_frames(frames)
    return task


async def test_prompt_rows_come_before_the_first_token() -> None:
    prompt = PromptRows([None, -1.0, -2.0], [None, row(300), row(301)])
    engine = ScriptedFakeEngine(
        [EngineStep(prompt, [delta(0, [7])]), EngineStep(None, [delta(0, [8], "length")])]
    )
    request = make_request("p", PROMPT, max_tokens=2, logprobs=1, prompt_logprobs=1)
    session, reply = session_on(engine, request)
    await session.run()
    first, *rest = wire(reply)
    assert first["seq"] == 0 and first["token_ids"] == []
    assert first["prompt_position"] == 0
    assert first["prompt_log_probs"] == [None, -1.0, -2.0]
    assert first["prompt_top_logprobs"][0] is None and len(first["prompt_top_logprobs"]) == 3
    assert first["finish_reason"] is None
    assert [(f["seq"], f["token_ids"]) for f in rest] == [(1, [7]), (2, [8])]
    assert all("prompt_log_probs" not in f for f in rest)
    assert rest[-1]["completion_usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
    }


@pytest.mark.parametrize("stop_reason", ["\n\n", 42])
async def test_a_stop_carries_its_stop_reason_on_the_final_frame(stop_reason: str | int) -> None:
    engine = ScriptedFakeEngine(steps(delta(0, [5]), delta(0, [6], "stop", stop_reason)))
    session, reply = session_on(engine, make_request("s", PROMPT, max_tokens=9))
    outcome = await session.run()
    maps = wire(reply)
    assert "stop_reason" not in maps[0]
    assert (maps[-1]["finish_reason"], maps[-1]["stop_reason"]) == ("stop", stop_reason)
    assert maps[-1]["completion_usage"]["completion_tokens"] == 2
    assert outcome.finish_reasons == ["stop"]


async def test_eos_and_length_carry_no_stop_reason() -> None:
    engine = ScriptedFakeEngine(steps([delta(0, [5], "eos"), delta(1, [6], "length")]))
    session, reply = session_on(engine, make_request("e", PROMPT, n=2))
    await session.run()
    assert [(m["finish_reason"], "stop_reason" in m) for m in wire(reply)] == [
        ("eos", False),
        ("length", False),
    ]


async def test_each_choice_counts_its_own_usage() -> None:
    engine = ScriptedFakeEngine(
        steps(
            [delta(0, [1, 2]), delta(1, [3])],
            [delta(0, [4], "length"), delta(1, [5], "stop", 5)],
        )
    )
    session, reply = session_on(engine, make_request("u", PROMPT, n=2, max_tokens=3))
    outcome = await session.run()
    finals = {m["index"]: m for m in wire(reply) if m["finish_reason"] is not None}
    assert finals[0]["completion_usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3,
        "total_tokens": 6,
    }
    assert finals[1]["completion_usage"]["completion_tokens"] == 2
    assert outcome.completion_tokens == 5 and outcome.label == "length,stop"


async def test_a_choice_the_engine_ended_in_error_says_so_in_its_frame() -> None:
    engine = ScriptedFakeEngine(steps(delta(0, [4]), delta(0, [], "error")))
    session, reply = session_on(engine, make_request("ce", PROMPT))
    outcome = await session.run()
    final = wire(reply)[-1]
    assert final["finish_reason"] == "error"
    assert final["error"] == {"code": "engine_error", "message": "the engine ended this choice"}
    assert outcome.finish_reasons == ["error"] and outcome.outcomes == ["error"]


async def test_a_stream_that_ends_with_a_choice_open_is_an_engine_error() -> None:
    engine = ScriptedFakeEngine(steps([delta(0, [1], "length"), delta(1, [2])]))
    session, reply = session_on(engine, make_request("open", PROMPT, n=2))
    outcome = await session.run()
    final = wire(reply)[-1]
    assert final["finish_reason"] == "error" and final["seq"] == 2
    assert final["error"] == {
        "code": "engine_error",
        "message": "engine stream ended with choices [1] unfinished",
    }
    assert outcome.outcomes == ["engine_error"]


async def test_logprob_fields_follow_the_request_not_the_engine() -> None:
    """Rows the engine computed anyway are not sent unasked; asked, a delta without rows (a last
    empty delta) still has both lists, empty, so every frame stays aligned."""
    engine = ScriptedFakeEngine(
        steps(delta(0, [5]), ChoiceDelta(0, [], None, None, "stop", "</s>"))
    )
    session, reply = session_on(engine, make_request("nolp", PROMPT))
    await session.run()
    assert all("log_probs" not in m and "top_logprobs" not in m for m in wire(reply))
    session, reply = session_on(engine, make_request("lp", PROMPT, logprobs=1))
    await session.run()
    maps = wire(reply)
    assert maps[0]["log_probs"] == [-0.25] and len(maps[0]["top_logprobs"]) == 1
    assert (maps[1]["token_ids"], maps[1]["log_probs"], maps[1]["top_logprobs"]) == ([], [], [])


async def test_an_interrupt_sends_one_error_frame_and_closes_the_engine_stream() -> None:
    engine = ScriptedFakeEngine(steps(*[delta(0, [i]) for i in range(1000)]), step_s=0.005)
    session, reply = session_on(engine, make_request("int", PROMPT, n=1))
    task = await running(session, reply, 2)
    session.interrupt(task, "worker_shutdown", "worker shut down: retry")
    session.cancel(task)  # too late: the first end wins
    outcome = await task
    maps = wire(reply)
    assert [m["finish_reason"] for m in maps].count("error") == 1
    assert maps[-1]["error"] == {"code": "worker_shutdown", "message": "worker shut down: retry"}
    assert [m["seq"] for m in maps] == list(range(len(maps)))
    assert outcome.error_code == "worker_shutdown"
    assert engine.closed_early == 1 and engine.running == 0


async def test_an_error_without_text_is_sent_with_its_codes_meaning() -> None:
    engine = ScriptedFakeEngine(steps(*[delta(0, [i]) for i in range(1000)]), step_s=0.005)
    session, reply = session_on(engine, make_request("meaning", PROMPT))
    task = await running(session, reply, 1)
    session.interrupt(task, "worker_shutdown", "")
    await task
    assert wire(reply)[-1]["error"] == {
        "code": "worker_shutdown",
        "message": "the worker is shutting down",
    }


async def test_a_cancel_ends_only_the_choices_still_open() -> None:
    engine = ScriptedFakeEngine(
        steps([delta(0, [1], "length"), delta(1, [2])], *[delta(1, [i]) for i in range(1000)]),
        step_s=0.005,
    )
    session, reply = session_on(engine, make_request("half", PROMPT, n=2))
    task = await running(session, reply, 3)
    session.cancel(task)
    session.interrupt(task, "worker_shutdown", "ignored: the cancel came first")
    outcome = await task
    finals = [(m["index"], m["finish_reason"]) for m in wire(reply) if m["finish_reason"]]
    assert finals == [(0, "length"), (1, "cancelled")]
    assert "error" not in wire(reply)[-1]
    assert outcome.finish_reasons == ["length", "cancelled"] and outcome.error_code is None
    assert engine.closed_early == 1


async def test_a_cancel_with_a_reason_names_it_in_the_cancelled_frame() -> None:
    engine = ScriptedFakeEngine(steps(*[delta(0, [i]) for i in range(1000)]), step_s=0.005)
    session, reply = session_on(engine, make_request("why", PROMPT))
    task = await running(session, reply, 1)
    session.cancel(task, "deadline_exceeded", "timeout_ms 5 passed")
    await task
    final = wire(reply)[-1]
    assert final["finish_reason"] == "cancelled"
    assert final["error"] == {"code": "deadline_exceeded", "message": "timeout_ms 5 passed"}
    tokens = sum(len(m["token_ids"]) for m in wire(reply))
    assert final["completion_usage"]["completion_tokens"] == tokens


async def test_a_task_cancelled_from_outside_is_not_swallowed() -> None:
    """Only the session's own interrupt or cancel is turned into frames."""
    engine = ScriptedFakeEngine(steps(*[delta(0, [i]) for i in range(1000)]), step_s=0.005)
    session, reply = session_on(engine, make_request("outside", PROMPT))
    task = await running(session, reply, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(m["finish_reason"] is None for m in wire(reply))
    assert engine.running == 0


async def test_nothing_more_is_sent_once_a_frame_is_undeliverable() -> None:
    engine = ScriptedFakeEngine(steps(*[delta(0, [i]) for i in range(20)], delta(0, [0], "length")))
    reply = MemoryReply(undeliverable_after=3)
    session, _ = session_on(engine, make_request("undeliverable", PROMPT), reply=reply)
    outcome = await session.run()
    assert len(reply.published) == 3  # no error frame either: nobody can receive it
    assert outcome.error_code == "client_gone"
    assert "nobody listens on" in outcome.error_message
    assert engine.closed_early == 1


async def test_cancel_frames_stop_at_the_first_undeliverable_one() -> None:
    pairs = [[delta(0, [i]), delta(1, [i])] for i in range(100)]
    engine = ScriptedFakeEngine(steps(*pairs), step_s=0.05)
    reply = MemoryReply(undeliverable_after=2)
    session, _ = session_on(engine, make_request("cf", PROMPT, n=2), reply=reply)
    task = await running(session, reply, 2)
    session.cancel(task)
    outcome = await asyncio.wait_for(task, 5)  # returns, does not raise
    assert len(reply.published) == 2
    # Choice 0's cancel frame failed: choice 1's was not tried.
    assert outcome.finish_reasons == ["cancelled", None]


async def test_a_dead_engine_is_answered_then_raised_to_the_service() -> None:
    engine = ScriptedFakeEngine(steps(delta(0, [1])), then_raise=EngineDead("core exited"))
    session, reply = session_on(engine, make_request("dead", PROMPT))
    with pytest.raises(EngineDead):
        await session.run()
    assert wire(reply)[-1]["error"] == {"code": "engine_error", "message": "core exited"}
    assert session.outcome.error_code == "engine_error" and session.outcome.completion_tokens == 1


async def test_a_retryable_failure_on_an_attempt_that_is_not_the_last_sends_nothing() -> None:
    engine = ScriptedFakeEngine(steps(delta(0, [1])), then_raise=EngineFailure("step failed"))
    session, reply = session_on(engine, make_request("retry", PROMPT), final_attempt=False)
    outcome = await session.run()
    assert outcome.requeue and outcome.error_code == "engine_error"
    assert [m["finish_reason"] for m in wire(reply)] == [None]  # the token frame, no error


async def test_a_retryable_failure_on_the_last_attempt_is_answered() -> None:
    engine = ScriptedFakeEngine(steps(delta(0, [1])), then_raise=EngineFailure("step failed"))
    session, reply = session_on(engine, make_request("last", PROMPT), final_attempt=True)
    outcome = await session.run()
    assert not outcome.requeue
    assert wire(reply)[-1]["error"] == {"code": "engine_error", "message": "step failed"}


async def test_a_request_the_engine_refuses_is_answered_on_any_attempt() -> None:
    """invalid_request is not retryable: a later attempt would fail the same way."""
    engine = ScriptedFakeEngine(then_raise=InvalidRequest("token_ids", "the engine says no"))
    session, reply = session_on(engine, make_request("inv", PROMPT), final_attempt=False)
    outcome = await session.run()
    assert not outcome.requeue
    (frame,) = wire(reply)
    assert frame["error"] == {
        "code": "invalid_request",
        "message": "token_ids: the engine says no",
    }


async def test_a_drain_on_an_attempt_that_is_not_the_last_is_left_to_redelivery() -> None:
    engine = ScriptedFakeEngine(steps(*[delta(0, [i]) for i in range(1000)]), step_s=0.005)
    session, reply = session_on(engine, make_request("js", PROMPT), final_attempt=False)
    task = await running(session, reply, 1)
    session.interrupt(task, "worker_shutdown", "worker shut down")
    outcome = await task
    assert outcome.requeue and outcome.error_code == "worker_shutdown"
    assert all(m["finish_reason"] is None for m in wire(reply))


async def test_time_to_first_token_counts_from_the_arrival() -> None:
    engine = ScriptedFakeEngine(steps(delta(0, [1], "length")))
    arrived = time.monotonic() - 2.0
    session, _ = session_on(engine, make_request("ttft", PROMPT), arrived=arrived)
    outcome = await session.run()
    assert outcome.first_token_s is not None and 2.0 <= outcome.first_token_s < 10.0
    assert outcome.started == arrived


async def test_the_admission_wait_counts_from_the_arrival_to_the_sessions_first_step() -> None:
    metrics = WorkerMetrics("m", CollectorRegistry())
    engine = ScriptedFakeEngine(steps(delta(0, [1], "length")))
    arrived = time.monotonic() - 0.3
    session, _ = session_on(engine, make_request("wait", PROMPT), metrics=metrics, arrived=arrived)
    await session.run()
    sample = metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    assert sample("nats_worker_admission_wait_seconds_count", labels) == 1
    assert 0.3 <= sample("nats_worker_admission_wait_seconds_sum", labels) < 5.0


async def test_no_token_no_time_to_first_token() -> None:
    engine = ScriptedFakeEngine(then_raise=EngineFailure("at once"))
    session, _ = session_on(engine, make_request("none", PROMPT))
    assert (await session.run()).first_token_s is None


async def test_token_metrics_count_every_token_and_each_gap() -> None:
    metrics = WorkerMetrics("m", CollectorRegistry())
    engine = ScriptedFakeEngine(steps(delta(0, [1, 2]), delta(0, [3]), delta(0, [4], "length")))
    session, _ = session_on(engine, make_request("met", PROMPT), metrics=metrics)
    await session.run()
    sample = metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    assert sample("nats_worker_generated_tokens_total", labels) == 4
    assert sample("nats_worker_time_to_first_token_seconds_count", labels) == 1
    # One observation per token after the choice's first delta (2 deltas of 1 token each).
    assert sample("nats_worker_inter_token_latency_seconds_count", labels) == 2


def test_outcomes_are_the_error_code_alone_or_each_choices_reason() -> None:
    outcome = Outcome("o", ["length", "stop"])
    assert (outcome.outcomes, outcome.label) == (["length", "stop"], "length,stop")
    outcome.error_code = "deadline_exceeded"
    assert (outcome.outcomes, outcome.label) == (["deadline_exceeded"], "deadline_exceeded")
