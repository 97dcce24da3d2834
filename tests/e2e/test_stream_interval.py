"""Coalescing frames over engine steps: vLLM's own `--stream-interval N` (an engine argument the
worker's CLI passes through) makes the worker send a request's tokens N at a time, first token at
once, with every frame's logprobs still aligned and the same tokens and values as one frame per
step. The real CPU engine, the worker started by its CLI as a user would."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from messages.codec import MSGPACK
from messages.frames import ResponseFrame
from messages.subjects import Subjects
from tests.helpers import (
    TEST_SUBJECTS,
    check_row,
    collect,
    exchange,
    kill_if_running,
    read_until,
    start_cli_worker,
)
from worker.client.requests import make_request

PROMPT = [1, 40, 41, 42, 43, 44]
TOKENS = 25
INTERVAL = 4


@pytest.mark.second_session  # CI: beside the integration layer, to even the jobs out
async def test_stream_interval_coalesces_frames_and_keeps_logprobs_aligned(
    nats_server, tiny_model, worker, client, engine
) -> None:
    lines: list[str] = []
    proc = await start_cli_worker(
        nats_server.url,
        tiny_model,
        "--namespace",
        "interval",
        "--stream-interval",
        str(INTERVAL),
        "--no-kv-events",
    )
    output = None
    try:
        await read_until(proc.stdout, r"vllm-nats-worker ready:", lines, 600)
        output = asyncio.create_task(collect(proc.stdout, lines))
        subject = Subjects("interval", "vllm", "generate").generate
        request = make_request("interval-1", PROMPT, max_tokens=TOKENS, logprobs=5)

        coalesced = [
            MSGPACK.decode_frame(data)
            for data in await exchange(client, subject, MSGPACK.encode(request))
        ]
        stepwise = [
            MSGPACK.decode_frame(data)
            for data in await exchange(client, TEST_SUBJECTS.generate, MSGPACK.encode(request))
        ]

        sizes = [len(f.token_ids) for f in coalesced]
        # First token at once (TTFT unchanged), then INTERVAL per frame: 25 = 1 + 6 x 4. A worker
        # that lags merges a request's pending outputs (both workers do, by design), so under
        # load a frame may carry two intervals, never a part of one.
        assert sizes[0] == 1 and sum(sizes) == TOKENS, sizes
        assert all(size % INTERVAL == 0 for size in sizes[1:]), sizes
        assert len(stepwise) > len(coalesced)
        assert [f.seq for f in coalesced] == list(range(len(coalesced)))
        assert [f.finish_reason for f in coalesced] == [None] * (len(coalesced) - 1) + ["length"]
        for frame in coalesced:
            assert len(frame.log_probs) == len(frame.top_logprobs) == len(frame.token_ids)
            for token_id, logprob, row in zip(
                frame.token_ids, frame.log_probs, frame.top_logprobs, strict=True
            ):
                check_row(row, token_id, logprob, 5, engine.table)

        def flat(frames: list[ResponseFrame], field: str) -> list[Any]:
            return [v for f in frames for v in getattr(f, field)]

        assert flat(coalesced, "token_ids") == flat(stepwise, "token_ids")
        for a, b in zip(flat(coalesced, "log_probs"), flat(stepwise, "log_probs"), strict=True):
            assert abs(a - b) < 1e-4
        ids = [[e.token_id for e in row] for row in flat(coalesced, "top_logprobs")]
        assert ids == [[e.token_id for e in row] for row in flat(stepwise, "top_logprobs")]
        assert coalesced[-1].completion_usage == stepwise[-1].completion_usage
    finally:
        proc.terminate()  # drains and stops its engine core with it
        try:
            await asyncio.wait_for(proc.wait(), 60)
        finally:
            await kill_if_running(proc)
            if output is not None:
                output.cancel()
