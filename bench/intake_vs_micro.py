"""Intake: the generate subject as a plain queue subscription ÷ as a NATS micro endpoint (why
generate is not a nats-py micro endpoint: README "Discovery and health"). Both sides hand each
request to the same service core (`RequestService.accept`) on the same named fake engine
(`SyntheticFastEngine`, one token per request, so the intake is most of the work):
- "plain": the worker's own intake (worker/nats/intake/core.py): a queue subscription whose
  callback builds a Delivery from the message;
- "micro": a nats-py micro endpoint (`micro.add_service` + `add_endpoint`) whose handler does the
  same hand-off, frames published the same way (this side reads micro's private `_msg.reply`:
  it exists only to be measured).
Each side is driven by its own load process (bench.load_process), runs alternate, and the ratio
is plain ÷ micro per repeat, then the median.

    python -m bench.intake_vs_micro [--concurrency 1,32] [--requests-per-stream 200]
        [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import nats
from nats import micro
from nats.micro.request import Request

from bench.common import median, table, write_json
from bench.load_process import LoadProcess
from messages.subjects import Subjects
from worker.config import NatsConfig, WorkerConfig
from worker.dev.embedded import NatsServer
from worker.dev.fakes import SyntheticFastEngine
from worker.nats.liveness import NatsReply
from worker.nats.runtime import WorkerRuntime, open_worker
from worker.service import Delivery
from worker.shared.nats_connection import connect


async def _micro_side(worker: WorkerRuntime, nc: nats.NATS, subject: str) -> micro.Service:
    async def handler(request: Request) -> None:
        # Frames go out as the plain side's do (liveness-gated, to the reply subject), so only the
        # intake differs. micro's Request has no public reply subject: this private read is
        # what serving generate as a micro endpoint would need (one reason it is not).
        reply = NatsReply(worker.liveness, request._msg.reply)
        delivery = Delivery(request.data, request.headers, reply, subject, time.monotonic_ns())
        await worker.service.accept(delivery)

    service = await micro.add_service(nc, name="intake-micro", version="0.0.1")
    await service.add_endpoint(name="generate", subject=subject, handler=handler)
    return service


async def main_async(args: argparse.Namespace) -> None:
    server = NatsServer().start()
    connections = []
    try:
        engine = SyntheticFastEngine()
        plain = Subjects("intake", "plain", "generate")
        micro_subject = "intake.micro.generate"
        nc_plain = await connect(NatsConfig(servers=[server.url]))
        nc_micro = await connect(NatsConfig(servers=[server.url]))
        connections += [nc_plain, nc_micro]
        plain_worker = await open_worker(
            engine, WorkerConfig(nats=NatsConfig(servers=[server.url]), subjects=plain), nc=nc_plain
        )
        # The micro side's runtime serves its own intake on subjects nothing publishes to; its
        # requests come through the micro endpoint below.
        micro_worker = await open_worker(
            engine,
            WorkerConfig(
                nats=NatsConfig(servers=[server.url]),
                subjects=Subjects("intake", "micro", "unused"),
            ),
            nc=nc_micro,
        )
        service = await _micro_side(micro_worker, nc_micro, micro_subject)
        control = await nats.connect(server.url)
        connections.append(control)
        loads = {
            "plain": LoadProcess(control, server.url, plain.generate).start(),
            "micro": LoadProcess(control, server.url, micro_subject).start(),
        }

        async def once(side: str, concurrency: int, per_stream: int) -> tuple[float, float]:
            result, _ = await loads[side].run(
                prompt_count=64,
                prompt_len=8,
                vocab=engine.limits.vocab_size,
                concurrency=concurrency,
                requests_per_stream=per_stream,
                max_tokens=1,
                logprobs=None,
            )
            return result.tokens / result.wall_s, result.ttft_ms(50)

        for side in loads:  # warm-up
            await once(side, 4, 20)
        rows, results = [], []
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            runs: dict[str, list[tuple[float, float]]] = {"plain": [], "micro": []}
            for repeat in range(args.repeats):
                order = ("plain", "micro") if repeat % 2 == 0 else ("micro", "plain")
                for side in order:
                    runs[side].append(await once(side, concurrency, args.requests_per_stream))
            ratios = [p[0] / m[0] for p, m in zip(runs["plain"], runs["micro"], strict=True)]
            entry = {
                "concurrency": concurrency,
                "plain_requests_per_s": median([r[0] for r in runs["plain"]]),
                "micro_requests_per_s": median([r[0] for r in runs["micro"]]),
                "plain_p50_ms": median([r[1] for r in runs["plain"]]),
                "micro_p50_ms": median([r[1] for r in runs["micro"]]),
                "ratio": median(ratios),
                "ratios": ratios,
            }
            results.append(entry)
            rows.append(
                [
                    concurrency,
                    entry["micro_requests_per_s"],
                    entry["plain_requests_per_s"],
                    entry["ratio"],
                    entry["micro_p50_ms"],
                    entry["plain_p50_ms"],
                ]
            )
        print(
            table(
                [
                    "streams",
                    "micro req/s",
                    "plain req/s",
                    "plain ÷ micro",
                    "micro p50 ms",
                    "plain p50 ms",
                ],
                rows,
            )
        )
        print(f"{args.requests_per_stream} one-token requests per stream, {args.repeats} repeats")
        print("wrote", write_json(args.name, {"settings": vars(args), "results": results}))
        for load in loads.values():
            await load.stop()
        await service.stop()
        await plain_worker.stop()
        await micro_worker.stop()
    finally:
        for nc in connections:
            await nc.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.intake_vs_micro")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--requests-per-stream", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", default="intake_vs_micro")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
