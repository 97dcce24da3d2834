"""`sampling_options.guided_decoding` end to end on the real engine, over raw NATS: each kind of
constraint (choice, regex, JSON schema, grammar) holds in msgpack and JSON, with logprob rows
aligned; the greedy output equals vLLM's own (`engine.llm.generate` with the same
StructuredOutputsParams); a constraint the backend refuses is one `invalid_request` frame naming
`sampling_options.guided_decoding` with the backend's reason, and the next request is served; the
same in JetStream mode.

The tiny random model runs ~100-300 tokens/s here: the constraints are small, and the JSON
schema's prompt is one whose greedy run closes the object on its own (finish_reason "eos").
"""

from __future__ import annotations

import inspect
import json
import math
import re
from typing import Any

import msgspec
import pytest

from messages.codec import JSON, MSGPACK, Codec
from messages.subjects import Subjects
from tests.helpers import TEST_SUBJECTS, check_row, exchange
from worker.client import jetstream_complete
from worker.config import JetStreamSettings, NatsConfig, WorkerConfig
from worker.frontend.tokenizer import ModelTokenizer

SUBJECT = TEST_SUBJECTS.generate
PROMPT = [1, 300, 301]
JSON_PROMPT = [1, 5, 6, 7]  # the tiny model's greedy run under SCHEMA ends by itself from here
MAX_TOKENS = 32
K = 3
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[a-c]{3}-[0-9]{2}"
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}},
    "required": ["color"],
    "additionalProperties": False,
}
GRAMMAR = 'root ::= "(" num "+" num ")"\nnum ::= [0-9]'
CODECS = pytest.mark.parametrize("codec", [MSGPACK, JSON], ids=["msgpack", "json"])


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model)


def _payload(codec: Codec, request_id: str, guided: dict[str, Any], **fields: Any) -> bytes:
    """A request as a client writes it: plain maps, the wire's field names spelled out."""
    body: dict[str, Any] = {
        "request_id": request_id,
        "token_ids": fields.pop("token_ids", PROMPT),
        "sampling_options": {"temperature": 0.0, "guided_decoding": guided}
        | fields.pop("sampling_options", {}),
        "stop_conditions": {"max_tokens": MAX_TOKENS},
        "output_options": {"logprobs": K},
    }
    return codec.encode(body | fields)


def _maps(codec: Codec, raw: list[bytes]) -> list[dict[str, Any]]:
    decode = msgspec.json.decode if codec is JSON else msgspec.msgpack.decode
    return [decode(data) for data in raw]


async def _served(client, engine, codec: Codec, request_id: str, guided: dict[str, Any], **fields):
    """One request's frames: each frame's rows aligned (and each row right by the table), one
    final frame. Returns the choice's token ids and the final frame's map.

    The rows are what vLLM reports for a constrained request: the chosen token's logprob is
    finite, and the tokens the constraint masked out have -inf where they fill the top k."""
    raw = await exchange(
        client, SUBJECT, _payload(codec, request_id, guided, **fields), json=codec is JSON
    )
    wires = _maps(codec, raw)
    assert all("error" not in wire for wire in wires), wires[-1]
    token_ids: list[int] = []
    for data, wire in zip(raw, wires, strict=True):
        assert len(wire["log_probs"]) == len(wire["token_ids"]) == len(wire["top_logprobs"])
        frame = codec.decode_frame(data)
        for token_id, logprob, row in zip(
            frame.token_ids, frame.log_probs or [], frame.top_logprobs or [], strict=True
        ):
            assert row is not None and logprob is not None and logprob > -math.inf
            if codec is MSGPACK:
                check_row(row, token_id, logprob, K, engine.table)
            else:  # JSON writes the -inf of the tokens the constraint masked as null
                assert token_id in [entry.token_id for entry in row]
        token_ids += wire["token_ids"]
    assert [w["finish_reason"] for w in wires].count(None) == len(wires) - 1
    final = wires[-1]
    assert final["completion_usage"]["completion_tokens"] == len(token_ids)
    return token_ids, final


