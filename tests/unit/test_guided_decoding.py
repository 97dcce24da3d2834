"""`sampling_options.guided_decoding` on the wire: Dynamo-shaped payloads decode in msgpack and
JSON (the field names spelled out as the wire has them), the decode-time bounds name the field,
and every arrival rule of worker/validation.py is an InvalidRequest naming its field and rule.
What a backend cannot compile is the engine's to refuse (tests/e2e/test_guided_decoding.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from messages import GuidedDecoding
from messages.codec import JSON, MSGPACK, Codec
from messages.request import GenerateRequest
from worker.engine.contract import EngineLimits, InvalidRequest
from worker.validation import check_request

LIMITS = EngineLimits(model="limits", max_logprobs=5, vocab_size=100, max_model_len=64)
CODECS = pytest.mark.parametrize("codec", [MSGPACK, JSON], ids=["msgpack", "json"])
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}},
    "required": ["color"],
}


def payload(codec: Codec, guided: Any) -> bytes:
    """A Dynamo-shaped request whose sampling_options carries `guided`, encoded as a client
    would (plain maps, not this package's structs)."""
    body = {
        "request_id": "gd",
        "token_ids": [1, 2, 3],
        "sampling_options": {"temperature": 0.0, "guided_decoding": guided},
        "stop_conditions": {"max_tokens": 8},
    }
    return codec.encode(body)


def decode(codec: Codec, guided: Any) -> GenerateRequest:
    return codec.decode_request(payload(codec, guided))


def guided_of(codec: Codec, guided: Any) -> GuidedDecoding:
    decoded = decode(codec, guided).sampling_options.guided_decoding
    assert decoded is not None
    return decoded


def refusal(codec: Codec, guided: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        check_request(decode(codec, guided), LIMITS)
    return refused.value


@CODECS
@pytest.mark.parametrize(
    ("guided", "constraint"),
    [
        ({"json": SCHEMA}, "json"),
        ({"json": '{"type": "object"}'}, "json"),
        ({"json": {}}, "json"),
        ({"regex": "[a-c]{3}-[0-9]{2}"}, "regex"),
        ({"choice": ["yes", "no"]}, "choice"),
        ({"grammar": 'root ::= "a" | "b"'}, "grammar"),
        ({"json_object": True}, "json_object"),
        ({"structural_tag": '{"type": "structural_tag", "format": {}}'}, "structural_tag"),
        ({"structural_tag": {"type": "structural_tag", "format": {}}}, "structural_tag"),
        ({"regex": "[0-9]+", "backend": "xgrammar"}, "regex"),
        ({"json": SCHEMA, "backend": "auto", "whitespace_pattern": None}, "json"),
        ({"choice": ["a"], "json": None, "regex": None, "grammar": None}, "choice"),
    ],
    ids=[
        "json-object-schema",
        "json-string-schema",
        "json-any-value",
        "regex",
        "choice",
        "grammar",
        "json_object",
        "structural-tag-string",
        "structural-tag-object",
        "with-backend",
        "dynamo-nulls-beside-json",
        "dynamo-nulls-beside-choice",
    ],
)
def test_a_dynamo_shaped_guided_decoding_decodes_and_is_admitted(
    codec: Codec, guided: dict[str, Any], constraint: str
) -> None:
    decoded = guided_of(codec, guided)
    assert decoded.constraints() == [constraint]
    assert getattr(decoded, constraint) == guided[constraint]
    check_request(decode(codec, guided), LIMITS)


@CODECS
def test_every_field_of_dynamos_struct_decodes_by_its_wire_name(codec: Codec) -> None:
    decoded = guided_of(
        codec,
        {
            "json": SCHEMA,
            "regex": "r",
            "choice": ["c"],
            "grammar": "g",
            "structural_tag": "{}",
            "backend": "guidance",
            "whitespace_pattern": "[ ]?",
            "json_object": True,
            "a_field_from_a_newer_dynamo": 1,
        },
    )
    assert (decoded.json, decoded.regex, decoded.choice, decoded.grammar) == (
        SCHEMA,
        "r",
        ["c"],
        "g",
    )
    assert (decoded.structural_tag, decoded.backend, decoded.whitespace_pattern) == (
        "{}",
        "guidance",
        "[ ]?",
    )
    assert decoded.json_object is True


@CODECS
def test_no_guided_decoding_and_null_are_the_same(codec: Codec) -> None:
    assert decode(codec, None).sampling_options.guided_decoding is None
    body = {"request_id": "gd", "token_ids": [1]}
    assert codec.decode_request(codec.encode(body)).sampling_options.guided_decoding is None


@CODECS
def test_the_struct_round_trips_with_its_wire_names(codec: Codec) -> None:
    guided = GuidedDecoding(choice=["x", "y"], backend="xgrammar")
    raw = codec.encode(guided)
    as_map = msgspec.json.decode(raw) if codec is JSON else msgspec.msgpack.decode(raw)
    assert as_map == {"choice": ["x", "y"], "backend": "xgrammar"}  # omit_defaults
    assert guided_of(codec, as_map) == guided


@CODECS
@pytest.mark.parametrize(
    ("guided", "where", "expected"),
    [
        ({"choice": []}, "choice", "Expected `array` of length >= 1"),
        ({"choice": ["a", 1]}, "choice[1]", "Expected `str`, got `int`"),
        ({"choice": "a"}, "choice", "Expected `array | null`, got `str`"),
        ({"json": 5}, "json", "Expected `str | object | null`, got `int`"),
        ({"json": ["a"]}, "json", "Expected `str | object | null`, got `array`"),
        ({"json": True}, "json", "Expected `str | object | null`, got `bool`"),
        ({"regex": 5}, "regex", "Expected `str | null`, got `int`"),
        ({"grammar": {}}, "grammar", "Expected `str | null`, got `object`"),
        ({"json_object": "yes"}, "json_object", "Expected `bool | null`, got `str`"),
        ({"json_object": 1}, "json_object", "Expected `bool | null`, got `int`"),
        ({"backend": 1}, "backend", "Expected `str | null`, got `int`"),
        ({"whitespace_pattern": []}, "whitespace_pattern", "Expected `str | null`, got `array`"),
    ],
)
def test_a_wrong_type_is_a_decode_error_naming_the_field(
    codec: Codec, guided: dict[str, Any], where: str, expected: str
) -> None:
    with pytest.raises(msgspec.ValidationError) as error:
        decode(codec, guided)
    assert expected in str(error.value)
    assert str(error.value).endswith(f"`$.sampling_options.guided_decoding.{where}`")


@CODECS
def test_a_guided_decoding_that_is_not_a_map_is_a_decode_error(codec: Codec) -> None:
    for wrong in ("json", ["regex"], True, 3):
        with pytest.raises(msgspec.ValidationError, match=r"\$\.sampling_options\.guided_decoding"):
            decode(codec, wrong)


GUIDED = "sampling_options.guided_decoding"


@CODECS
@pytest.mark.parametrize(
    ("guided", "field", "rule"),
    [
        (
            {},
            GUIDED,
            "sets no constraint: set one of json, regex, choice, grammar, json_object, "
            "structural_tag",
        ),
        (
            {"backend": "xgrammar", "whitespace_pattern": " "},
            GUIDED,
            "sets no constraint",
        ),
        (
            {"json": SCHEMA, "regex": "a"},
            GUIDED,
            "sets json and regex: only one constraint may be set (backend and "
            "whitespace_pattern may accompany it)",
        ),
        ({"choice": ["a"], "grammar": 'root ::= "a"'}, GUIDED, "sets choice and grammar"),
        ({"json": {}, "json_object": True}, GUIDED, "sets json and json_object"),
        (
            {"regex": "a", "structural_tag": "{}", "choice": ["a"]},
            GUIDED,
            "sets regex and choice and structural_tag",
        ),
        (
            {"json": "not json"},
            f"{GUIDED}.json",
            "a string must hold a JSON schema (a JSON object): Expecting value",
        ),
        (
            {"json": "[1, 2]"},
            f"{GUIDED}.json",
            "a string must hold a JSON schema (a JSON object), got list",
        ),
        (
            {"json": '"a"'},
            f"{GUIDED}.json",
            "a string must hold a JSON schema (a JSON object), got str",
        ),
        ({"json": ""}, f"{GUIDED}.json", "a string must hold a JSON schema (a JSON object)"),
        ({"grammar": ""}, f"{GUIDED}.grammar", "must not be empty"),
        ({"grammar": " \n"}, f"{GUIDED}.grammar", "must not be empty"),
        (
            {"json_object": False},
            f"{GUIDED}.json_object",
            "must be true when set (leave it out for no constraint)",
        ),
        (
            {"structural_tag": "[]"},
            f"{GUIDED}.structural_tag",
            "a string must hold a structural tag (a JSON object), got list",
        ),
        (
            {"regex": "a", "backend": "xgrammar:no-fallback"},
            f"{GUIDED}.backend",
            "must be one of vLLM's structured-output backends (auto, xgrammar, guidance, "
            "outlines, lm-format-enforcer), got 'xgrammar:no-fallback'",
        ),
        ({"regex": "a", "backend": "XGrammar"}, f"{GUIDED}.backend", "got 'XGrammar'"),
    ],
    ids=[
        "empty",
        "modifiers-only",
        "json-and-regex",
        "choice-and-grammar",
        "json-and-json_object",
        "three-constraints",
        "json-string-not-json",
        "json-string-an-array",
        "json-string-a-string",
        "json-string-empty",
        "grammar-empty",
        "grammar-blank",
        "json_object-false",
        "structural-tag-not-an-object",
        "backend-unknown",
        "backend-wrong-case",
    ],
)
def test_each_arrival_rule_names_its_field_and_rule(
    codec: Codec, guided: dict[str, Any], field: str, rule: str
) -> None:
    refused = refusal(codec, guided)
    assert refused.code == "invalid_request"
    assert refused.field == field
    assert rule in refused.rule, refused.rule
    assert str(refused).startswith(f"{field}: ")


def test_a_msgpack_schema_must_be_plain_json() -> None:
    """msgpack carries what JSON cannot; a schema holding it is refused on arrival."""
    for schema, why in (
        ({"type": "string", "const": b"\x00"}, "not JSON serializable"),
        ({"type": "number", "maximum": float("nan")}, "Out of range float values"),
    ):
        refused = refusal(MSGPACK, {"json": schema})
        assert refused.field == f"{GUIDED}.json"
        assert refused.rule.startswith("must be a JSON schema in plain JSON: ")
        assert why in refused.rule


def test_an_empty_choice_built_in_code_is_refused_on_arrival() -> None:
    """The decoder refuses `choice: []`; a request built in code meets the same rule."""
    request = decode(MSGPACK, {"choice": ["a"]})
    request.sampling_options.guided_decoding = GuidedDecoding(choice=[])
    with pytest.raises(InvalidRequest) as refused:
        check_request(request, LIMITS)
    assert (refused.value.field, refused.value.rule) == (f"{GUIDED}.choice", "must not be empty")


def test_the_guided_decoding_rules_come_before_the_engine_limits() -> None:
    """A request with both a bad guided_decoding and a prompt past the vocabulary names the first
    rule it breaks in check_request's order (the options before the token ids)."""
    request = MSGPACK.decode_request(
        MSGPACK.encode(
            {
                "request_id": "gd",
                "token_ids": [500],
                "sampling_options": {"guided_decoding": {"regex": "a", "choice": ["a"]}},
            }
        )
    )
    with pytest.raises(InvalidRequest) as refused:
        check_request(request, LIMITS)
    assert refused.value.field == GUIDED
