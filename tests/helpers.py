"""Shared test helpers: raw request/response exchange and the alignment checks."""

from __future__ import annotations

from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from messages.frames import TopLogprob
from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
from worker.client import micro_error
from worker.tokens import TokenTable


def make_request(
    request_id: str,
    token_ids: list[int],
    *,
    max_tokens: int = 8,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    n: int = 1,
    temperature: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = True,
    **stop: Any,
) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        sampling_options=SamplingOptions(n=n, temperature=temperature, seed=seed),
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=ignore_eos, **stop),
        output_options=OutputOptions(logprobs=logprobs, prompt_logprobs=prompt_logprobs),
    )


async def exchange(
    nc: NATS,
    subject: str,
    payload: bytes,
    *,
    json: bool = False,
    choices: int = 1,
    timeout: float = 60.0,
) -> list[bytes]:
    """Raw frames of one request until every choice ended or an error frame came."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    headers = {"Content-Type": "application/json"} if json else None
    decode = msgspec.json.decode if json else msgspec.msgpack.decode
    raw: list[bytes] = []
    finished: set[int] = set()
    try:
        await nc.publish(subject, payload, reply=inbox, headers=headers)
        while len(finished) < choices:
            msg = await subscription.next_msg(timeout=timeout)
            if not msg.data:
                if (error := micro_error(msg)) is not None:
                    raise error
                continue  # liveness probe
            raw.append(msg.data)
            frame = decode(msg.data)
            if frame["finish_reason"] == "error":
                break
            if frame["finish_reason"] is not None:
                finished.add(frame["index"])
    finally:
        await subscription.unsubscribe()
    return raw


def check_row(
    row: list[TopLogprob], token_id: int, logprob: float, k: int, table: TokenTable
) -> None:
    """One top_logprobs row: top-k by rank, the chosen token present with the same logprob."""
    ranks = [entry.rank for entry in row]
    assert ranks[: min(k, len(ranks))] == list(range(1, min(k, len(ranks)) + 1)), ranks
    chosen = [entry for entry in row if entry.token_id == token_id]
    assert len(chosen) == 1, (token_id, row)
    assert chosen[0].logprob == logprob
    if chosen[0].rank > k:
        assert len(row) == k + 1 and row[-1] is chosen[0]
    else:
        assert len(row) == k
    for entry in row:
        assert entry.bytes == table.byte_values[entry.token_id]
        assert entry.token == table.texts[entry.token_id]
    assert all(a.logprob >= b.logprob for a, b in zip(row[:k], row[1:k], strict=False))
