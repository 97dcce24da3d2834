"""JetStream mode under load with a worker SIGKILLed mid-run: is any request lost?

Publishes `--requests` greedy requests (`--max-tokens` each, ignore_eos, logprobs k) at once to
the work queue with the client library's JetStream publisher, reads every one to its end, and
SIGKILLs the process group `--kill-pgid` (worker B: the worker, its worker processes and vLLM's
engine processes, which outlive a killed parent) once `--kill-at` of all tokens have arrived.
The killed worker's unacknowledged requests are redelivered after the consumer's ack_wait to
the survivor.

Each request is counted once, by how it ended:
- `complete`: its last attempt ended with finish_reason "length", `--max-tokens` tokens and as
  many logprobs; `redelivered` counts those of them whose frames came from more than one
  attempt (output restarted at seq 0 on the survivor);
- `retryable_after_output` (`--reader stream` only): `jetstream_stream`, the reader for a user's
  stream that cannot take output back, ends a request whose new attempt started after frames
  arrived with a retryable `engine_error`; the request was not lost (the frontend answers it
  with a retryable error), but it did not complete: counted apart;
- `error:<code>`: an error frame (e.g. the last allowed attempt failed);
- `lost`: anything else (no final frame within the per-frame timeout, frames out of order, a
  short answer). The run passes when lost = 0 and the stream holds no message afterwards.

    python -m bench.gpu.js_kill --nats-url URL --kill-pgid PGID [--requests 256]
        [--max-tokens 512] [--logprobs 5] [--kill-at 0.33] [--reader generate|stream]
        [--out js_kill.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

from bench.common import machine


async def run(args: argparse.Namespace) -> dict:
    import nats

    from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
    from messages.subjects import Subjects
    from worker.client import RequestError, find_worker, jetstream_generate, jetstream_stream
    from worker.nats.intake.jetstream import stream_name

    subjects = Subjects(*args.subject.split("."))
    nc = await nats.connect(args.nats_url)
    deadline = time.monotonic() + args.wait
    while await find_worker(nc, args.subject, window=1.0, jetstream=True) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"no JetStream-mode worker on {args.subject} via {args.nats_url}")
        await asyncio.sleep(1.0)

    rng = random.Random(19)
    total = args.requests * args.max_tokens
    received = 0
    killed_at: dict = {}
    start = time.perf_counter()
    ends: list[float] = []

    def kill() -> None:
        killed_at.update(s=time.perf_counter() - start, tokens=received)
        if args.kill_pgid:
            try:
                os.killpg(args.kill_pgid, signal.SIGKILL)
                killed_at["signal"] = "SIGKILL"
            except ProcessLookupError:
                killed_at["signal"] = "no such process group"
        print(
            f"killed pgid {args.kill_pgid} at {killed_at['s']:.1f} s, {received} of {total} "
            f"tokens ({killed_at['signal'] if args.kill_pgid else 'dry run'})",
            flush=True,
        )

    async def one(i: int) -> dict:
        nonlocal received
        request = GenerateRequest(
            request_id=f"jskill-{i}",
            token_ids=[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)],
            sampling_options=SamplingOptions(temperature=0.0),
            stop_conditions=StopConditions(max_tokens=args.max_tokens, ignore_eos=True),
            output_options=OutputOptions(logprobs=args.logprobs),
        )
        reader = jetstream_stream if args.reader == "stream" else jetstream_generate
        attempts: list[int] = []
        tokens = logprobs = 0
        last = None
        outcome = "lost"
        detail = ""
        try:
            async for frame in reader(nc, request, subjects=subjects, timeout=args.timeout):
                if not attempts or frame.attempt != attempts[-1]:
                    attempts.append(frame.attempt or 0)
                    tokens = logprobs = 0  # a new attempt replaces the older one's output
                tokens += len(frame.token_ids)
                logprobs += len(frame.log_probs or [])
                received += len(frame.token_ids)
                last = frame
                if not killed_at and received >= args.kill_at * total:
                    kill()
            if last is not None and last.error:
                outcome, detail = f"error:{last.error.code}", last.error.message
            elif (
                last is not None
                and last.finish_reason == "length"
                and tokens == args.max_tokens
                and (args.logprobs is None or logprobs == tokens)
            ):
                outcome = "complete"
            else:
                detail = f"ended with {last and last.finish_reason}, {tokens} tokens"
        except RequestError as error:
            outcome = "retryable_after_output" if error.code == "engine_error" else "lost"
            detail = str(error)
        except Exception as error:  # timeout, frame order: the request did not end
            detail = repr(error)
        ends.append(time.perf_counter() - start)
        return {"id": request.request_id, "outcome": outcome, "attempts": attempts,
                "tokens": tokens, "detail": detail}  # fmt: skip

    results = await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - start
    if not killed_at:
        kill()  # never reached the threshold: say so in the record
        killed_at["late"] = True

    # The queue afterwards: nothing left in the stream, nothing awaiting an ack.
    js = nc.jetstream(timeout=5.0)
    name = stream_name(subjects, _settings(args))
    state: dict = {}
    settle = time.monotonic() + 15.0
    while True:
        info = await js.stream_info(name)
        consumer = await js.consumer_info(name, args.durable)
        state = {"messages": info.state.messages, "ack_pending": consumer.num_ack_pending,
                 "delivered": consumer.delivered.stream_seq}  # fmt: skip
        if (state["messages"] == 0 and state["ack_pending"] == 0) or time.monotonic() > settle:
            break
        await asyncio.sleep(0.5)
    await nc.close()

    counts = Counter(r["outcome"] for r in results)
    redelivered = sum(1 for r in results if r["outcome"] == "complete" and len(r["attempts"]) > 1)
    lost = [r for r in results if r["outcome"] == "lost"]
    summary = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "logprobs": args.logprobs,
        "reader": args.reader,
        "wall_s": wall,
        "killed": killed_at,
        "outcomes": dict(counts),
        "complete_redelivered": redelivered,
        "lost": len(lost),
        "lost_requests": lost,
        "queue_after": state,
        "last_end_s": max(ends, default=None),
        "passed": not lost and state.get("messages") == 0 and state.get("ack_pending") == 0,
    }
    print(
        f"{args.requests} requests × {args.max_tokens} tokens (logprobs {args.logprobs}, reader "
        f"{args.reader}) in {wall:.1f} s: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + f"; complete after redelivery {redelivered}; queue after: {state}"
    )
    print(f"lost = {len(lost)}" + ("" if not lost else f": {[r['id'] for r in lost]}"))
    for r in lost[:10]:
        print(f"  {r['id']}: attempts {r['attempts']}, {r['tokens']} tokens, {r['detail']}")
    other = [r for r in results if r["outcome"] not in ("complete", "lost")]
    for r in other[:5]:
        print(f"  {r['id']} {r['outcome']}: attempts {r['attempts']}, {r['detail']}")
    print("PASS" if summary["passed"] else "FAIL")
    return {"machine": machine(), "settings": vars(args), **summary, "results": results}


def _settings(args: argparse.Namespace):
    from worker.config import JetStreamSettings

    return JetStreamSettings(durable=args.durable)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu.js_kill", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--subject", default="llm.vllm.generate", help="the generate subject")
    parser.add_argument("--durable", default="vllm-workers", help="the workers' --js-durable")
    parser.add_argument("--kill-pgid", type=int, help="process group to SIGKILL (none: dry run)")
    parser.add_argument("--kill-at", type=float, default=0.33, help="fraction of all tokens")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--logprobs", type=int, default=5, help="-1: none")
    parser.add_argument("--reader", choices=("generate", "stream"), default="generate")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per frame")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for a worker")
    parser.add_argument("--out", default="js_kill.json")
    args = parser.parse_args()
    if args.logprobs < 0:
        args.logprobs = None
    result = asyncio.run(run(args))
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    raise SystemExit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
