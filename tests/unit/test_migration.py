"""worker/client/migration.py: what a continuation asks for and how its frames join the caller's
stream (the legs themselves, over NATS: tests/integration/test_migration.py)."""

from __future__ import annotations

import pytest
from msgspec import UNSET

from messages.frames import ErrorInfo, ResponseFrame, TopLogprob, Usage
from messages.request import INT64_MAX, GuidedDecoding
from worker.client.migration import Seam
from worker.client.requests import make_request

pytestmark = pytest.mark.unit

PROMPT = [1, 2, 3, 4]


def row(token: int) -> list[TopLogprob]:
    return [TopLogprob(1, token, f"t{token}", -0.5, b"t")]


def tokens(seq: int, ids: list[int], finish: str | None = None, **fields) -> ResponseFrame:
    return ResponseFrame(
        request_id="r",
        seq=seq,
        token_ids=ids,
        log_probs=[-0.5] * len(ids),
        top_logprobs=[row(t) for t in ids],
        finish_reason=finish,
        **fields,
    )


def test_a_continuation_is_the_prompt_plus_what_was_received_with_what_remains() -> None:
    request = make_request("r", PROMPT, max_tokens=10, logprobs=5, seed=7, temperature=1.0)
    request.stop_conditions.min_tokens = 4
    request.stop_conditions.stop = ["END"]
    request.timeout_ms = 60_000
    seam = Seam(request)
    for seq, ids in enumerate([[10, 11], [12]]):
        seam.translate(tokens(seq, ids))
    leg = seam.continuation()
    assert leg is not None
    assert leg.request_id == "r"
    assert leg.token_ids == [1, 2, 3, 4, 10, 11, 12]
    assert leg.continued_tokens == 3  # stop strings match across the seam
    assert leg.stop_conditions.max_tokens == 7
    assert leg.stop_conditions.min_tokens == 1
    assert leg.stop_conditions.stop == ["END"]
    assert leg.output_options.logprobs == 5
    assert leg.sampling_options.temperature == 1.0
    assert leg.sampling_options.seed == 7 + 3  # documented: seed + tokens received
    assert 59_000 < leg.timeout_ms <= 60_000
    assert request.token_ids == PROMPT  # the original is untouched


def test_min_tokens_reached_and_no_max_tokens_and_a_seed_at_the_int64_edge() -> None:
    request = make_request("r", PROMPT, seed=INT64_MAX)
    request.stop_conditions.max_tokens = None
    request.stop_conditions.min_tokens = 1
    seam = Seam(request)
    seam.translate(tokens(0, [10, 11]))
    leg = seam.continuation()
    assert leg is not None
    assert leg.stop_conditions.max_tokens is None
    assert leg.stop_conditions.min_tokens is None
    assert leg.sampling_options.seed == -(2**63) + 1  # wrapped into vLLM's int64


def test_frames_of_every_leg_make_one_stream_with_the_original_usage() -> None:
    seam = Seam(make_request("r", PROMPT, max_tokens=5, logprobs=1))
    out = [seam.translate(tokens(0, [10])), seam.translate(tokens(1, [11], attempt=UNSET))]
    assert seam.continuation() is not None
    # The continuation's own seq starts at 0, its usage counts its longer prompt.
    continued = tokens(0, [12, 13, 14], "length", completion_usage=Usage(6, 3, 9))
    out.append(seam.translate(continued))
    assert [f.seq for f in out] == [0, 1, 2]
    assert sum((f.token_ids for f in out), []) == [10, 11, 12, 13, 14]
    assert all(len(f.log_probs) == len(f.top_logprobs) == len(f.token_ids) for f in out)
    assert out[-1].finish_reason == "length"
    assert out[-1].completion_usage == Usage(4, 5, 9)


def test_prompt_logprob_rows_are_not_sent_twice() -> None:
    request = make_request("r", PROMPT, max_tokens=4)
    request.output_options.prompt_logprobs = 1
    seam = Seam(request)
    first = tokens(0, [], prompt_position=0, prompt_log_probs=[None, -1.0])
    first.prompt_top_logprobs = [None, row(2)]
    seam.translate(first)
    leg = seam.continuation()
    assert leg is not None and leg.output_options.prompt_logprobs == 1  # two rows missing
    # The continuation sends rows 0-3 of the original prompt and 4 of its own (an output token).
    again = tokens(0, [], prompt_position=0, prompt_log_probs=[None, -1.0, -2.0, -3.0, -4.0])
    again.prompt_top_logprobs = [None, row(2), row(3), row(4), row(10)]
    out = seam.translate(again)
    assert out is not None and out.seq == 1
    assert out.prompt_position == 2 and out.prompt_log_probs == [-2.0, -3.0]
    assert out.prompt_top_logprobs == [row(3), row(4)]
    # A frame whose rows were all received before is dropped, not sent empty.
    assert seam.translate(tokens(1, [], prompt_position=0, prompt_log_probs=[None])) is None
    # Once every row came, a continuation does not ask for them again.
    later = seam.continuation()
    assert later is not None and later.output_options.prompt_logprobs is None


def test_every_token_received_ends_with_a_length_frame_of_its_own() -> None:
    seam = Seam(make_request("r", PROMPT, max_tokens=2))
    seam.translate(tokens(0, [10, 11]))
    assert seam.continuation() is None
    final = seam.final_frame()
    assert (final.seq, final.finish_reason, final.token_ids) == (1, "length", [])
    assert final.completion_usage == Usage(4, 2, 6)


def test_what_is_never_continued_says_why() -> None:
    assert Seam(make_request("r", PROMPT)).why_not_continued() is None
    assert "n > 1" in Seam(make_request("r", PROMPT, n=2)).why_not_continued()
    guided = make_request("r", PROMPT)
    guided.sampling_options.guided_decoding = GuidedDecoding(regex="[ab]+")
    assert "guided_decoding" in Seam(guided).why_not_continued()


def test_an_error_frame_keeps_its_code_and_takes_the_next_seq() -> None:
    seam = Seam(make_request("r", PROMPT, max_tokens=9))
    seam.translate(tokens(0, [10]))
    assert seam.continuation() is not None  # the continuation's own seq starts over
    error = ResponseFrame(
        request_id="r",
        seq=5,
        finish_reason="error",
        error=ErrorInfo("worker_shutdown", "drain timed out"),
    )
    out = seam.translate(error)
    assert out is not None and out.seq == 1 and out.error.code == "worker_shutdown"
