"""`python -m worker.client`: send one request and print its tokens with their logprobs (or,
with `--json`, each frame as it came, one JSON object per line).

Every failure ends with one line on stderr and exit status 1: an error frame, no worker on the
subject, no connection to NATS, no frame in time, bad arguments (argparse: exit 2).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, cast

import msgspec
import nats.errors
from msgspec import UNSET

from messages.codec import JSON, MSGPACK
from messages.errors import ErrorCode
from messages.frames import ErrorInfo, ResponseFrame
from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
from messages.subjects import Subjects
from worker.client.library import discover_workers, generate, jetstream_stream, subjects_of
from worker.client.migration import MIGRATION_LIMIT
from worker.client.reader import FrameOrderError, RequestError
from worker.client.stops import stop_cut
from worker.shared.nats_connection import ConnectFailed, connect
from worker.shared.nats_options import LOCAL_URL, add_nats_arguments, nats_config


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("at least one integer")
    return values


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m worker.client",
        description="Send one generation request over NATS and print its tokens with logprobs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_nats_arguments(parser, url_default=LOCAL_URL)
    parser.add_argument("--subject", default=Subjects().generate, help="the generate subject")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--token-ids", type=_int_list, help="comma-separated prompt token ids")
    prompt.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    parser.add_argument(
        "--tokenizer", help="tokenizer directory (transformers): for --prompt, and to print text"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--n", type=int, default=1, help="choices")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop-token-ids", type=_int_list, default=None)
    parser.add_argument(
        "--stop", action="append", default=None, help="a stop string (repeat for several)"
    )
    parser.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="keep the matched stop string in the printed text",
    )
    parser.add_argument("--logprobs", type=int, default=3, help="top logprobs per token")
    parser.add_argument("--prompt-logprobs", type=int, default=None)
    parser.add_argument(
        "--json", action="store_true", help="print each frame as JSON, one per line (raw frames)"
    )
    parser.add_argument(
        "--wire", choices=("msgpack", "json"), default="msgpack", help="the request's encoding"
    )
    parser.add_argument(
        "--jetstream",
        action="store_true",
        help="publish to the JetStream work queue of --subject's workers (--mode jetstream): "
        "<namespace>.<component>.queue.<endpoint>",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait per frame")
    parser.add_argument(
        "--retries",
        type=int,
        default=2,
        help="retries of an overloaded/worker_shutdown refusal on other workers",
    )
    parser.add_argument(
        "--migration-limit",
        type=int,
        default=MIGRATION_LIMIT,
        help="times the request may continue on another worker when the one serving it dies or "
        "drains; 0: off (default: %(default)s)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="first wait up to this many seconds for a worker that serves --subject",
    )
    args = parser.parse_args(argv)
    if args.prompt is not None and not args.tokenizer:
        parser.error("--prompt needs --tokenizer")
    return args


def _fail(message: str) -> int:
    print(message, file=sys.stderr, flush=True)
    return 1


async def _wait_for_subject(nc: Any, subject: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await discover_workers(nc, subject, window=0.5):
            return True
        await asyncio.sleep(0.5)
    return False


async def _main(argv: list[str] | None) -> int:
    args = _parse_args(argv)
    tokenizer: Any = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    token_ids = args.token_ids if args.prompt is None else tokenizer(args.prompt).input_ids
    request = GenerateRequest(
        request_id=f"cli-{uuid.uuid4().hex[:8]}",
        token_ids=token_ids,
        sampling_options=SamplingOptions(
            n=args.n, temperature=args.temperature, top_p=args.top_p, seed=args.seed
        ),
        stop_conditions=StopConditions(
            max_tokens=args.max_tokens,
            stop_token_ids=args.stop_token_ids,
            stop=args.stop,
            include_stop_str_in_output=args.include_stop_str_in_output or None,
        ),
        output_options=OutputOptions(logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs),
    )
    try:
        # Bounded attempts (NatsConfig.start_attempts): a wrong URL is one line, not retries.
        config = nats_config(args, name="vllm-nats-client")
        nc = await connect(config, attempts=config.start_attempts)
    except ConnectFailed as error:
        return _fail(f"error: {error}")
    try:
        if args.wait > 0 and not await _wait_for_subject(nc, args.subject, args.wait):
            return _fail(f"error: no worker serves {args.subject} (waited {args.wait:g} s)")
        codec = JSON if args.wire == "json" else MSGPACK
        if args.jetstream:
            frames = jetstream_stream(
                nc,
                request,
                subjects=subjects_of(args.subject),
                codec=codec,
                timeout=args.timeout,
                migration_limit=args.migration_limit,
            )
        else:
            frames = generate(
                nc,
                request,
                subject=args.subject,
                codec=codec,
                timeout=args.timeout,
                retries=args.retries,
                migration_limit=args.migration_limit,
            )
        # Closed here, before the connection: printing may stop at an error frame.
        async with aclosing(_report_errors(frames, args.timeout)) as reported:
            return await _print(reported, args.json, tokenizer, args.include_stop_str_in_output)
    finally:
        await nc.close()


async def _print(
    frames: AsyncIterator[ResponseFrame], raw: bool, tokenizer: Any, include_stop: bool
) -> int:
    generated: dict[int, list[int]] = {}
    async for frame in frames:
        if raw:
            print(msgspec.json.encode(frame).decode(), flush=True)
        generated.setdefault(frame.index, []).extend(frame.token_ids)
        if frame.error:
            return _fail(f"error {frame.error.code}: {frame.error.message}")
        if raw:
            continue
        rows = frame.top_logprobs or [[] for _ in frame.token_ids]
        values = frame.log_probs or [None] * len(frame.token_ids)
        for token_id, logprob, row in zip(frame.token_ids, values, rows, strict=True):
            chosen = next((e for e in row if e.token_id == token_id), None)
            text = repr(chosen.token) if chosen else ""
            alternatives = "  ".join(f"{e.token!r}:{e.logprob:.3f}" for e in row)
            print(f"{frame.index}:{token_id:>6} {text:<18} {logprob!s:>22}  {alternatives}")
        if frame.finish_reason is not None:
            stop = "" if frame.stop_reason is UNSET else f" stop_reason={frame.stop_reason!r}"
            print(
                f"{frame.index}: finish_reason={frame.finish_reason}{stop} {frame.completion_usage}"
            )
            if tokenizer is not None:
                tokens = generated[frame.index]
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                if isinstance(frame.stop_reason, str):
                    before = tokenizer.decode(tokens[:-1], skip_special_tokens=True)
                    text = text[: stop_cut(text, len(before), frame.stop_reason, include_stop)]
                print(f"{frame.index}: text={text!r}")
    return 0


async def _report_errors(
    frames: AsyncGenerator[ResponseFrame, None], timeout: float
) -> AsyncGenerator[ResponseFrame, None]:
    """The frames; what ends the request without an error frame (a refusal that outlasted every
    retry, no worker on the subject, silence, lost frames) becomes one last error frame."""
    try:
        async with aclosing(frames):
            async for frame in frames:
                yield frame
    except RequestError as error:
        code, message = error.code, error.message
    except nats.errors.TimeoutError:
        code, message = "deadline_exceeded", f"no frame within {timeout:g} s"
    except FrameOrderError as error:
        code, message = "internal_error", f"frames lost in transit: {error}"
    else:
        return
    yield ResponseFrame(
        request_id="",
        seq=-1,
        finish_reason="error",
        error=ErrorInfo(cast(ErrorCode, code), message),
    )


def main(argv: list[str] | None = None) -> None:
    sys.exit(asyncio.run(_main(argv)))


if __name__ == "__main__":
    main()