async def _vllm(engine, request_id: str, prompt: list[int], **constraint: Any):
    """vLLM's own greedy answer under the same StructuredOutputsParams (its text detokenized by
    vLLM), on the same engine."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(**constraint),
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    final = None
    async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id):
        final = out
    assert final is not None
    return final.outputs[0]


@CODECS
async def test_a_choice_is_exactly_one_of_the_choices_as_vllm_gives_it(
    worker, client, engine, tokenizer: ModelTokenizer, codec: Codec
) -> None:
    token_ids, final = await _served(
        client, engine, codec, f"gd-choice-{codec.content_type}", {"choice": CHOICES}
    )
    assert final["finish_reason"] == "eos"  # the choice complete, only EOS was allowed
    text = tokenizer.text(token_ids)
    assert text in CHOICES
    reference = await _vllm(engine, f"gd-choice-ref-{codec.content_type}", PROMPT, choice=CHOICES)
    assert token_ids == list(reference.token_ids)
    assert text == reference.text


@CODECS
async def test_a_regex_is_fullmatched_as_vllm_gives_it(
    worker, client, engine, tokenizer: ModelTokenizer, codec: Codec
) -> None:
    token_ids, final = await _served(
        client, engine, codec, f"gd-regex-{codec.content_type}", {"regex": REGEX}
    )
    assert final["finish_reason"] == "eos"
    text = tokenizer.text(token_ids)
    assert re.fullmatch(REGEX, text), text
    reference = await _vllm(engine, f"gd-regex-ref-{codec.content_type}", PROMPT, regex=REGEX)
    assert token_ids == list(reference.token_ids)
    assert text == reference.text


@CODECS
@pytest.mark.parametrize("as_string", [False, True], ids=["object", "string"])
async def test_a_json_schema_run_that_ends_by_itself_validates(
    worker, client, engine, tokenizer: ModelTokenizer, codec: Codec, as_string: bool
) -> None:
    schema: dict[str, Any] | str = json.dumps(SCHEMA) if as_string else SCHEMA
    token_ids, final = await _served(
        client,
        engine,
        codec,
        f"gd-json-{codec.content_type}-{as_string}",
        {"json": schema},
        token_ids=JSON_PROMPT,
    )
    assert final["finish_reason"] == "eos"  # it closed the object, not cut at max_tokens
    assert len(token_ids) < MAX_TOKENS
    text = tokenizer.text(token_ids)
    answer = json.loads(text)  # valid against SCHEMA: exactly "color", one of its enum
    assert list(answer) == ["color"] and answer["color"] in SCHEMA["properties"]["color"]["enum"]
    reference = await _vllm(engine, "gd-json-ref", JSON_PROMPT, json=SCHEMA)
    assert token_ids == list(reference.token_ids)


@CODECS
async def test_a_grammar_is_followed(
    worker, client, engine, tokenizer: ModelTokenizer, codec: Codec
) -> None:
    token_ids, final = await _served(
        client, engine, codec, f"gd-grammar-{codec.content_type}", {"grammar": GRAMMAR}
    )
    assert final["finish_reason"] == "eos"
    text = tokenizer.text(token_ids)
    assert re.fullmatch(r"\([0-9]\+[0-9]\)", text), text
    reference = await _vllm(engine, "gd-grammar-ref", PROMPT, grammar=GRAMMAR)
    assert token_ids == list(reference.token_ids)


async def test_sampled_choices_each_hold_the_constraint_with_rows_aligned(
    worker, client, engine, tokenizer: ModelTokenizer
) -> None:
    payload = _payload(
        MSGPACK,
        "gd-n2",
        {"choice": CHOICES, "backend": "xgrammar"},
        sampling_options={"temperature": 1.0, "seed": 7, "n": 2},
    )
    wires = _maps(MSGPACK, await exchange(client, SUBJECT, payload, choices=2))
    for index in (0, 1):
        frames = [w for w in wires if w["index"] == index]
        assert [f["finish_reason"] for f in frames][-1] == "eos"
        for frame in frames:
            assert len(frame["log_probs"]) == len(frame["token_ids"]) == len(frame["top_logprobs"])
        text = tokenizer.text([t for f in frames for t in f["token_ids"]])
        assert text in CHOICES


async def _refused(client, codec: Codec, request_id: str, guided: dict[str, Any]) -> str:
    """The one frame a refused request gets; returns its error message."""
    raw = await exchange(client, SUBJECT, _payload(codec, request_id, guided), json=codec is JSON)
    (wire,) = _maps(codec, raw)
    assert wire["finish_reason"] == "error"
    assert wire["error"]["code"] == "invalid_request"
    return str(wire["error"]["message"])


async def _next_is_served(client, engine, tokenizer: ModelTokenizer, request_id: str) -> None:
    token_ids, final = await _served(client, engine, MSGPACK, request_id, {"choice": CHOICES})
    assert final["finish_reason"] == "eos" and tokenizer.text(token_ids) in CHOICES


@pytest.mark.parametrize(
    ("codec", "guided", "reason"),
    [
        (
            MSGPACK,
            {"regex": "(ab"},
            "Regex parsing error at position 4: The parenthesis is not closed",
        ),
        (JSON, {"regex": "(?i)abc"}, "Group modifier flag is not supported yet"),
        (JSON, {"json": {"type": "nonsense"}}, 'Unsupported type "nonsense"'),
        (
            MSGPACK,
            {"json": {"type": "array", "items": [{"type": "string"}]}},
            "items must be a boolean or an object",
        ),
        (MSGPACK, {"grammar": "root ::= undefined_rule"}, 'Rule "undefined_rule" is not defined'),
        (JSON, {"structural_tag": {"type": "nope"}}, "Invalid structural tag specification"),
    ],
    ids=[
        "bad-regex",
        "regex-xgrammar-lacks",
        "bad-schema",
        "tuple-items",
        "bad-grammar",
        "bad-tag",
    ],
)
async def test_a_constraint_the_backend_refuses_is_one_invalid_request_frame(
    worker, client, engine, tokenizer: ModelTokenizer, codec: Codec, guided: dict, reason: str
) -> None:
    message = await _refused(client, codec, "gd-refused", guided)
    assert message.startswith("sampling_options.guided_decoding: refused by xgrammar"), message
    assert reason in message, message
    await _next_is_served(client, engine, tokenizer, "gd-after-refused")
    assert engine.num_unfinished_requests() == 0


@pytest.mark.parametrize(
    ("guided", "prefix"),
    [
        (
            {"regex": "a", "choice": ["a"]},
            "sampling_options.guided_decoding: sets regex and choice",
        ),
        ({"choice": []}, "invalid payload: Expected `array` of length >= 1"),
        (
            {"regex": "a", "backend": "guidance"},
            "sampling_options.guided_decoding.backend: this engine runs structured outputs on "
            "'xgrammar'",
        ),
        (
            {"json": SCHEMA, "whitespace_pattern": "[ ]?"},
            "sampling_options.guided_decoding.whitespace_pattern: not supported",
        ),
    ],
    ids=["two-constraints", "empty-choice", "other-backend", "whitespace-pattern"],
)
async def test_what_the_worker_cannot_honour_is_refused_naming_the_field(
    worker, client, engine, tokenizer: ModelTokenizer, guided: dict, prefix: str
) -> None:
    for codec in (MSGPACK, JSON):
        message = await _refused(client, codec, "gd-unhonoured", guided)
        assert message.startswith(prefix), message
    await _next_is_served(client, engine, tokenizer, "gd-after-unhonoured")


def _core_survives_compile_errors() -> bool:
    """vLLM's engine core fails only the request whose grammar it cannot compile (0.32; vLLM PR
    #47312): older cores (0.24) die of it, which the worker's xgrammar check exists to avoid."""
    from vllm.v1.core.sched import scheduler

    return "grammar_compile_error_reqs" in inspect.getsource(scheduler)


