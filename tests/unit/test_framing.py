"""Frames never exceed max_payload; splitting keeps positions, order and the ending."""

from __future__ import annotations

import msgspec

from messages.codec import MSGPACK
from messages.frames import ResponseFrame, TopLogprob, Usage
from worker.framing import FrameWriter


def _row(token_id: int) -> list[TopLogprob]:
    return [
        TopLogprob(rank, token_id + rank, f"tok{rank}", -0.1 * rank, b"x" * 8)
        for rank in range(1, 6)
    ]


async def test_split_generated_frame_keeps_alignment_and_final_fields() -> None:
    sent: list[bytes] = []

    async def publish(data: bytes) -> None:
        sent.append(data)

    writer = FrameWriter(MSGPACK, 600, publish)
    ids = list(range(10, 30))
    frame = ResponseFrame(
        request_id="r",
        seq=0,
        token_ids=ids,
        log_probs=[-1.0 * i for i in ids],
        top_logprobs=[_row(i) for i in ids],
        finish_reason="length",
        completion_usage=Usage(1, 20, 21),
    )
    await writer.send(frame)
    assert len(sent) > 1 and all(len(data) <= 600 for data in sent)
    frames = [MSGPACK.decode_frame(data) for data in sent]
    assert [f.seq for f in frames] == list(range(len(frames)))
    assert sum((f.token_ids for f in frames), []) == ids
    assert sum((f.log_probs for f in frames), []) == [-1.0 * i for i in ids]
    assert sum((f.top_logprobs for f in frames), []) == [_row(i) for i in ids]
    assert all(len(f.token_ids) == len(f.log_probs) == len(f.top_logprobs) for f in frames)
    assert [f.finish_reason for f in frames] == [None] * (len(frames) - 1) + ["length"]
    wire = [msgspec.msgpack.decode(data) for data in sent]
    assert ["completion_usage" in w for w in wire] == [False] * (len(wire) - 1) + [True]
    assert writer.next_seq == len(frames)


async def test_split_prompt_frame_advances_position() -> None:
    sent: list[bytes] = []

    async def publish(data: bytes) -> None:
        sent.append(data)

    writer = FrameWriter(MSGPACK, 700, publish)
    values = [None] + [-0.5 * i for i in range(1, 40)]
    rows = [None] + [_row(i) for i in range(1, 40)]
    await writer.send(
        ResponseFrame(
            request_id="r",
            seq=0,
            prompt_position=0,
            prompt_log_probs=values,
            prompt_top_logprobs=rows,
        )
    )
    frames = [MSGPACK.decode_frame(data) for data in sent]
    assert len(frames) > 2 and all(len(d) <= 700 for d in sent)
    position = 0
    for frame in frames:
        assert frame.prompt_position == position
        assert len(frame.prompt_log_probs) == len(frame.prompt_top_logprobs)
        position += len(frame.prompt_log_probs)
    assert sum((f.prompt_log_probs for f in frames), []) == values
    assert sum((f.prompt_top_logprobs for f in frames), []) == rows
