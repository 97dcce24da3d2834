"""The engine-dependent rules of worker/validation.py, against limits a test writes: each
violation is an InvalidRequest naming the wire field and the rule, and `admit` fills in the
effective max_tokens (so the engine never needs the operator's limits)."""

from __future__ import annotations

import msgspec
import pytest

from messages.codec import JSON
from messages.request import GenerateRequest
from worker.client.requests import make_request
from worker.engine.contract import EngineLimits, InvalidRequest
from worker.validation import admit, check_request, max_new_tokens

LIMITS = EngineLimits(
    model="limits", max_logprobs=5, vocab_size=100, max_model_len=64, max_n=4, max_tokens_limit=None
)
CAPPED = EngineLimits(
    model="capped", max_logprobs=5, vocab_size=100, max_model_len=64, max_n=4, max_tokens_limit=10
)
PROMPT = [1, 2, 3, 4]


def request(**fields: object) -> GenerateRequest:
    """A request from wire fields (JSON, as a client would send it), decoded as the worker
    decodes it (a logit_bias's keys are strings of ids in JSON)."""
    return JSON.decode_request(
        msgspec.json.encode({"request_id": "v", "token_ids": PROMPT} | fields)
    )


def refusal(req: GenerateRequest, limits: EngineLimits = LIMITS) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        check_request(req, limits)
    return refused.value


@pytest.mark.parametrize(
    ("fields", "field", "rule"),
    [
        ({"sampling_options": {"n": 5}}, "sampling_options.n", "must be <= 4, got 5"),
        (
            {"sampling_options": {"use_beam_search": True}},
            "sampling_options.use_beam_search",
            "beam search is not supported",
        ),
        (
            {"output_options": {"logprobs": 6}},
            "output_options.logprobs",
            "must be <= 5 (the engine's max_logprobs), got 6",
        ),
        (
            {"output_options": {"prompt_logprobs": 7}},
            "output_options.prompt_logprobs",
            "must be <= 5 (the engine's max_logprobs), got 7",
        ),
        (
            {"token_ids": [1, 2, 100]},
            "token_ids[2]",
            "token id 100 is outside the vocabulary (must be < 100)",
        ),
        ({"eos_token_ids": [7, 250]}, "eos_token_ids[1]", "token id 250 is outside"),
        (
            {"stop_conditions": {"stop_token_ids": [100]}},
            "stop_conditions.stop_token_ids[0]",
            "token id 100 is outside the vocabulary",
        ),
        (
            {"stop_conditions": {"stop_token_ids_hidden": [3, 4, 1000]}},
            "stop_conditions.stop_token_ids_hidden[2]",
            "token id 1000 is outside the vocabulary",
        ),
        (
            {"token_ids": list(range(64))},
            "token_ids",
            "prompt of 64 tokens leaves no room to generate: must be < max_model_len 64",
        ),
        (
            {"stop_conditions": {"max_tokens": 61}},
            "stop_conditions.max_tokens",
            "prompt (4) + max_tokens (61) must be <= max_model_len 64",
        ),
        (
            {"stop_conditions": {"max_tokens": 8, "min_tokens": 9}},
            "stop_conditions.min_tokens",
            "must be <= max_tokens (8), got 9",
        ),
        (
            {"continued_tokens": 4},
            "continued_tokens",
            "must be < the number of token_ids (4), got 4",
        ),
    ],
    ids=[
        "n-above-max_n",
        "beam-search",
        "logprobs-above-max",
        "prompt-logprobs-above-max",
        "prompt-token-out-of-vocab",
        "eos-token-out-of-vocab",
        "stop-token-out-of-vocab",
        "hidden-stop-token-out-of-vocab",
        "prompt-fills-the-context",
        "max-tokens-past-the-context",
        "min-tokens-above-max-tokens",
        "continued-tokens-cover-the-whole-prompt",
    ],
)
def test_each_rule_names_its_field_and_rule(fields: dict, field: str, rule: str) -> None:
    refused = refusal(request(**fields))
    assert refused.code == "invalid_request"
    assert refused.field == field
    assert rule in refused.rule, refused.rule
    assert str(refused).startswith(f"{field}: ")


