"""Stop strings end to end on the real engine: vLLM matches them on its own detokenized text
(the worker asks detokenize only for such requests) and the worker's frames say so.

The reference is vLLM's default path on the same engine (`engine.llm.generate` with stock
SamplingParams and the same stop strings): the worker must end at the same token with the same
finish reason and matched string, with every token's logprob row sent and aligned, and the text
cut by `worker.client.stops` must equal vLLM's own output text.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from messages.codec import MSGPACK
from tests.helpers import TEST_SUBJECTS, exchange, run_client_cli
from worker.client import complete
from worker.client.requests import make_request
from worker.client.stops import stop_cut
from worker.frontend.tokenizer import ModelTokenizer

SUBJECT = TEST_SUBJECTS.generate
PROMPT = [1, 300, 301, 302, 400, 401]
MAX_TOKENS = 24


async def _vllm(engine, request_id: str, **params):
    """vLLM's own answer (text detokenized by vLLM, FINAL_ONLY), greedy, EOS ignored."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    sampling = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
        **params,
    )
    final = None
    prompt = TokensPrompt(prompt_token_ids=PROMPT)
    async for out in engine.llm.generate(prompt, sampling, request_id):
        final = out
    assert final is not None
    return final.outputs[0]


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model)


@pytest.fixture(scope="module")
async def stop_string(engine, tokenizer) -> str:
    """A stop string from vLLM's greedy text: 3 characters ending a third of the way in, so the
    answer stops well before max_tokens; the frontend's decoding of the tokens is vLLM's text."""
    base = await _vllm(engine, "stop-base")
    assert tokenizer.text(list(base.token_ids)) == base.text
    end = len(base.text) // 3
    candidate = base.text[max(0, end - 3) : end]
    assert len(candidate.strip()) == len(candidate) == 3, base.text
    return candidate


@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_string_ends_the_choice_where_vllm_ends_it(
    worker, client, engine, tokenizer: ModelTokenizer, stop_string: str, include: bool
) -> None:
    reference = await _vllm(
        engine, f"stop-ref-{include}", stop=[stop_string], include_stop_str_in_output=include
    )
    assert (reference.finish_reason, reference.stop_reason) == ("stop", stop_string)

    request = make_request(
        f"stop-{include}",
        PROMPT,
        max_tokens=MAX_TOKENS,
        logprobs=3,
        stop=[stop_string, "never-matched-string"],
        include_stop_str_in_output=include,
    )
    raw = await exchange(client, SUBJECT, MSGPACK.encode(request))
    wires = [msgspec.msgpack.decode(data) for data in raw]
    final = wires[-1]
    assert final["finish_reason"] == "stop"
    assert final["stop_reason"] == stop_string
    assert all("stop_reason" not in wire for wire in wires[:-1])
    token_ids = [t for wire in wires for t in wire["token_ids"]]
    assert token_ids == list(reference.token_ids)
    assert len(token_ids) < MAX_TOKENS  # the engine stopped at the match, not at max_tokens
    assert final["completion_usage"]["completion_tokens"] == len(token_ids)
    for wire in wires:  # every token sent has its logprob and row, the last one included
        assert len(wire["log_probs"]) == len(wire["top_logprobs"]) == len(wire["token_ids"])
        for token_id, row in zip(wire["token_ids"], wire["top_logprobs"], strict=True):
            assert token_id in [entry["token_id"] for entry in row]

    text = tokenizer.text(token_ids)
    before_last = len(tokenizer.text(token_ids[:-1]))
    assert stop_string in text[max(0, before_last - len(stop_string) + 1) :]
    assert text[: stop_cut(text, before_last, stop_string, include)] == reference.text
    assert engine.num_unfinished_requests() == 0


