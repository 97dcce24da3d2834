"""Malformed and hostile payloads on the core intake, on a real nats-server with workers on the
paced fake engine (the tiny model's limits, so the refusals name the numbers the real engine's
would): each gets exactly one invalid_request error frame naming the field, a worker bug is an
internal_error, and the worker serves on. The JetStream intake's are in test_jetstream_intake.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
from hypothesis import given

from messages.codec import MSGPACK
from messages.subjects import Subjects
from tests.fuzzing import (
    DEEP_JSON,
    DEEP_MSGPACK,
    fuzz_settings,
    hostile_payloads,
    locally_valid,
)
from tests.helpers import exchange, frame_list
from tests.integration.conftest import paced, worker_config
from worker.client import complete
from worker.client.requests import make_request
from worker.config import JetStreamSettings
from worker.nats.runtime import WorkerRuntime, open_worker

PROMPT = [1, 300, 301, 302]


@pytest.fixture(scope="module")
async def core_worker(nats_server) -> AsyncIterator[WorkerRuntime]:
    """One core-mode worker for the module, on an unpaced fake engine with the tiny model's
    limits (a request served by mistake ends at once)."""
    config = worker_config(nats_server.url, Subjects("malformed", "vllm", "generate"))
    worker = await open_worker(paced(0.0), config)
    yield worker
    await worker.stop()


def subject_of(worker: WorkerRuntime) -> str:
    return worker.config.subjects.generate


# --- fuzzing: hostile payloads, each must get exactly one invalid_request error frame ---


@pytest.fixture(scope="module")
def fuzz_seen() -> dict[str, int]:
    """How many fuzzed payloads were invalid (sent) and valid (skipped), for the check after."""
    return {"invalid": 0, "valid": 0}


@fuzz_settings(2000)
@given(case=hostile_payloads())
async def test_fuzz_hostile_payloads_each_get_an_error_frame(
    core_worker, client, fuzz_seen, case
) -> None:
    data, as_json = case
    # The fake engine refuses nothing of its own (vLLM also refuses huge temperatures): what the
    # worker admits is served, so only what the worker itself must refuse is sent.
    if locally_valid(data, as_json, core_worker.service.limits, engine_checks=False):
        fuzz_seen["valid"] += 1
        return  # a legitimate request by chance: not what this test is about
    fuzz_seen["invalid"] += 1
    room = client.max_payload - 512  # the server counts headers too; more is a protocol error
    if len(data) > room:
        data = data[:room]
    try:
        raw = await exchange(client, subject_of(core_worker), data, json=as_json, timeout=5)
    except Exception as error:
        raise AssertionError(f"no answer to {data[:300]!r} (json={as_json})") from error
    assert len(raw) == 1
    frame = (msgspec.json.decode if as_json else msgspec.msgpack.decode)(raw[0])
    assert frame["finish_reason"] == "error"
    assert frame["error"]["code"] == "invalid_request", frame


async def test_fuzz_ran_enough_and_worker_still_serves(core_worker, client, fuzz_seen) -> None:
    assert fuzz_seen["invalid"] >= 2000 * 0.9, fuzz_seen
    good = await complete(
        client,
        make_request("after-fuzz", PROMPT, max_tokens=4, logprobs=2),
        subject=subject_of(core_worker),
    )
    assert good.choices[0].finish_reason == "length"
    assert core_worker.service.engine.num_unfinished_requests() == 0


# --- each rule, named in its error frame ---------------------------------------------------------


def _req(**fields) -> dict:
    return {"request_id": "bad", "token_ids": [1, 2, 3]} | fields


BAD_INPUTS = [
    ("garbage-bytes", b"\xc1\xff\x00garbage", False, "invalid payload", "malformed"),
    ("garbage-json", b"{not json", True, "invalid payload", "JSON is malformed"),
    ("not-a-map", msgspec.msgpack.encode([1, 2, 3]), False, "invalid payload", "Expected `object`"),
    (
        "token-ids-type",
        msgspec.msgpack.encode(_req(token_ids="abc")),
        False,
        "$.token_ids",
        "Expected `array`",
    ),
    (
        "empty-token-ids",
        msgspec.msgpack.encode(_req(token_ids=[])),
        False,
        "$.token_ids",
        "length >= 1",
    ),
    (
        "logprobs-abc",
        msgspec.msgpack.encode(_req(output_options={"logprobs": "abc"})),
        False,
        "$.output_options.logprobs",
        "Expected `int | null`, got `str`",
    ),
    (
        "logprobs-negative",
        msgspec.msgpack.encode(_req(output_options={"logprobs": -1})),
        False,
        "$.output_options.logprobs",
        ">= 0",
    ),
    (
        "logprobs-above-max",
        msgspec.msgpack.encode(_req(output_options={"logprobs": 21})),
        False,
        "output_options.logprobs",
        "must be <= 20 (the engine's max_logprobs), got 21",
    ),
    (
        "prompt-logprobs-above-max",
        msgspec.msgpack.encode(_req(output_options={"prompt_logprobs": 99})),
        False,
        "output_options.prompt_logprobs",
        "must be <= 20",
    ),
    (
        "token-out-of-vocab",
        msgspec.msgpack.encode(_req(token_ids=[1, 5000])),
        False,
        "token_ids[1]",
        "token id 5000 is outside the vocabulary (must be < 1024)",
    ),
    (
        "stop-token-out-of-vocab",
        msgspec.msgpack.encode(_req(stop_conditions={"stop_token_ids": [99999]})),
        False,
        "stop_conditions.stop_token_ids[0]",
        "outside the vocabulary",
    ),
    (
        "logit-bias-out-of-vocab",
        msgspec.msgpack.encode(_req(sampling_options={"logit_bias": {3: 1.0, 5000: 2.0}})),
        False,
        "sampling_options.logit_bias",
        "token id 5000 is outside the vocabulary (must be < 1024)",
    ),
    (
        "prompt-too-long",
        msgspec.msgpack.encode(_req(token_ids=[5] * 600)),
        False,
        "token_ids",
        "prompt of 600 tokens leaves no room to generate: must be < max_model_len 512",
    ),
    (
        "max-tokens-too-many",
        msgspec.msgpack.encode(_req(stop_conditions={"max_tokens": 510})),
        False,
        "stop_conditions.max_tokens",
        "prompt (3) + max_tokens (510) must be <= max_model_len 512",
    ),
    (
        "empty-stop-string",
        msgspec.msgpack.encode(_req(stop_conditions={"stop": ["\n", ""]})),
        False,
        "$.stop_conditions.stop[1]",
        "length >= 1",
    ),
    (
        "beam-search",
        msgspec.msgpack.encode(_req(sampling_options={"use_beam_search": True})),
        False,
        "sampling_options.use_beam_search",
        "not supported",
    ),
    (
        "n-too-large",
        msgspec.msgpack.encode(_req(sampling_options={"n": 100})),
        False,
        "sampling_options.n",
        "must be <= 16",
    ),
    (
        "temperature-string",
        msgspec.json.encode(_req(sampling_options={"temperature": "hot"})),
        True,
        "$.sampling_options.temperature",
        "Expected `float | null`, got `str`",
    ),
    (
        "missing-request-id",
        msgspec.msgpack.encode({"token_ids": [1]}),
        False,
        "invalid payload",
        "missing required field `request_id`",
    ),
]


@pytest.mark.parametrize(
    ("payload", "json", "field", "rule"),
    [c[1:] for c in BAD_INPUTS],
    ids=[c[0] for c in BAD_INPUTS],
)
async def test_bad_input_gets_one_error_frame_then_good_request_served(
    core_worker, client, payload: bytes, json: bool, field: str, rule: str
) -> None:
    subject = subject_of(core_worker)
    raw = await exchange(client, subject, payload, json=json, timeout=30)
    assert len(raw) == 1
    wire = (msgspec.json.decode if json else msgspec.msgpack.decode)(raw[0])
    assert wire["finish_reason"] == "error"
    assert wire["error"]["code"] == "invalid_request"
    assert field in wire["error"]["message"] and rule in wire["error"]["message"], wire["error"][
        "message"
    ]
    assert wire["seq"] == 0
    if b"bad" in payload:
        assert wire["request_id"] == "bad"
    good = await complete(
        client, make_request("after-bad", PROMPT, max_tokens=2, logprobs=1), subject=subject
    )
    assert good.choices[0].finish_reason == "length" and len(good.choices[0].token_ids) == 2


@pytest.mark.parametrize(
    "payload,as_json",
    [(DEEP_JSON, True), (DEEP_MSGPACK, False)],
    ids=["json", "msgpack"],
)
async def test_deep_nesting_in_core_mode_is_invalid_request(
    core_worker, client, payload: bytes, as_json: bool
) -> None:
    frames = await frame_list(client, subject_of(core_worker), payload, json=as_json)
    assert [f["finish_reason"] for f in frames] == ["error"]
    assert frames[0]["error"]["code"] == "invalid_request"
    assert frames[0]["error"]["message"] == "invalid payload: nested too deeply to decode"


def _json_request(**sampling: int) -> bytes:
    fields = ",".join(f'"{name}":{value}' for name, value in sampling.items())
    return (
        b'{"request_id":"big-int","token_ids":[1,2,3],"stop_conditions":{"max_tokens":4},'
        b'"sampling_options":{' + fields.encode() + b"}}"
    )


# (payload, as_json, the field the error must name)
OUT_OF_RANGE = [
    (_json_request(seed=2**70), True, "sampling_options.seed"),
    (_json_request(seed=2**64 - 1), True, "sampling_options.seed"),
    (_json_request(seed=-(2**63) - 1), True, "sampling_options.seed"),
    (_json_request(top_k=2**70), True, "sampling_options.top_k"),
    (_json_request(top_k=2**40), True, "sampling_options.top_k"),
    (
        MSGPACK.encode(
            {"request_id": "big-int", "token_ids": [1], "sampling_options": {"seed": 2**64 - 1}}
        ),
        False,
        "sampling_options.seed",
    ),
    (
        MSGPACK.encode(
            {"request_id": "big-int", "token_ids": [1], "sampling_options": {"top_k": 2**63}}
        ),
        False,
        "sampling_options.top_k",
    ),
    (
        MSGPACK.encode({"request_id": "big-int", "token_ids": [1], "timeout_ms": 2**62}),
        False,
        "timeout_ms",
    ),
    (
        MSGPACK.encode(
            {
                "request_id": "big-int",
                "token_ids": [1],
                "sampling_options": {"temperature": float("inf")},
            }
        ),
        False,
        "sampling_options.temperature",
    ),
]


@pytest.mark.parametrize("payload,as_json,field_name", OUT_OF_RANGE)
async def test_out_of_range_integers_are_invalid_request_naming_the_field_in_both_modes(
    core_worker, queue_worker, client, payload: bytes, as_json: bool, field_name: str
) -> None:
    core = await frame_list(client, subject_of(core_worker), payload, json=as_json)
    subjects = Subjects("bigint", "vllm", "generate")
    await queue_worker(subjects, JetStreamSettings(), paced(0.0))
    queued = await frame_list(client, subjects.queue, payload, json=as_json, jetstream=True)
    for frames in (core, queued):
        assert len(frames) == 1 and frames[0]["finish_reason"] == "error"
        error = frames[0]["error"]
        assert error["code"] == "invalid_request", error
        assert field_name in error["message"], error
        assert frames[0]["request_id"] == "big-int"  # readable, so carried
    assert queued[0]["attempt"] == 1


# --- the operator's limits -----------------------------------------------------------------------


async def test_oversized_payload_error_carries_its_request_id(fake_worker, client) -> None:
    subjects = Subjects("oversize", "vllm", "generate")
    await fake_worker(subjects, max_request_bytes=1000)
    request = make_request("too-big-1", [1] * 1200)
    frames = await frame_list(client, subjects.generate, MSGPACK.encode(request))
    assert frames[0]["error"]["code"] == "invalid_request"
    assert "exceeds max_request_bytes 1000" in frames[0]["error"]["message"]
    assert frames[0]["request_id"] == "too-big-1"


async def test_operator_limits_a_publisher_cannot_lift(fake_worker, client) -> None:
    subjects = Subjects("limits", "vllm", "generate")
    await fake_worker(subjects, max_request_bytes=2000, max_tokens_limit=8, max_n=2)

    async def error_of(payload: bytes) -> str:
        raw = await exchange(client, subjects.generate, payload)
        frame = msgspec.msgpack.decode(raw[0])
        assert frame["finish_reason"] == "error" and frame["error"]["code"] == "invalid_request"
        return frame["error"]["message"]

    assert "exceeds max_request_bytes 2000" in await error_of(
        MSGPACK.encode(make_request("big", [300] * 1000))
    )
    assert "must be <= 8 (the worker's max_tokens limit), got 9" in await error_of(
        MSGPACK.encode(make_request("many", PROMPT, max_tokens=9))
    )
    assert "sampling_options.n: must be <= 2" in await error_of(
        MSGPACK.encode(make_request("n3", PROMPT, n=3))
    )
    # Without max_tokens the cap applies instead of the whole context.
    capped = make_request("capped", PROMPT)
    capped.stop_conditions.max_tokens = None
    result = await complete(client, capped, subject=subjects.generate)
    assert result.choices[0].usage.completion_tokens == 8


async def test_a_handler_failure_is_an_internal_error_frame_and_the_worker_serves_on(
    fake_worker, client, monkeypatch
) -> None:
    subjects = Subjects("fails", "vllm", "generate")
    served = await fake_worker(subjects)
    admit = served.service.accept

    async def broken(delivery) -> None:
        raise RuntimeError("accept broke")

    monkeypatch.setattr(served.service, "accept", broken)
    raw = await exchange(client, subjects.generate, MSGPACK.encode(make_request("x", PROMPT)))
    frame = msgspec.msgpack.decode(raw[0])
    assert frame["seq"] == 0 and frame["finish_reason"] == "error"
    assert frame["error"]["code"] == "internal_error"
    assert "accept broke" in frame["error"]["message"]
    monkeypatch.setattr(served.service, "accept", admit)
    after = await complete(
        client, make_request("y", PROMPT, max_tokens=2), subject=subjects.generate
    )
    assert after.choices[0].finish_reason == "length"
