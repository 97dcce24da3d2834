"""Misfiled errors on the real vLLM engine's output path: a worker bug while building its rows
is an internal_error, and vLLM's bare EngineGenerateError still carries a message. Real
nats-server, the session's real engine.

The transport's faults on the fake engines (poison messages, broker outages and blips with
reconnecting clients, malformed payloads in both intakes, cancels that cross publishers) are
the integration layer's: tests/integration/test_broker_connection.py, test_jetstream_intake.py,
test_malformed_payloads.py and test_cancel_routing.py."""

from __future__ import annotations

from messages.codec import MSGPACK
from tests.helpers import frame_list
from worker.client.requests import make_request

PROMPT = [1, 300, 301, 302]


async def test_a_worker_bug_in_row_building_is_internal_error_not_invalid_request(
    worker, client, engine, monkeypatch
) -> None:
    from worker.engine import logprobs

    def broken_extract(*args, **kwargs):
        raise ValueError("zip() argument 2 is shorter than argument 1")

    monkeypatch.setattr(logprobs, "extract", broken_extract)
    frames = await frame_list(
        client,
        "test.vllm.generate",
        MSGPACK.encode(make_request("row-bug", PROMPT, max_tokens=4, logprobs=2)),
    )
    assert frames[-1]["finish_reason"] == "error"
    assert frames[-1]["error"]["code"] == "internal_error"
    assert frames[-1]["error"]["message"] == (
        "ValueError: zip() argument 2 is shorter than argument 1"
    )


async def test_a_bare_engine_error_still_has_a_message(worker, client, engine, monkeypatch) -> None:
    from vllm.v1.engine.exceptions import EngineGenerateError

    original = engine.llm.generate

    def failing_generate(prompt, params, request_id, **kwargs):
        async def outputs():
            async for out in original(prompt, params, request_id, **kwargs):
                try:
                    raise KeyError("lost state")
                except KeyError as error:
                    raise EngineGenerateError() from error  # what vLLM raises: no text
                yield out

        return outputs()

    monkeypatch.setattr(engine.llm, "generate", failing_generate)
    frames = await frame_list(
        client,
        "test.vllm.generate",
        MSGPACK.encode(make_request("bare-error", PROMPT, max_tokens=4)),
    )
    error = frames[-1]["error"]
    assert error["code"] == "engine_error"
    assert error["message"] == "EngineGenerateError: KeyError: 'lost state'"
