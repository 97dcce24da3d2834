"""Closed-loop load on both sides of a comparison: the NATS worker and a baseline.

Each side runs `concurrency` streams; each stream sends `requests_per_stream` requests one after
another. A run's tokens/s is all generated tokens ÷ its wall time; TTFT is per request, from the
send to the first token. Both sides get the same requests (prompts, sampling, max_tokens).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench.common import median, percentile
from messages.codec import MSGPACK
from messages.request import GenerateRequest
from worker.client.requests import make_request


@dataclass
class RunResult:
    wall_s: float
    tokens: int
    ttft_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def ttft_ms(self, q: float) -> float:
        return percentile(self.ttft_s, q) * 1000


# One request's answer: (TTFT in s, tokens).
Send = Callable[[GenerateRequest], Awaitable[tuple[float, int]]]


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


async def run(
    send: Send,
    token_prompts: list[list[int]],
    *,
    concurrency: int,
    requests_per_stream: int,
    max_tokens: int,
    logprobs: int | None,
) -> RunResult:
    result = RunResult(0.0, 0)

    async def stream(index: int) -> None:
        for i in range(requests_per_stream):
            prompt = token_prompts[(index * requests_per_stream + i) % len(token_prompts)]
            # Greedy and ignore_eos (make_request's defaults): every request generates exactly
            # max_tokens on both sides.
            request = make_request(None, prompt, max_tokens=max_tokens, logprobs=logprobs)
            ttft, tokens = await send(request)
            result.ttft_s.append(ttft)
            result.tokens += tokens

    start = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(concurrency)))
    result.wall_s = time.perf_counter() - start
    return result


class _Counted(msgspec.Struct):
    """The part of a frame the load generator reads (msgspec skips the other fields)."""

    token_ids: list[int] = []
    finish_reason: str | None = None


class NatsSender:
    """Sends requests to the worker with one wildcard reply subscription for all of them (as a
    frontend would: no subscribe/unsubscribe round trip per request)."""

    def __init__(self, nc: NATS, subject: str) -> None:
        self.nc = nc
        self.subject = subject
        self.prefix = nc.new_inbox()
        self._open: dict[str, list] = {}
        self._decoder = msgspec.msgpack.Decoder(_Counted)
        self._subscription = None
        self.frames = 0

    async def start(self) -> None:
        self._subscription = await self.nc.subscribe(self.prefix + ".>", cb=self._on_frame)

    async def _on_frame(self, msg: Msg) -> None:
        if not msg.data:
            return  # liveness probe
        state = self._open.get(msg.subject)
        if state is None:
            return
        frame = self._decoder.decode(msg.data)
        self.frames += 1
        if frame.token_ids:
            if state[1] is None:
                state[1] = time.perf_counter()
            state[2] += len(frame.token_ids)
        if frame.finish_reason is not None:
            state[3].set_result(None)

    async def __call__(self, request: GenerateRequest) -> tuple[float, int]:
        async def send(inbox: str) -> None:
            await self.nc.publish(self.subject, MSGPACK.encode(request), reply=inbox)

        return await self._answer(request, send)

    async def replay(self, request: GenerateRequest, frames: list[bytes]) -> tuple[float, int]:
        """The transport baseline: publishes recorded frame bytes to a fresh inbox from this
        process, with no worker, and reads them back exactly as `__call__` reads a worker's."""

        async def send(inbox: str) -> None:
            for data in frames:
                await self.nc.publish(inbox, data)

        return await self._answer(request, send)

    async def _answer(
        self, request: GenerateRequest, send: Callable[[str], Awaitable[None]]
    ) -> tuple[float, int]:
        """(TTFT, tokens) of one request whose frames arrive on its own inbox."""
        inbox = f"{self.prefix}.{request.request_id}"
        done = asyncio.get_running_loop().create_future()
        state = [time.perf_counter(), None, 0, done]
        self._open[inbox] = state
        try:
            await send(inbox)
            await asyncio.wait_for(done, 300)
        finally:
            del self._open[inbox]
        return state[1] - state[0], state[2]

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()


class LibrarySender:
    """Sends each request through the client library (`worker.client.generate`: its own inbox,
    the frame reader, and migration unless `migration_limit` is 0), as a Python publisher does."""

    def __init__(self, nc: NATS, subject: str, migration_limit: int) -> None:
        self.nc = nc
        self.subject = subject
        self.migration_limit = migration_limit
        self.frames = 0

    async def __call__(self, request: GenerateRequest) -> tuple[float, int]:
        from worker.client import generate

        start = time.perf_counter()
        first = None
        tokens = 0
        async for frame in generate(
            self.nc, request, subject=self.subject, migration_limit=self.migration_limit
        ):
            self.frames += 1
            if frame.token_ids and first is None:
                first = time.perf_counter()
            tokens += len(frame.token_ids)
        return (first or time.perf_counter()) - start, tokens


