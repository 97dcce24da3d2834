"""Building a GenerateRequest from token ids: the one helper the client CLI, the tests and the
benchmarks share (greedy by default, ignore_eos so a request generates exactly max_tokens)."""

from __future__ import annotations

import itertools
from typing import Any

from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions

_ids = itertools.count()


def make_request(
    request_id: str | None,
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
    """`request_id` None numbers requests of this process (`req-0`, `req-1`, …); `stop` takes
    StopConditions' other fields (`stop`, `stop_token_ids`, `include_stop_str_in_output`)."""
    return GenerateRequest(
        request_id=f"req-{next(_ids)}" if request_id is None else request_id,
        token_ids=token_ids,
        sampling_options=SamplingOptions(n=n, temperature=temperature, seed=seed),
        stop_conditions=StopConditions(max_tokens=max_tokens, ignore_eos=ignore_eos, **stop),
        output_options=OutputOptions(logprobs=logprobs, prompt_logprobs=prompt_logprobs),
    )