async def test_vllms_own_refusals_map_to_invalid_request_too(
    worker, client, engine, tokenizer: ModelTokenizer, monkeypatch
) -> None:
    """Without the worker's xgrammar check, vLLM refuses in its two places, and both are the
    same invalid_request: at add_request (its "auto" validation, falling back to guidance,
    refuses an unclosed group), and in the engine core, whose latched xgrammar cannot compile
    what guidance accepted (`(?i)`): vLLM 0.32 ends that request with finish_reason "error"
    before any token; the worker names guided_decoding and serves the next request."""
    if not _core_survives_compile_errors():
        pytest.skip("this vLLM's engine core dies of a grammar it cannot compile")
    await _next_is_served(client, engine, tokenizer, "gd-latch")  # the core latches xgrammar
    monkeypatch.setattr(engine.structured, "pinned", False)
    message = await _refused(client, MSGPACK, "gd-vllm-validation", {"regex": "(ab"})
    assert message.startswith("sampling_options.guided_decoding: Grammar error: "), message
    assert "unclosed group" in message, message
    message = await _refused(client, JSON, "gd-core-compile", {"regex": "(?i)abc"})
    assert message == (
        "sampling_options.guided_decoding: vLLM's engine core could not compile the constraint "
        "with its xgrammar backend (the engine's log has the backend's reason)"
    )
    await _next_is_served(client, engine, tokenizer, "gd-after-core")
    assert engine.num_unfinished_requests() == 0


async def test_jetstream_mode_honours_guided_decoding(
    engine, nats_server, client, tokenizer: ModelTokenizer
) -> None:
    from worker.nats.runtime import open_worker

    subjects = Subjects("gdjs", "vllm", "generate")
    config = WorkerConfig(
        nats=NatsConfig(servers=[nats_server.url]),
        subjects=subjects,
        max_concurrency=8,
        jetstream=JetStreamSettings(capacity=8),
    )
    runtime = await open_worker(engine, config)
    try:
        for codec in (MSGPACK, JSON):
            served = codec.decode_request(_payload(codec, "gdjs-choice", {"choice": CHOICES}))
            completion, attempts = await jetstream_complete(
                client, served, subjects=subjects, codec=codec
            )
            assert attempts == [1] and completion.error is None
            (choice,) = completion.choices
            assert choice.finish_reason == "eos"
            assert tokenizer.text(choice.token_ids) in CHOICES
            assert len(choice.log_probs) == len(choice.token_ids) == len(choice.top_logprobs)

            refused = codec.decode_request(_payload(codec, "gdjs-refused", {"regex": "(ab"}))
            completion, attempts = await jetstream_complete(
                client, refused, subjects=subjects, codec=codec
            )
            assert attempts == [1]  # answered once, not redelivered
            assert completion.error is not None
            assert completion.error.code == "invalid_request"
            assert completion.error.message.startswith("sampling_options.guided_decoding: ")
            assert "The parenthesis is not closed" in completion.error.message
        regex = MSGPACK.decode_request(_payload(MSGPACK, "gdjs-regex", {"regex": REGEX}))
        completion, _ = await jetstream_complete(client, regex, subjects=subjects)
        assert re.fullmatch(REGEX, tokenizer.text(completion.choices[0].token_ids))
    finally:
        await runtime.stop()