class DirectSender:
    """The baseline: the same request straight into the same in-process AsyncLLM, with the
    worker's own SamplingParams (flat logprobs, no detokenize, DELTA), nothing else."""

    def __init__(self, engine) -> None:  # engine: worker.engine.vllm_adapter.VllmEngine
        from vllm.inputs import TokensPrompt

        self.engine = engine
        self._prompt = TokensPrompt

    async def __call__(self, request: GenerateRequest) -> tuple[float, int]:
        params = self.engine.sampling_params(request)
        prompt = self._prompt(prompt_token_ids=request.token_ids)
        start = time.perf_counter()
        first = None
        tokens = 0
        async for out in self.engine.llm.generate(prompt, params, request.request_id):
            new = len(out.outputs[0].token_ids)
            if new and first is None:
                first = time.perf_counter()
            tokens += new
        return (first or time.perf_counter()) - start, tokens


class OpenAISender:
    """vLLM's own OpenAI server as the peer: the same request as a streamed `/v1/completions`
    call (prompt as token ids, greedy, ignore_eos, logprobs as asked). Its chunks carry text
    (and, with logprobs, token strings and top-k maps); ours carry token ids and rows."""

    def __init__(self, session, base_url: str, model: str) -> None:  # session: aiohttp
        self.session = session
        self.url = f"{base_url}/completions"
        self.model = model

    async def __call__(self, request: GenerateRequest) -> tuple[float, int]:
        body: dict = {
            "model": self.model,
            "prompt": request.token_ids,
            "max_tokens": request.stop_conditions.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.output_options.logprobs is not None:
            body["logprobs"] = request.output_options.logprobs
        start = time.perf_counter()
        first = None
        tokens = 0
        async with self.session.post(self.url, json=body) as answer:
            answer.raise_for_status()
            async for line in answer.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = msgspec.json.decode(line[6:])
                # vLLM sends a chunk per step that has new tokens, even when their text is still
                # empty (a byte token of an unfinished character): that chunk is the first token.
                if first is None and chunk.get("choices"):
                    first = time.perf_counter()
                usage = chunk.get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
        return (first or time.perf_counter()) - start, tokens


# One run of one side: (side, concurrency, logprobs) → its RunResult.
Once = Callable[[str, int, "int | None"], Awaitable[RunResult]]


def runner(
    senders: dict[str, Send],
    token_prompts: list[list[int]],
    *,
    max_tokens: int,
    requests_per_stream: int,
) -> Callable[..., Awaitable[RunResult]]:
    """`once(side, concurrency, logprobs, per_stream=requests_per_stream)`: one closed-loop run
    of one side with these prompts and max_tokens."""

    async def once(
        side: str, concurrency: int, logprobs: int | None, per_stream: int = requests_per_stream
    ) -> RunResult:
        return await run(
            senders[side],
            token_prompts,
            concurrency=concurrency,
            requests_per_stream=per_stream,
            max_tokens=max_tokens,
            logprobs=logprobs,
        )

    return once


async def alternate(
    once: Once,
    sides: tuple[str, str],
    concurrency_levels: list[int],
    logprob_levels: list[int | None],
    repeats: int,
) -> list[dict]:
    """Every (logprobs, concurrency) cell `repeats` times per side, alternating which side goes
    first (machines drift); ratios are `sides[0]` ÷ `sides[1]` per repeat, then the median."""
    ours, theirs = sides
    results = []
    for logprobs in logprob_levels:
        for concurrency in concurrency_levels:
            runs: dict[str, list[RunResult]] = {theirs: [], ours: []}
            for repeat in range(repeats):
                order = (theirs, ours) if repeat % 2 == 0 else (ours, theirs)
                for side in order:
                    runs[side].append(await once(side, concurrency, logprobs))
            pairs = list(zip(runs[ours], runs[theirs], strict=True))
            ratios = [a.tokens_per_s / b.tokens_per_s for a, b in pairs]
            entry: dict = {
                "logprobs": logprobs,
                "concurrency": concurrency,
                "ratio_tokens_per_s": median(ratios),
                "ratio_ttft_p50": median([a.ttft_ms(50) / b.ttft_ms(50) for a, b in pairs]),
                "ratios": ratios,
            }
            for side, side_runs in runs.items():
                entry[side] = {
                    "tokens_per_s": median([r.tokens_per_s for r in side_runs]),
                    "ttft_p50_ms": median([r.ttft_ms(50) for r in side_runs]),
                    "ttft_p99_ms": median([r.ttft_ms(99) for r in side_runs]),
                    "tokens": [r.tokens for r in side_runs],
                }
            results.append(entry)
            print(
                f"logprobs={logprobs} c={concurrency}: tok/s ratio "
                f"{entry['ratio_tokens_per_s']:.3f}, TTFT p50 ratio {entry['ratio_ttft_p50']:.3f}",
                file=sys.stderr,
                flush=True,
            )
    return results
