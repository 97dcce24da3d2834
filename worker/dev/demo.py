"""One-command demo: the worker with its embedded defaults, plus one streamed request.

    python -m worker.dev.demo [any vllm-nats-worker / vLLM engine flag]

Runs exactly what `vllm-nats-worker --dev` runs (an embedded nats-server, the tiny demo model),
sends one request over NATS and prints each generated token as its frame arrives, with its
logprob and the top alternatives; then stops the worker.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
from worker.cli import build_parser
from worker.client import connect_url, generate
from worker.process import Ready, serve, setup_logging

PROMPT = "Hello world → the tiny model says"
TOP_K = 3
MAX_TOKENS = 16


def _show(token: str, raw: bytes) -> str:
    return f"{token!r:<16} {raw.hex(' '):<24}"


async def send_demo_request(ready: Ready, model: str) -> int:
    from transformers import AutoTokenizer

    client = await connect_url(ready.nats_url)
    try:
        token_ids = AutoTokenizer.from_pretrained(model)(PROMPT).input_ids
        request = GenerateRequest(
            request_id="demo-1",
            token_ids=token_ids,
            sampling_options=SamplingOptions(temperature=0.0),
            stop_conditions=StopConditions(max_tokens=MAX_TOKENS, ignore_eos=True),
            output_options=OutputOptions(logprobs=TOP_K),
        )
        print(f"\nprompt {PROMPT!r} → token_ids {token_ids}")
        print(
            f"request on {ready.subjects.generate}: greedy, max_tokens {MAX_TOKENS}, "
            f"logprobs {TOP_K}\n"
        )
        print(f"{'seq':>3} {'id':>5} {'token':<16} {'bytes':<24} {'logprob':>9}   top {TOP_K}")
        final = None
        async for frame in generate(client, request, subject=ready.subjects.generate):
            rows = frame.top_logprobs or []
            for token_id, logprob, row in zip(
                frame.token_ids, frame.log_probs or [], rows, strict=True
            ):
                chosen = next(e for e in row if e.token_id == token_id)
                top = "  ".join(f"{e.token!r}:{e.logprob:.3f}" for e in row[:TOP_K])
                print(
                    f"{frame.seq:>3} {token_id:>5} {_show(chosen.token, chosen.bytes)}"
                    f" {logprob:>9.4f}   {top}"
                )
            if frame.finish_reason is not None:
                final = frame
        if final is None or final.finish_reason == "error":
            print(f"request failed: {final.error if final else 'no final frame'}")
            return 1
        print(f"\nfinish_reason={final.finish_reason!r} usage={final.completion_usage}\n")
        return 0
    finally:
        await client.close()


async def run_demo(argv: list[str]) -> int:
    args = build_parser().parse_args(["--dev", *argv])
    setup_logging(args.worker_log_level)
    stop = asyncio.Event()
    result: list[int] = []

    async def on_ready(ready: Ready) -> None:
        async def request_then_stop() -> None:
            try:
                result.append(await send_demo_request(ready, args.model))
            finally:
                stop.set()

        asyncio.create_task(request_then_stop())

    worker_rc = await serve(args, on_ready=on_ready, stop=stop)
    return worker_rc or (result[0] if result else 1)


def main() -> None:
    # vLLM's INFO lines in this process would drown the table (set VLLM_LOGGING_LEVEL=WARNING to
    # quiet its engine process too); the worker's own log says what loads.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    sys.exit(asyncio.run(run_demo(sys.argv[1:])))


if __name__ == "__main__":
    main()
