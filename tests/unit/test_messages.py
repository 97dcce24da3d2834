"""Wire contract: field names, strict types, unknown fields, both encodings (no engine)."""

from __future__ import annotations

import math
import subprocess
import sys

import msgspec
import pytest

from messages import (
    FINISH_REASONS,
    GenerateRequest,
    ResponseFrame,
    Subjects,
    TopLogprob,
    Usage,
    codec_for,
)
from messages.codec import JSON, MSGPACK

FULL_REQUEST = {
    "request_id": "r-1",
    "token_ids": [1, 2, 3],
    "sampling_options": {
        "n": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
    },
    "stop_conditions": {
        "max_tokens": 8,
        "min_tokens": 1,
        "stop_token_ids": [9],
        "ignore_eos": True,
        "stop": ["\n\n", "END"],
        "include_stop_str_in_output": True,
    },
    "output_options": {"logprobs": 5, "prompt_logprobs": 2},
    "eos_token_ids": [2],
    "annotations": ["a"],
    # Routing fields a frontend adds: ignored.
    "model": "tiny",
    "backend_instance_id": 12,
    "mdc_sum": "x",
}


def test_messages_imports_only_msgspec() -> None:
    code = (
        "import sys, messages, messages.codec, messages.subjects\n"
        "bad = {'vllm', 'torch', 'nats', 'transformers'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("codec", [MSGPACK, JSON], ids=["msgpack", "json"])
def test_request_fields_by_dynamo_names(codec) -> None:
    encode = msgspec.msgpack.encode if codec is MSGPACK else msgspec.json.encode
    request = codec.decode_request(encode(FULL_REQUEST))
    assert request.request_id == "r-1"
    assert request.token_ids == [1, 2, 3]
    s = request.sampling_options
    assert (s.n, s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (2, 0.5, 0.9, 40, 0.05, 7)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.1, 0.2, 1.1)
    c = request.stop_conditions
    assert (c.max_tokens, c.min_tokens, c.stop_token_ids, c.ignore_eos) == (8, 1, [9], True)
    assert (c.stop, c.include_stop_str_in_output) == (["\n\n", "END"], True)
    assert (request.output_options.logprobs, request.output_options.prompt_logprobs) == (5, 2)
    assert request.eos_token_ids == [2]
    assert request.annotations == ["a"]


@pytest.mark.parametrize(
    ("patch", "path", "rule"),
    [
        ({"token_ids": []}, "$.token_ids", "length >= 1"),
        ({"token_ids": "abc"}, "$.token_ids", "Expected `array`"),
        ({"token_ids": [1, -4]}, "$.token_ids[1]", ">= 0"),
        ({"token_ids": [1, True]}, "$.token_ids[1]", "Expected `int`"),
        ({"token_ids": ["1"]}, "$.token_ids[0]", "Expected `int`"),
        ({"output_options": {"logprobs": "abc"}}, "$.output_options.logprobs", "Expected `int"),
        ({"output_options": {"logprobs": -1}}, "$.output_options.logprobs", ">= 0"),
        ({"output_options": {"logprobs": 2.5}}, "$.output_options.logprobs", "Expected `int"),
        ({"sampling_options": {"n": 0}}, "$.sampling_options.n", ">= 1"),
        ({"sampling_options": {"temperature": -1}}, "$.sampling_options.temperature", ">= 0.0"),
        ({"sampling_options": {"top_p": 0}}, "$.sampling_options.top_p", "> 0.0"),
        ({"stop_conditions": {"max_tokens": 0}}, "$.stop_conditions.max_tokens", ">= 1"),
        ({"stop_conditions": {"stop": ["a", ""]}}, "$.stop_conditions.stop[1]", "length >= 1"),
        ({"stop_conditions": {"stop": "a"}}, "$.stop_conditions.stop", "Expected `array"),
        (
            {"stop_conditions": {"include_stop_str_in_output": 1}},
            "$.stop_conditions.include_stop_str_in_output",
            "Expected `bool",
        ),
        ({"request_id": 5}, "$.request_id", "Expected `str`"),
        ({"request_id": ""}, "$.request_id", "length >= 1"),
    ],
)
def test_strict_validation_names_field_and_rule(patch, path, rule) -> None:
    payload = {"request_id": "r", "token_ids": [1]} | patch
    with pytest.raises(msgspec.ValidationError) as info:
        MSGPACK.decode_request(msgspec.msgpack.encode(payload))
    assert path in str(info.value)
    assert rule in str(info.value)


@pytest.mark.parametrize(
    ("payload", "path", "rule"),
    [
        (b'{"logit_bias": {"x": 1.0}}', "at `key` in `$.sampling_options.logit_bias`",
         "Expected `int`, got `str`"),
        (b'{"logit_bias": {"-1": 1.0}}', "at `key` in `$.sampling_options.logit_bias`",
         "Expected `int` >= 0"),
        (b'{"logit_bias": {"5": 100.5}}', "$.sampling_options.logit_bias[...]", "<= 100.0"),
        (b'{"logit_bias": {"5": -101}}', "$.sampling_options.logit_bias[...]", ">= -100.0"),
        (b'{"logit_bias": {"5": true}}', "$.sampling_options.logit_bias[...]",
         "Expected `float`, got `bool`"),
        (b'{"logit_bias": [5, 1.0]}', "$.sampling_options.logit_bias", "Expected `object"),
    ],
)  # fmt: skip
def test_logit_bias_decodes_by_token_id_and_names_its_errors(payload, path, rule) -> None:
    # JSON object keys are strings: `{"42": 5.0}` is token 42; msgpack keys are integers.
    base = b'{"request_id": "r", "token_ids": [1], "sampling_options": '
    request = JSON.decode_request(base + b'{"logit_bias": {"42": 5.0, "7": -100}}}')
    assert request.sampling_options.logit_bias == {42: 5.0, 7: -100.0}
    packed = msgspec.msgpack.encode(
        {"request_id": "r", "token_ids": [1], "sampling_options": {"logit_bias": {42: 5}}}
    )
    assert MSGPACK.decode_request(packed).sampling_options.logit_bias == {42: 5.0}
    assert msgspec.json.decode(JSON.encode(request))["sampling_options"]["logit_bias"] == {
        "42": 5.0,
        "7": -100.0,
    }
    with pytest.raises(msgspec.ValidationError) as info:
        JSON.decode_request(base + payload + b"}")
    assert path in str(info.value)
    assert rule in str(info.value)


def test_missing_required_fields() -> None:
    with pytest.raises(msgspec.ValidationError, match="missing required field `token_ids`"):
        MSGPACK.decode_request(msgspec.msgpack.encode({"request_id": "r"}))


def test_frame_is_a_map_with_wire_names_and_absent_optionals() -> None:
    frame = ResponseFrame(request_id="r", seq=3, index=1, token_ids=[5])
    wire = msgspec.msgpack.decode(MSGPACK.encode(frame))
    assert wire == {
        "request_id": "r",
        "seq": 3,
        "index": 1,
        "token_ids": [5],
        "finish_reason": None,
    }

    row = [TopLogprob(rank=1, token_id=5, token="a", logprob=-0.5, bytes=b"a")]
    final = ResponseFrame(
        request_id="r",
        seq=4,
        token_ids=[5],
        log_probs=[-0.5],
        top_logprobs=[row],
        finish_reason="length",
        completion_usage=Usage(3, 1, 4),
    )
    wire = msgspec.msgpack.decode(MSGPACK.encode(final))
    assert wire["log_probs"] == [-0.5]
    assert wire["top_logprobs"] == [
        [{"rank": 1, "token_id": 5, "token": "a", "logprob": -0.5, "bytes": b"a"}]
    ]
    assert wire["finish_reason"] == "length"
    assert wire["completion_usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "total_tokens": 4,
    }
    assert "error" not in wire and "prompt_log_probs" not in wire
    assert "stop_reason" not in wire


@pytest.mark.parametrize("stop_reason", ["END", 0, 9])
def test_stop_reason_is_a_string_or_a_token_id_on_the_final_frame(stop_reason) -> None:
    final = ResponseFrame(request_id="r", seq=1, finish_reason="stop", stop_reason=stop_reason)
    for codec, decode in ((MSGPACK, msgspec.msgpack.decode), (JSON, msgspec.json.decode)):
        wire = decode(codec.encode(final))
        assert (wire["finish_reason"], wire["stop_reason"]) == ("stop", stop_reason)
        assert codec.decode_frame(codec.encode(final)).stop_reason == stop_reason


def test_finish_reasons_spelled() -> None:
    assert FINISH_REASONS == ("eos", "length", "stop", "cancelled", "error")


def test_json_writes_non_finite_logprobs_as_null_and_bytes_as_base64() -> None:
    row = [TopLogprob(rank=2, token_id=7, token="<0xE2>", logprob=-math.inf, bytes=b"\xe2")]
    frame = ResponseFrame(
        request_id="r", seq=0, token_ids=[7], log_probs=[-math.inf], top_logprobs=[row]
    )
    wire = msgspec.json.decode(JSON.encode(frame))
    assert wire["log_probs"] == [None]
    assert wire["top_logprobs"][0][0]["logprob"] is None
    assert wire["top_logprobs"][0][0]["bytes"] == "4g=="  # base64 of 0xE2
    back = JSON.decode_frame(JSON.encode(frame))
    assert back.top_logprobs[0][0].bytes == b"\xe2"
    # msgpack keeps the float.
    assert MSGPACK.decode_frame(MSGPACK.encode(frame)).log_probs == [-math.inf]


def test_codec_by_content_type() -> None:
    assert codec_for(None) is MSGPACK
    assert codec_for({"Content-Type": "application/json; charset=utf-8"}) is JSON
    assert codec_for({"Content-Type": "application/msgpack"}) is MSGPACK


def test_a_json_object_without_content_type_is_json() -> None:
    """`nats req SUBJECT '{...}'` without `-H Content-Type:application/json` is answered in JSON:
    a msgpack request is a map, whose first byte is never `{` or JSON whitespace."""
    body = b'{"request_id": "r", "token_ids": [1]}'
    assert codec_for(None, body) is JSON
    assert codec_for({}, b"\n  " + body) is JSON
    packed = MSGPACK.encode(GenerateRequest(request_id="r", token_ids=[1]))
    assert codec_for(None, packed) is MSGPACK
    assert 0x80 <= packed[0] <= 0x8F  # a fixmap
    # A Content-Type that is there decides, whatever the body looks like.
    assert codec_for({"Content-Type": "application/msgpack"}, body) is MSGPACK
    assert JSON.decode_request(body).token_ids == [1]


def test_subjects() -> None:
    subjects = Subjects()
    assert subjects.generate == "llm.vllm.generate"
    assert subjects.instance("abc123") == "llm.vllm.generate.abc123"
    with pytest.raises(ValueError, match="namespace"):
        Subjects(namespace="a.b")
    with pytest.raises(ValueError):
        subjects.instance("*")


def test_request_roundtrip_defaults() -> None:
    request = GenerateRequest(request_id="x", token_ids=[1])
    back = MSGPACK.decode_request(MSGPACK.encode(request))
    assert back == request
    assert back.sampling_options.n == 1
    assert back.output_options.logprobs is None


def test_subjects_parse_reads_generate_and_instance_subjects_and_nothing_else() -> None:
    assert Subjects.parse("llm.vllm.generate") == (Subjects("llm", "vllm", "generate"), None)
    subjects, instance = Subjects.parse("ns.comp.ep.abc123")
    assert (subjects.generate, subjects.cancel, instance) == (
        "ns.comp.ep",
        "ns.comp.ep.cancel",
        "abc123",
    )
    assert subjects.queue == "ns.comp.queue.ep"
    for bad in ("foo", "a.b", "a.b.c.d.e", "a.b.c.cancel", "a.b.*", "a.b.c.>", "a..c"):
        with pytest.raises(ValueError):
            Subjects.parse(bad)
