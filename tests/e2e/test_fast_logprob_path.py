"""The worker's fast logprob path (flat_logprobs=True, detokenize=False, `token`/`bytes` from the
TokenTable) gives the same values as vLLM's default path (a dict of Logprob per position, with
vLLM's detokenizer on), on the real engine: same token ids, logprobs, ranks and top-k ids, and
token text that agrees with vLLM's decoded_token wherever vLLM can decode a piece alone."""

from __future__ import annotations

import pytest

from worker.client.requests import make_request
from worker.engine.contract import EngineStep

K = 5
PROMPT = [1, 17, 250, 33, 480, 91, 602, 12, 77, 5]


async def _default_path(engine, request_id: str, max_tokens: int, seed: int | None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
        ignore_eos=True,
        logprobs=K,
        prompt_logprobs=K,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    assert params.detokenize and not params.flat_logprobs  # vLLM's defaults
    final = None
    async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=PROMPT), params, request_id):
        final = out
    return final


async def _fast_path(engine, request_id: str, max_tokens: int, seed: int | None):
    request = make_request(
        request_id,
        PROMPT,
        max_tokens=max_tokens,
        logprobs=K,
        prompt_logprobs=K,
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
    )
    assert engine.sampling_params(request).flat_logprobs
    assert not engine.sampling_params(request).detokenize
    steps: list[EngineStep] = [s async for s in engine.generate(request, request_id + "-fast")]
    token_ids = [t for s in steps for c in s.choices for t in c.token_ids]
    log_probs = [v for s in steps for c in s.choices for v in c.log_probs or []]
    rows = [r for s in steps for c in s.choices for r in c.top_logprobs or []]
    prompts = [s.prompt for s in steps if s.prompt is not None]
    assert len(prompts) == 1
    return token_ids, log_probs, rows, prompts[0]


def _compare_position(position: dict, sampled: int, value: float | None, row, table) -> None:
    """One position: vLLM's {id: Logprob} against our (logprob, row)."""
    assert value == pytest.approx(position[sampled].logprob, abs=1e-6)
    ours = {entry.token_id: entry for entry in row}
    top = {tid: lp for tid, lp in position.items() if lp.rank <= K}
    assert set(top) <= set(ours) and sampled in ours
    assert [e.rank for e in row[:K]] == list(range(1, K + 1))  # top-k first, by rank
    for token_id, lp in position.items():
        entry = ours[token_id]
        assert entry.rank == lp.rank, token_id
        assert entry.logprob == pytest.approx(lp.logprob, abs=1e-6), token_id
        assert entry.bytes == table.byte_values[token_id]
        decoded = lp.decoded_token
        if decoded and "\ufffd" not in decoded:
            assert entry.token == decoded, token_id
        # Where vLLM cannot decode a piece alone (a lone UTF-8 byte), it gives "" or U+FFFD;
        # ours is never U+FFFD: the text of the true bytes, or the piece that names them.
        assert "\ufffd" not in entry.token


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded-sampling"])
async def test_fast_path_equals_vllm_default_path(engine, seed: int | None) -> None:
    max_tokens = 24
    default = await _default_path(engine, f"default-{seed}", max_tokens, seed)
    token_ids, log_probs, rows, prompt = await _fast_path(engine, f"fast-{seed}", max_tokens, seed)
    table = engine.table
    completion = default.outputs[0]
    assert token_ids == list(completion.token_ids)
    assert len(log_probs) == len(rows) == len(token_ids) == max_tokens  # zip by position
    for position, sampled, value, row in zip(
        completion.logprobs, token_ids, log_probs, rows, strict=True
    ):
        _compare_position(position, sampled, value, row, table)
    # The true bytes of the sampled tokens decode to vLLM's detokenized text, up to how each
    # side shows a lone byte that never completes a character (vLLM: dropped at the start,
    # U+FFFD elsewhere) and the first piece's leading space, which vLLM's decode strips.
    text = b"".join(table.byte_values[t] for t in token_ids).decode("utf-8", errors="replace")
    assert completion.text
    assert text.replace("\ufffd", "").strip() == completion.text.replace("\ufffd", "").strip()

    # Prompt logprobs: position 0 has none on both paths; the others match the same way.
    assert default.prompt_logprobs[0] is None
    assert prompt.log_probs[0] is None and prompt.top_logprobs[0] is None
    assert len(prompt.log_probs) == len(PROMPT)
    for position, sampled, value, row in zip(
        default.prompt_logprobs[1:],
        PROMPT[1:],
        prompt.log_probs[1:],
        prompt.top_logprobs[1:],
        strict=True,
    ):
        _compare_position(position, sampled, value, row, table)
