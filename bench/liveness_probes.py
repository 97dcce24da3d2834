"""Liveness probes the worker sends per second with N requests in flight.

The worker probes its clients with empty NATS requests to reply subjects (worker/nats/liveness.py).
Each probe of a live client arrives there as an empty message, so the load is counted where it
lands: empty messages received by the clients, per second of a steady window. Requests run on a
named fake engine (`worker.dev.fakes.PacedFakeEngine`: one token every `--step` s), since the
point is the probing at a concurrency a CPU engine cannot hold, not generation.

    python -m bench.liveness_probes [--in-flight 256] [--clients 1,4,16] [--window 10]

Run on two commits, it compares their probing (bench/RESULTS.md has such a pair).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import nats

from bench.common import table, write_json
from messages.codec import MSGPACK
from messages.request import GenerateRequest, OutputOptions, StopConditions
from messages.subjects import Subjects
from worker.config import NatsConfig, WorkerConfig
from worker.dev.embedded import NatsServer
from worker.dev.fakes import PacedFakeEngine
from worker.nats.runtime import open_worker


async def _measure(
    url: str, in_flight: int, clients: int, window: float, interval: float, step: float
) -> dict:
    engine = PacedFakeEngine(step_s=step)
    subjects = Subjects("probes", "fake", "generate")
    config = WorkerConfig(
        nats=NatsConfig(servers=[url]), subjects=subjects, liveness_interval_s=interval
    )
    worker = await open_worker(engine, config)
    connections = [await nats.connect(url) for _ in range(clients)]
    probes = 0
    counting = False

    async def on_message(msg) -> None:
        nonlocal probes
        if not msg.data and counting:
            probes += 1

    # Long enough to outlast the window: every request stays in flight while probes are counted.
    tokens = int((window + 2 * interval + 5) / step)
    subscriptions = []
    for i in range(in_flight):
        nc = connections[i % clients]
        inbox = nc.new_inbox()
        subscriptions.append(await nc.subscribe(inbox, cb=on_message))
        request = GenerateRequest(
            request_id=f"probe-{i}",
            token_ids=[1, 2, 3],
            stop_conditions=StopConditions(max_tokens=tokens),
            output_options=OutputOptions(logprobs=1),
        )
        await nc.publish(subjects.generate, MSGPACK.encode(request), reply=inbox)
    for nc in connections:
        await nc.flush()
    while worker.service.in_flight < in_flight:
        await asyncio.sleep(0.05)
    await asyncio.sleep(interval)  # one round first: the count starts in steady state
    counting = True
    started = time.monotonic()
    await asyncio.sleep(window)
    counting = False
    elapsed = time.monotonic() - started
    held = worker.service.in_flight
    for subscription in subscriptions:
        await subscription.unsubscribe()
    for nc in connections:
        await nc.close()
    await worker.stop()
    return {
        "in_flight": in_flight,
        "clients": clients,
        "held_in_flight": held,
        "window_s": elapsed,
        "probes": probes,
        "probes_per_s": probes / elapsed,
        "probes_per_request_per_interval": probes / elapsed * interval / in_flight,
    }


async def main_async(args: argparse.Namespace) -> None:
    server = NatsServer().start()
    try:
        results = [
            await _measure(
                server.url, args.in_flight, int(c), args.window, args.interval, args.step
            )
            for c in args.clients.split(",")
        ]
    finally:
        server.stop()
    print(
        table(
            ["clients", "in flight", "probes/s", "probes per request per interval"],
            [
                [
                    r["clients"],
                    r["held_in_flight"],
                    r["probes_per_s"],
                    r["probes_per_request_per_interval"],
                ]
                for r in results
            ],
        )
    )
    print(f"liveness interval {args.interval}s, window {args.window}s")
    print("wrote", write_json(args.name, {"settings": vars(args), "results": results}))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.liveness_probes")
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=2.0, help="liveness interval (s)")
    parser.add_argument("--step", type=float, default=0.1, help="fake engine s per token")
    parser.add_argument("--name", default="liveness_probes")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
