"""`python -m worker.client`: send one request and print its tokens with their logprobs."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from typing import cast

import nats

from messages.codec import JSON, MSGPACK
from messages.errors import ErrorCode
from messages.frames import ErrorInfo, ResponseFrame
from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
from messages.subjects import Subjects
from worker.client.library import generate, wait_for_worker
from worker.client.reader import RequestError
from worker.config import environment


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m worker.client",
        description="Send one generation request over NATS and print its tokens with logprobs.",
    )
    parser.add_argument(
        "--nats-url", default=environment().get("nats_url", "nats://127.0.0.1:4222")
    )
    parser.add_argument("--subject", default=Subjects().generate)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--token-ids", help="comma-separated prompt token ids")
    prompt.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    parser.add_argument("--tokenizer", help="tokenizer directory for --prompt (transformers)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--logprobs", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="send and receive JSON, not msgpack")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait per frame")
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="retries of an overloaded/worker_shutdown refusal on other workers",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="first wait up to this many seconds for a worker to answer $SRV.PING",
    )
    args = parser.parse_args(argv)
    if args.prompt is not None and not args.tokenizer:
        parser.error("--prompt needs --tokenizer")
    return args


async def _main(argv: list[str] | None) -> int:
    args = _parse_args(argv)
    if args.token_ids is not None:
        token_ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
    else:
        from transformers import AutoTokenizer

        token_ids = AutoTokenizer.from_pretrained(args.tokenizer)(args.prompt).input_ids
    request = GenerateRequest(
        request_id=f"cli-{uuid.uuid4().hex[:8]}",
        token_ids=token_ids,
        sampling_options=SamplingOptions(temperature=args.temperature),
        stop_conditions=StopConditions(max_tokens=args.max_tokens),
        output_options=OutputOptions(logprobs=args.logprobs),
    )
    nc = await nats.connect(args.nats_url)
    try:
        if args.wait > 0 and not await wait_for_worker(nc, args.wait):
            print(f"no worker answered $SRV.PING within {args.wait}s")
            return 1
        frames = generate(
            nc,
            request,
            subject=args.subject,
            codec=JSON if args.json else MSGPACK,
            timeout=args.timeout,
            retries=args.retries,
        )
        async for frame in _report_refusal(frames):
            rows = frame.top_logprobs or [[] for _ in frame.token_ids]
            values = frame.log_probs or [None] * len(frame.token_ids)
            for token_id, logprob, row in zip(frame.token_ids, values, rows, strict=True):
                chosen = next((e for e in row if e.token_id == token_id), None)
                text = repr(chosen.token) if chosen else ""
                alternatives = "  ".join(f"{e.token!r}:{e.logprob:.3f}" for e in row)
                print(f"{frame.index}:{token_id:>6} {text:<18} {logprob!s:>22}  {alternatives}")
            if frame.error:
                print(f"error {frame.error.code}: {frame.error.message}")
                return 1
            if frame.finish_reason is not None:
                print(
                    f"{frame.index}: finish_reason={frame.finish_reason} {frame.completion_usage}"
                )
        return 0
    finally:
        await nc.close()


async def _report_refusal(frames: AsyncIterator[ResponseFrame]) -> AsyncIterator[ResponseFrame]:
    """The frames; a refusal that outlasted every retry becomes one last error frame."""
    try:
        async for frame in frames:
            yield frame
    except RequestError as error:
        yield ResponseFrame(
            request_id="",
            seq=-1,
            finish_reason="error",
            error=ErrorInfo(cast(ErrorCode, error.code), error.message),
        )


def main(argv: list[str] | None = None) -> None:
    sys.exit(asyncio.run(_main(argv)))


if __name__ == "__main__":
    main()