@pytest.mark.parametrize(
    "fields",
    [
        {"sampling_options": {"n": 4}},
        {"sampling_options": {"use_beam_search": False}},
        {"output_options": {"logprobs": 5, "prompt_logprobs": 5}},
        {"output_options": {"logprobs": 0}},
        {"token_ids": [0, 99]},
        {"eos_token_ids": [99], "stop_conditions": {"stop_token_ids": [99]}},
        {"sampling_options": {"logit_bias": {"99": -100.0}}},
        {"token_ids": list(range(63))},
        {"stop_conditions": {"max_tokens": 60}},
        {"stop_conditions": {"max_tokens": 8, "min_tokens": 8}},
    ],
    ids=[
        "n-at-max_n",
        "beam-search-off",
        "logprobs-at-max",
        "logprobs-zero",
        "ids-at-the-vocabulary-edge",
        "stop-ids-at-the-vocabulary-edge",
        "logit-bias-at-the-vocabulary-edge",
        "prompt-one-short-of-the-context",
        "max-tokens-filling-the-context",
        "min-tokens-equal-to-max-tokens",
    ],
)
def test_the_limits_themselves_are_allowed(fields: dict) -> None:
    check_request(request(**fields), LIMITS)


def test_a_logit_bias_names_the_field_and_the_smallest_id_outside_without_a_position() -> None:
    refused = refusal(request(sampling_options={"logit_bias": {"3": 1.0, "500": 2.0, "120": 1.0}}))
    assert refused.field == "sampling_options.logit_bias"  # a map's keys have no position
    assert refused.rule == "token id 120 is outside the vocabulary (must be < 100)"


def test_the_operators_max_tokens_cap() -> None:
    refused = refusal(request(stop_conditions={"max_tokens": 11}), CAPPED)
    assert refused.field == "stop_conditions.max_tokens"
    assert refused.rule == "must be <= 10 (the worker's max_tokens limit), got 11"
    check_request(request(stop_conditions={"max_tokens": 10}), CAPPED)


def test_min_tokens_is_checked_against_the_effective_max_tokens() -> None:
    """Without max_tokens the effective one is what the context (or the cap) leaves."""
    refused = refusal(request(stop_conditions={"min_tokens": 11}), CAPPED)
    assert refused.field == "stop_conditions.min_tokens"
    assert refused.rule == "must be <= max_tokens (10), got 11"
    refused = refusal(request(stop_conditions={"min_tokens": 61}))
    assert refused.rule == "must be <= max_tokens (60), got 61"
    check_request(request(stop_conditions={"min_tokens": 60}), LIMITS)


def test_admit_fills_in_what_the_context_or_the_cap_leaves() -> None:
    assert admit(request(), LIMITS).stop_conditions.max_tokens == 60  # 64 - 4
    assert admit(request(), CAPPED).stop_conditions.max_tokens == 10
    near_full = request(token_ids=list(range(59)))
    assert admit(near_full, CAPPED).stop_conditions.max_tokens == 5  # the context, under the cap
    explicit = request(stop_conditions={"max_tokens": 3})
    assert admit(explicit, CAPPED).stop_conditions.max_tokens == 3


def test_max_new_tokens_does_not_change_the_request() -> None:
    req = request()
    assert max_new_tokens(req, CAPPED) == 10
    assert req.stop_conditions.max_tokens is None


def test_admit_refuses_before_it_fills_in() -> None:
    req = request(sampling_options={"n": 9})
    with pytest.raises(InvalidRequest, match=r"^sampling_options\.n: must be <= 4, got 9$"):
        admit(req, LIMITS)
    assert req.stop_conditions.max_tokens is None


def test_the_first_broken_rule_is_the_one_reported() -> None:
    """n is checked before the vocabulary, the vocabulary before the context length."""
    both = request(sampling_options={"n": 5}, token_ids=[500] * 70)
    assert refusal(both).field == "sampling_options.n"
    assert refusal(request(token_ids=[500] * 70)).field == "token_ids[0]"


def test_the_shared_request_builder_passes_the_tiny_engines_limits() -> None:
    """What the tests and the benchmarks send by default (make_request) is admitted by an
    engine of the e2e tiny model's size."""
    tiny = EngineLimits(model="tiny", max_logprobs=20, vocab_size=1024, max_model_len=512)
    req = make_request("builder", [1, 300, 301, 302], max_tokens=8, logprobs=5, n=2)
    assert admit(req, tiny).stop_conditions.max_tokens == 8
