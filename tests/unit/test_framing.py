"""Frames never exceed max_payload; splitting keeps positions, order and the ending."""

from __future__ import annotations

import msgspec
import pytest
from msgspec import UNSET

from messages.codec import JSON, MSGPACK
from messages.frames import ErrorInfo, ResponseFrame, TopLogprob, Usage
from worker.framing import FrameTooLarge, FrameWriter, Undeliverable, split_frame


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


class Sink:
    """A publish that keeps what it is given; fails with `error` once `fail_at` frames are in."""

    def __init__(self, fail_at: int | None = None, error: Exception | None = None) -> None:
        self.sent: list[bytes] = []
        self.fail_at = fail_at
        self.error = error or Undeliverable("gone")

    async def publish(self, data: bytes) -> None:
        if self.fail_at is not None and len(self.sent) >= self.fail_at:
            raise self.error
        self.sent.append(data)


async def test_seq_counts_over_the_requests_frames_and_the_attempt_is_on_each() -> None:
    sink = Sink()
    writer = FrameWriter(MSGPACK, 1 << 20, sink.publish, attempt=3)
    for token in (5, 6, 7):
        await writer.send(ResponseFrame(request_id="r", seq=99, token_ids=[token]))
    wire = [msgspec.msgpack.decode(data) for data in sink.sent]
    assert [(w["seq"], w["attempt"], w["token_ids"]) for w in wire] == [
        (0, 3, [5]),
        (1, 3, [6]),
        (2, 3, [7]),
    ]
    assert writer.next_seq == writer.frames_sent == 3


async def test_without_an_attempt_the_field_is_absent() -> None:
    sink = Sink()
    writer = FrameWriter(MSGPACK, 1 << 20, sink.publish)
    await writer.send(ResponseFrame(request_id="r", seq=0, token_ids=[1]))
    assert "attempt" not in msgspec.msgpack.decode(sink.sent[0])


async def test_a_frame_without_rows_splits_its_tokens_and_keeps_rows_absent() -> None:
    sink = Sink()
    writer = FrameWriter(MSGPACK, 64, sink.publish)
    ids = list(range(1000, 1040))
    await writer.send(ResponseFrame(request_id="r", seq=0, token_ids=ids, finish_reason="stop"))
    assert len(sink.sent) > 1 and all(len(data) <= 64 for data in sink.sent)
    wire = [msgspec.msgpack.decode(data) for data in sink.sent]
    assert sum((w["token_ids"] for w in wire), []) == ids
    assert all("log_probs" not in w and "top_logprobs" not in w for w in wire)
    assert [w["finish_reason"] for w in wire] == [None] * (len(wire) - 1) + ["stop"]


async def test_a_json_frame_is_split_to_max_payload_too_and_the_error_stays_last() -> None:
    sink = Sink()
    writer = FrameWriter(JSON, 500, sink.publish)
    ids = list(range(10, 30))
    await writer.send(
        ResponseFrame(
            request_id="r",
            seq=0,
            token_ids=ids,
            log_probs=[-1.0] * 20,
            top_logprobs=[_row(i)[:1] for i in ids],
            finish_reason="cancelled",
            completion_usage=Usage(1, 20, 21),
            error=ErrorInfo("deadline_exceeded", "timeout_ms 5 passed"),
        )
    )
    assert len(sink.sent) > 1 and all(len(data) <= 500 for data in sink.sent)
    wire = [msgspec.json.decode(data) for data in sink.sent]
    assert ["error" in w for w in wire] == [False] * (len(wire) - 1) + [True]
    assert wire[-1]["error"]["code"] == "deadline_exceeded"
    assert [w["seq"] for w in wire] == list(range(len(wire)))


async def test_a_prompt_split_continues_from_the_frames_own_position() -> None:
    sink = Sink()
    writer = FrameWriter(MSGPACK, 200, sink.publish)
    values = [-0.1 * i for i in range(1, 101)]
    await writer.send(
        ResponseFrame(request_id="r", seq=0, prompt_position=100, prompt_log_probs=values)
    )
    frames = [MSGPACK.decode_frame(data) for data in sink.sent]
    assert len(frames) > 1
    assert frames[0].prompt_position == 100
    position = 100
    for frame in frames:
        assert frame.prompt_position == position
        position += len(frame.prompt_log_probs)  # type: ignore[arg-type]
    assert position == 200
    assert all(frame.prompt_top_logprobs is UNSET for frame in frames)


@pytest.mark.parametrize("prompt", [False, True], ids=["generated", "prompt"])
async def test_one_position_over_max_payload_raises_frame_too_large(prompt: bool) -> None:
    sink = Sink()
    writer = FrameWriter(MSGPACK, 100, sink.publish)
    wide = [TopLogprob(r, r, "x" * 30, -1.0, b"x") for r in range(1, 6)]
    if prompt:
        frame = ResponseFrame(
            request_id="r", seq=0, prompt_log_probs=[-1.0], prompt_top_logprobs=[wide]
        )
    else:
        frame = ResponseFrame(
            request_id="r", seq=0, token_ids=[1], log_probs=[-1.0], top_logprobs=[wide]
        )
    with pytest.raises(FrameTooLarge, match="position exceeds max_payload") as raised:
        await writer.send(frame)
    assert raised.value.code == "engine_error"
    assert sink.sent == [] and writer.next_seq == 0


async def test_a_failed_publish_propagates_and_is_not_counted() -> None:
    sink = Sink(fail_at=1)
    writer = FrameWriter(MSGPACK, 1 << 20, sink.publish)
    await writer.send(ResponseFrame(request_id="r", seq=0, token_ids=[1]))
    with pytest.raises(Undeliverable):
        await writer.send(ResponseFrame(request_id="r", seq=0, token_ids=[2]))
    assert writer.frames_sent == 1 and len(sink.sent) == 1


def test_split_frame_halves_by_position_and_only_the_tail_keeps_the_ending() -> None:
    frame = ResponseFrame(
        request_id="r",
        seq=4,
        index=2,
        token_ids=[1, 2, 3, 4, 5],
        log_probs=[-1.0, -2.0, -3.0, -4.0, -5.0],
        finish_reason="length",
        completion_usage=Usage(3, 5, 8),
    )
    head, tail = split_frame(frame)
    assert (head.token_ids, head.log_probs, tail.token_ids, tail.log_probs) == (
        [1, 2],
        [-1.0, -2.0],
        [3, 4, 5],
        [-3.0, -4.0, -5.0],
    )
    assert (head.finish_reason, head.completion_usage) == (None, UNSET)
    assert (tail.finish_reason, tail.completion_usage) == ("length", Usage(3, 5, 8))
    assert head.index == tail.index == 2 and head.top_logprobs is UNSET


async def test_a_split_that_fails_halfway_does_not_use_up_seq_numbers() -> None:
    sink = Sink()
    writer = FrameWriter(MSGPACK, 300, sink.publish)
    narrow = [TopLogprob(1, 5, "a", -0.1, b"a")]
    wide = [TopLogprob(r, r, "x" * 60, -0.1, b"x" * 60) for r in range(1, 6)]
    with pytest.raises(FrameTooLarge):
        await writer.send(
            ResponseFrame(
                request_id="r",
                seq=0,
                token_ids=[5, 6],
                log_probs=[-0.1, -0.2],
                top_logprobs=[narrow, wide],
            )
        )
    assert sink.sent == []
    assert writer.next_seq == 0
