"""End to end on a real nats-server and the real vLLM engine (CPU): the core request path's
tokens and logprobs, checked against the engine in-process and against transformers, its
frames' alignment, prompt logprobs and finish reasons.

The core intake itself on the fake engines (bad payloads, the reply and instance subjects, JSON
in and out): tests/integration/test_core_intake.py and test_malformed_payloads.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import LlamaForCausalLM

from messages.codec import MSGPACK
from tests.helpers import TEST_MAX_PAYLOAD, TEST_SUBJECTS, check_row, exchange, raw_frames
from worker.client import complete, fold
from worker.client.requests import make_request

SUBJECT = TEST_SUBJECTS.generate
PROMPT = [1, 300, 301, 302, 400, 401]


@pytest.fixture(scope="module")
def hf_model(tiny_model: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def hf_logprobs(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the next-token logits at every position (row i predicts token i+1)."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def wire_maps(raw: list[bytes]) -> list[dict]:
    return [msgspec.msgpack.decode(data) for data in raw]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
async def test_alignment_invariants_on_every_frame(worker, client, engine, k: int, n: int) -> None:
    assert k <= engine.limits.max_logprobs == 20
    request = make_request(
        f"align-{k}-{n}", PROMPT, max_tokens=12, logprobs=k, n=n, temperature=1.0, seed=11
    )
    raw = await exchange(client, SUBJECT, MSGPACK.encode(request), choices=n)
    frames = [MSGPACK.decode_frame(data) for data in raw]
    assert [f.seq for f in frames] == list(range(len(frames)))
    finals = {}
    for frame, wire in zip(frames, wire_maps(raw), strict=True):
        assert wire["request_id"] == f"align-{k}-{n}"
        assert len(wire["log_probs"]) == len(wire["top_logprobs"]) == len(wire["token_ids"])
        assert frame.index in range(n)
        assert frame.index not in finals, "no frame for a choice after its final frame"
        for token_id, logprob, row in zip(
            frame.token_ids, frame.log_probs, frame.top_logprobs, strict=True
        ):
            check_row(row, token_id, logprob, k, engine.table)
        if wire["finish_reason"] is not None:
            finals[frame.index] = wire
    assert sorted(finals) == list(range(n))
    for final in finals.values():
        assert final["finish_reason"] == "length"
        assert final["completion_usage"] == {
            "prompt_tokens": len(PROMPT),
            "completion_tokens": 12,
            "total_tokens": len(PROMPT) + 12,
        }
    result = fold(request.request_id, frames, n)
    assert all(
        len(c.token_ids) == len(c.log_probs) == len(c.top_logprobs) == 12 for c in result.choices
    )
    if n == 2:
        assert result.choices[0].token_ids != result.choices[1].token_ids


async def test_no_logprobs_asked_means_no_logprob_fields(worker, client) -> None:
    raw = await exchange(
        client, SUBJECT, MSGPACK.encode(make_request("plain", PROMPT, max_tokens=4))
    )
    for wire in wire_maps(raw):
        assert "log_probs" not in wire and "top_logprobs" not in wire
        assert set(wire) <= {
            "request_id",
            "seq",
            "index",
            "token_ids",
            "finish_reason",
            "completion_usage",
        }
    assert sum(len(w["token_ids"]) for w in wire_maps(raw)) == 4


async def test_greedy_equals_in_process_engine_and_transformers(
    worker, client, engine, hf_model
) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    k = 5
    request = make_request("greedy", PROMPT, max_tokens=16, logprobs=k, prompt_logprobs=k)
    result = await complete(client, request, subject=SUBJECT)
    choice = result.choices[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 16

    # The same engine in-process, through vLLM's default (dict-shaped, detokenized) output path.
    params = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=k, prompt_logprobs=k
    )
    final = None
    async for out in engine.llm.generate(
        TokensPrompt(prompt_token_ids=PROMPT), params, "inproc-greedy"
    ):
        final = out
    ref = final.outputs[0]
    assert choice.token_ids == list(ref.token_ids)
    for token_id, logprob, row, ref_pos in zip(
        choice.token_ids, choice.log_probs, choice.top_logprobs, ref.logprobs, strict=True
    ):
        assert logprob == ref_pos[token_id].logprob
        assert {(e.token_id, e.rank, e.logprob) for e in row} == {
            (tid, lp.rank, lp.logprob) for tid, lp in ref_pos.items()
        }
    assert result.prompt_log_probs[0] is None and final.prompt_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        ref_pos = final.prompt_logprobs[position]
        assert result.prompt_log_probs[position] == ref_pos[PROMPT[position]].logprob
        assert {e.token_id for e in result.prompt_top_logprobs[position]} == set(ref_pos)

    # An independent forward pass on the same weights (fp32): values within 1e-4, same top-k.
    full = PROMPT + choice.token_ids
    lp = hf_logprobs(hf_model, full)
    for j, (token_id, logprob, row) in enumerate(
        zip(choice.token_ids, choice.log_probs, choice.top_logprobs, strict=True)
    ):
        dist = lp[len(PROMPT) + j - 1]
        assert abs(logprob - dist[token_id].item()) < 1e-4
        assert int(dist.argmax()) == token_id  # greedy
        assert [e.token_id for e in row[:k]] == dist.topk(k).indices.tolist()
        for entry in row:
            assert abs(entry.logprob - dist[entry.token_id].item()) < 1e-4
    for position in range(1, len(PROMPT)):
        dist = lp[position - 1]
        assert abs(result.prompt_log_probs[position] - dist[PROMPT[position]].item()) < 1e-4
        chosen = next(
            e for e in result.prompt_top_logprobs[position] if e.token_id == PROMPT[position]
        )
        assert chosen.rank == int((dist > dist[PROMPT[position]]).sum()) + 1


async def test_prompt_logprobs_complete_split_and_before_tokens(
    worker, client, engine, hf_model
) -> None:
    prompt = [1] + [(i * 37) % 1000 + 3 for i in range(399)]
    request = make_request("prompt-lp", prompt, max_tokens=3, logprobs=2, prompt_logprobs=20)
    raw = await exchange(client, SUBJECT, MSGPACK.encode(request))
    assert all(len(data) <= TEST_MAX_PAYLOAD for data in raw)
    frames = [MSGPACK.decode_frame(data) for data in raw]
    prompt_frames = [f for f in frames if f.prompt_log_probs]
    assert len(prompt_frames) > 1, "400 rows x 21 entries do not fit in 32 KiB: must be split"
    first_token_frame = next(i for i, f in enumerate(frames) if f.token_ids)
    assert all(i < first_token_frame for i, f in enumerate(frames) if f.prompt_log_probs)
    result = fold(request.request_id, frames, 1)
    assert len(result.prompt_log_probs) == len(result.prompt_top_logprobs) == len(prompt)
    assert result.prompt_log_probs[0] is None and result.prompt_top_logprobs[0] is None
    lp = hf_logprobs(hf_model, prompt)
    for position in range(1, len(prompt)):
        row = result.prompt_top_logprobs[position]
        check_row(row, prompt[position], result.prompt_log_probs[position], 20, engine.table)
        assert (
            abs(result.prompt_log_probs[position] - lp[position - 1][prompt[position]].item())
            < 1e-4
        )
    assert len(result.choices[0].token_ids) == 3


async def test_sixteen_concurrent_streams_interleave_and_stay_correct(
    worker, client, engine, hf_model
) -> None:
    arrivals: list[str] = []
    prompts = {f"conc-{i}": [1, 10 + i, 200 + 3 * i, 500 + i] for i in range(16)}

    async def one(request_id: str, prompt: list[int]):
        request = make_request(request_id, prompt, max_tokens=24, logprobs=5)
        frames = []
        async for data in _stream_raw(client, request):
            arrivals.append(request_id)
            frames.append(MSGPACK.decode_frame(data))
        return fold(request_id, frames, 1)

    results = await asyncio.gather(*(one(rid, p) for rid, p in prompts.items()))
    switches = sum(1 for a, b in zip(arrivals, arrivals[1:], strict=False) if a != b)
    assert switches > 16, "frames of concurrent streams should interleave"
    for result in results:
        assert all(f.request_id == result.request_id for f in result.frames)
        choice = result.choices[0]
        assert choice.finish_reason == "length" and len(choice.token_ids) == 24
        full = prompts[result.request_id] + choice.token_ids
        lp = hf_logprobs(hf_model, full)
        for j, (token_id, logprob, row) in enumerate(
            zip(choice.token_ids, choice.log_probs, choice.top_logprobs, strict=True)
        ):
            check_row(row, token_id, logprob, 5, engine.table)
            assert abs(logprob - lp[len(full) - 24 + j - 1][token_id].item()) < 1e-4


async def _stream_raw(client, request):
    inbox = client.new_inbox()
    subscription = await client.subscribe(inbox)
    await client.publish(SUBJECT, MSGPACK.encode(request), reply=inbox)
    try:
        async for data in raw_frames(subscription, timeout=60):
            yield data
    finally:
        await subscription.unsubscribe()


async def test_finish_reasons_eos_stop_length(worker, client) -> None:
    base = await complete(client, make_request("fr-base", PROMPT, max_tokens=6), subject=SUBJECT)
    greedy = base.choices[0].token_ids
    assert base.choices[0].finish_reason == "length"

    eos = make_request("fr-eos", PROMPT, max_tokens=6, ignore_eos=False)
    eos.eos_token_ids = [greedy[2]]
    got = (await complete(client, eos, subject=SUBJECT)).choices[0]
    assert (got.finish_reason, got.token_ids) == ("eos", greedy[:3])

    stop = make_request("fr-stop", PROMPT, max_tokens=6, stop_token_ids=[greedy[1]])
    got = (await complete(client, stop, subject=SUBJECT)).choices[0]
    assert (got.finish_reason, got.token_ids) == ("stop", greedy[:2])
    assert got.usage is not None and got.usage.completion_tokens == 2

    ignored = make_request("fr-ignore", PROMPT, max_tokens=6, ignore_eos=True)
    ignored.eos_token_ids = [greedy[2]]
    got = (await complete(client, ignored, subject=SUBJECT)).choices[0]
    assert (got.finish_reason, got.token_ids) == ("length", greedy)
