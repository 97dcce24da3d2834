"""Transport ceiling: a synthetic engine through the worker ÷ raw nats-py, same bytes.

`SyntheticFastEngine` (a fake, named as one: no model) emits one token per step with a full
logprob row, as fast as the event loop lets it. It yields to the event loop every
`yield_every` steps (1: every step, so every step pays an event-loop cycle that the raw side,
which publishes a request's frames back to back, does not; 0: never, so requests interleave only
where the worker's own publish path waits). Both are measured; the second isolates the worker.
Through the real worker runtime (sessions, rows, framing, msgpack, publish) to a real
nats-server and back to a reader in the same process, that gives the worker's own ceiling in
frames/s. The baseline publishes the very frame bytes the worker sent for the same request, from
the same process, with plain `nc.publish`, and reads them back with the same reader. Ratio =
worker ÷ raw.

    python -m bench.transport_ceiling [--streams 32] [--max-tokens 64] [--logprobs 5]
        [--repeats 5] [--yield-every 1,0]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import nats

from bench.common import median, table, write_json
from bench.load import NatsSender, prompts, run
from messages.codec import MSGPACK
from messages.request import GenerateRequest
from messages.subjects import Subjects
from worker.client.requests import make_request
from worker.config import NatsConfig, WorkerConfig
from worker.dev.embedded import NatsServer
from worker.dev.fakes import SyntheticFastEngine

GOAL = 0.6


async def _record(nc, subject: str, request: GenerateRequest) -> list[bytes]:
    """The worker's frames for one request, as bytes on the wire."""
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    await nc.publish(subject, MSGPACK.encode(request), reply=inbox)
    frames: list[bytes] = []
    while True:
        msg = await subscription.next_msg(timeout=10)
        if msg.data:
            frames.append(msg.data)
            if MSGPACK.decode_frame(msg.data).finish_reason is not None:
                break
    await subscription.unsubscribe()
    return frames


def _label(yield_every: int) -> str:
    if yield_every == 0:
        return "worker, engine never yields"
    return f"worker, engine yields every {yield_every} step{'s' if yield_every > 1 else ''}"


async def main_async(args: argparse.Namespace) -> None:
    from worker.nats.runtime import open_worker

    server = NatsServer().start()
    subjects = Subjects("bench", "synthetic", "generate")
    engine = SyntheticFastEngine()
    worker = await open_worker(
        engine, WorkerConfig(nats=NatsConfig(servers=[server.url]), subjects=subjects)
    )
    client = await nats.connect(server.url)
    reader = NatsSender(client, subjects.generate)
    await reader.start()
    token_prompts = prompts(64, 32, 1024)
    recorded = await _record(
        client,
        subjects.generate,
        make_request(None, token_prompts[0], max_tokens=args.max_tokens, logprobs=args.logprobs),
    )

    async def raw(request: GenerateRequest) -> tuple[float, int]:
        return await reader.replay(request, recorded)

    yields = [int(v) for v in args.yield_every.split(",")]
    settings_of = {_label(y): y for y in yields}
    sides = {label: reader for label in settings_of}
    sides["raw nats-py"] = raw
    samples: dict[str, list[tuple[float, float]]] = {side: [] for side in sides}
    for repeat in range(args.repeats + 1):  # the first round warms up
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for side in order:
            if side in settings_of:
                engine.yield_every = settings_of[side]
            before = reader.frames
            start = time.perf_counter()
            result = await run(
                sides[side],
                token_prompts,
                concurrency=args.streams,
                requests_per_stream=args.requests_per_stream,
                max_tokens=args.max_tokens,
                logprobs=args.logprobs,
            )
            elapsed = time.perf_counter() - start
            if repeat:
                samples[side].append(((reader.frames - before) / elapsed, result.tokens_per_s))
    raw_samples = samples["raw nats-py"]
    ratios = {
        side: [w[0] / r[0] for w, r in zip(samples[side], raw_samples, strict=True)]
        for side in settings_of
    }
    rows = [
        [
            side,
            median([s[0] for s in values]),
            median([s[1] for s in values]),
            median(ratios[side]) if side in ratios else 1.0,
        ]
        for side, values in samples.items()
    ]
    print(table(["side", "frames/s", "tokens/s", "÷ raw (median of per-repeat ratios)"], rows))
    for side, side_ratios in ratios.items():
        ratio = median(side_ratios)
        print(f"{side} ÷ raw: {ratio:.3f} (goal ≥ {GOAL}: {'met' if ratio >= GOAL else 'MISSED'})")
    print(
        f"{args.streams} streams × {args.requests_per_stream} requests × {args.max_tokens} "
        f"tokens, logprobs {args.logprobs}, {len(recorded[1])} bytes per token frame"
    )
    print(
        "wrote",
        write_json(
            "transport_ceiling",
            {
                "settings": vars(args),
                "goal": GOAL,
                "ratios": ratios,
                "samples": samples,
            },
        ),
    )
    await reader.stop()
    await client.close()
    await worker.stop()
    server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--yield-every", default="1,0", help="engine yield settings to measure")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