async def test_the_client_library_reports_the_stop_reason_of_each_choice(
    worker, client, engine, tokenizer: ModelTokenizer, stop_string: str
) -> None:
    vowels = list("aeiou")
    request = make_request(
        "stop-n2", PROMPT, max_tokens=MAX_TOKENS, n=2, temperature=1.0, seed=5, stop=vowels
    )
    result = await complete(client, request, subject=SUBJECT)
    for choice in result.choices:  # each choice stops on its own first vowel
        assert choice.finish_reason == "stop" and choice.stop_reason in vowels, choice
        text = tokenizer.text(choice.token_ids)
        assert choice.stop_reason in text
        assert not any(v in tokenizer.text(choice.token_ids[:-1]) for v in vowels)
    # A stop token keeps vLLM's stop_reason too: the token id.
    greedy = make_request("stop-greedy", PROMPT, max_tokens=4)
    token = (await complete(client, greedy, subject=SUBJECT)).choices[0].token_ids[1]
    by_token = make_request("stop-token", PROMPT, max_tokens=MAX_TOKENS, stop_token_ids=[token])
    choice = (await complete(client, by_token, subject=SUBJECT)).choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", token)
    length = make_request("stop-length", PROMPT, max_tokens=3)
    choice = (await complete(client, length, subject=SUBJECT)).choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("length", None)


async def test_a_stop_string_matched_only_after_min_tokens(
    worker, client, engine, stop_string: str
) -> None:
    reference = await _vllm(engine, "stop-min-ref", stop=[stop_string], min_tokens=8)
    request = make_request(
        "stop-min", PROMPT, max_tokens=MAX_TOKENS, stop=[stop_string], min_tokens=8
    )
    choice = (await complete(client, request, subject=SUBJECT)).choices[0]
    assert choice.token_ids == list(reference.token_ids)
    assert len(choice.token_ids) > 8
    assert (choice.finish_reason, choice.stop_reason) == (
        "stop" if reference.finish_reason == "stop" else "length",
        reference.stop_reason,
    )


async def test_the_client_cli_prints_the_stop_reason_and_the_cut_text(
    worker, nats_server, tiny_model, engine, stop_string: str
) -> None:
    reference = await _vllm(engine, "stop-cli-ref", stop=[stop_string])
    done = await asyncio.to_thread(
        run_client_cli, nats_server.url, "--subject", SUBJECT,
        "--token-ids", ",".join(map(str, PROMPT)), "--max-tokens", str(MAX_TOKENS),
        "--stop", stop_string, "--tokenizer", str(tiny_model),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"0: finish_reason=stop stop_reason={stop_string!r} " in "\n".join(lines) + " "
    assert f"0: text={reference.text!r}" in lines


async def test_a_stop_string_across_a_continuations_seam_ends_it_where_vllm_ends_it(
    worker, client, engine, tokenizer: ModelTokenizer
) -> None:
    """A migration's continuation (worker/client/migration.py) whose seam falls inside the stop
    string's match: with `continued_tokens` it ends at the token where the undisturbed run ends
    (vLLM alone would not see a match that began in its prompt; without the field it runs on)."""
    base = await _vllm(engine, "seam-base")
    tokens = list(base.token_ids)
    text = tokenizer.text(tokens)
    for seam in range(len(tokens) // 3, len(tokens) - 2):
        at = len(tokenizer.text(tokens[:seam]))
        stop = text[at - 1 : at + 2]  # one character before the seam, two after
        if len(stop.strip()) == len(stop) == 3 and text.find(stop) == at - 1:
            break
    else:
        pytest.fail(f"no 3-character string across a token boundary in {text!r}")
    reference = await _vllm(engine, "seam-ref", stop=[stop])
    assert (reference.finish_reason, reference.stop_reason) == ("stop", stop)
    assert len(reference.token_ids) > seam

    async def continued(request_id: str, field: int | None):
        request = make_request(
            request_id,
            PROMPT + tokens[:seam],
            max_tokens=MAX_TOKENS - seam,
            logprobs=2,
            stop=[stop],
        )
        request.continued_tokens = field
        return await complete(client, request, subject=SUBJECT)

    answer = (await continued("seam-on", seam)).choices[0]
    assert (answer.finish_reason, answer.stop_reason) == ("stop", stop)
    assert answer.token_ids == list(reference.token_ids)[seam:]
    assert len(answer.log_probs) == len(answer.top_logprobs) == len(answer.token_ids)
    unaware = (await continued("seam-off", None)).choices[0]
    assert len(unaware.token_ids) > len(answer.token_ids)
    assert engine.num_unfinished_requests() == 0
