"""Hostile request payloads for the fuzz tests of both intake modes (hypothesis strategies)."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from messages.codec import JSON, MSGPACK, codec_for
from worker.validation import check_request

# A valid request whose unknown field nests ~1,000 maps deep (3 KB): msgspec raises
# RecursionError while skipping it (a poison message, in either intake).
DEEP_JSON = (
    b'{"request_id":"deep-1","token_ids":[1,2,3],"junk":'
    + b'{"a":' * 1000
    + b"1"
    + b"}" * 1000
    + b"}"
)
DEEP_MSGPACK = (
    b"\x83"
    + MSGPACK.encode("request_id")
    + MSGPACK.encode("deep-1")
    + MSGPACK.encode("token_ids")
    + MSGPACK.encode([1, 2, 3])
    + MSGPACK.encode("junk")
    + b"\x81\xa1a" * 1000
    + b"\x01"
)

_BASE = {"request_id": "fuzz", "token_ids": [1, 2, 3]}
_FIELDS = [
    ("request_id",),
    ("token_ids",),
    ("sampling_options",),
    ("stop_conditions",),
    ("output_options",),
    ("eos_token_ids",),
    ("annotations",),
    ("timeout_ms",),
    ("sampling_options", "n"),
    ("sampling_options", "temperature"),
    ("sampling_options", "top_p"),
    ("sampling_options", "top_k"),
    ("sampling_options", "min_p"),
    ("sampling_options", "seed"),
    ("sampling_options", "repetition_penalty"),
    ("sampling_options", "use_beam_search"),
    ("sampling_options", "logit_bias"),
    ("stop_conditions", "max_tokens"),
    ("stop_conditions", "min_tokens"),
    ("stop_conditions", "stop_token_ids"),
    ("stop_conditions", "ignore_eos"),
    ("stop_conditions", "stop"),
    ("output_options", "logprobs"),
    ("output_options", "prompt_logprobs"),
]
_hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=6),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    # Shaped like a logit bias: id keys (as JSON writes them, and as ints), any bias.
    st.dictionaries(
        st.one_of(st.integers(-(2**40), 2**40).map(str), st.integers(-(2**40), 2**40)),
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70)),
        max_size=3,
    ),
)


_PLACEHOLDER = "<deep value>"


def _deeply_nested(draw, payload: dict, as_json: bool) -> bytes:
    """The payload with one field (known or not) nested 500-3000 maps or lists deep, written
    by hand: msgspec itself cannot encode (or decode) that deep."""
    depth = draw(st.integers(500, 3000))
    key = draw(st.sampled_from(["junk", "sampling_options", "token_ids", "annotations"]))
    as_map = draw(st.booleans())
    payload[key] = _PLACEHOLDER
    if as_json:
        deep = (b'{"a":' if as_map else b"[") * depth + b"1" + (b"}" if as_map else b"]") * depth
        return msgspec.json.encode(payload).replace(msgspec.json.encode(_PLACEHOLDER), deep)
    opening = b"\x81\xa1a" if as_map else b"\x91"  # fixmap of 1 / fixarray of 1
    deep = opening * depth + b"\x01"
    return msgspec.msgpack.encode(payload).replace(msgspec.msgpack.encode(_PLACEHOLDER), deep)


@st.composite
def hostile_payloads(draw) -> tuple[bytes, bool]:
    """(payload, json): `json` is how the worker reads it and answers. The payload is sent with
    the JSON Content-Type when `json` was drawn, else with none; without one, a body that starts
    like a JSON object (`{` or JSON whitespace) is read as JSON (messages.codec.codec_for), so
    `json` is set for it too: its error frame comes back in JSON."""
    data, as_json = draw(_hostile_payload())
    return data, as_json or codec_for(None, data) is JSON


@st.composite
def _hostile_payload(draw) -> tuple[bytes, bool]:
    as_json = draw(st.booleans())
    kind = draw(st.sampled_from(["bytes", "mutate", "mutate", "mutate", "huge", "deep"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64)), as_json
    payload = msgspec.json.decode(msgspec.json.encode(_BASE))
    if kind == "deep":
        return _deeply_nested(draw, payload, as_json), as_json
    if kind == "huge":
        payload["token_ids"] = [draw(st.integers(min_value=0, max_value=2**31))] * draw(
            st.integers(600, 5000)
        )
    else:
        for _ in range(draw(st.integers(1, 3))):
            path = draw(st.sampled_from(_FIELDS))
            target = payload
            for key in path[:-1]:
                if not isinstance(target.get(key), dict):
                    target[key] = {}
                target = target[key]
            target[path[-1]] = draw(_hostile_values)
    try:
        data = (msgspec.json.encode if as_json else msgspec.msgpack.encode)(payload)
    except (TypeError, OverflowError, msgspec.EncodeError):
        data = msgspec.msgpack.encode(str(payload))
        as_json = False
    return data, as_json


def locally_valid(data: bytes, as_json: bool, limits, *, engine_checks: bool = True) -> bool:
    """Whether the payload is a request the worker serves (the fuzz tests skip it): it decodes
    and meets `limits`, and with `engine_checks` the real engine accepts its values too. A fake
    engine (`engine_checks=False`) checks nothing of its own: what the worker admits, it runs."""
    try:
        request = (JSON if as_json else MSGPACK).decode_request(data)
        check_request(request, limits)
    except Exception:
        return False
    if not engine_checks:
        return True
    sampling = request.sampling_options
    # Values the engine accepts: such a payload is a legitimate (if odd) request.
    return sampling.temperature is None or sampling.temperature < 1e6


def fuzz_settings(examples: int) -> settings:
    """The fuzz tests' hypothesis settings: the same payloads every run (a failure reproduces),
    no shrinking (each step is a round trip to the worker; the failing payload is reported as
    is), fixtures shared across examples."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )
