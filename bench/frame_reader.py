"""Frame reader: µs per message for a reader of a reply subscription (the client library's
frame reader, so the frontend's per-token cost): nats-py's `Subscription.next_msg` ÷
`worker.client.Inbox`.

A real nats-server (embedded); one connection publishes `--messages` small messages to a
subject, the other reads them one by one, both in this process (as the frontend: many readers on
one event loop). `--streams` readers at once, each on its own subject. Sides alternate per repeat.

    python -m bench.frame_reader [--messages 20000] [--streams 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import nats

from bench.common import median, table, write_json
from worker.client.reader import Inbox
from worker.dev.embedded import NatsServer


async def _one(url: str, side: str, streams: int, messages: int) -> float:
    """µs of wall time per message read, over all streams."""
    sub_nc, pub_nc = await nats.connect(url), await nats.connect(url)
    per_stream = messages // streams
    subjects = [f"reader.{i}" for i in range(streams)]
    if side == "next_msg":
        readers = [await sub_nc.subscribe(s) for s in subjects]
    else:
        readers = [await Inbox.open(sub_nc, s) for s in subjects]
    await sub_nc.flush()

    async def read(reader) -> None:
        for _ in range(per_stream):
            await reader.next_msg(timeout=30)

    async def publish(subject: str) -> None:
        for i in range(per_stream):
            await pub_nc.publish(subject, b"x" * 64)
            if i % 16 == 0:
                await asyncio.sleep(0)  # frames arrive spread out, as tokens do

    start = time.perf_counter()
    await asyncio.gather(*(read(r) for r in readers), *(publish(s) for s in subjects))
    elapsed = time.perf_counter() - start
    for reader in readers:
        await reader.unsubscribe()
    await sub_nc.close()
    await pub_nc.close()
    return elapsed / (per_stream * streams) * 1e6


async def measure(args: argparse.Namespace) -> None:
    with NatsServer(jetstream=False) as server:
        runs: dict[str, list[float]] = {"next_msg": [], "Inbox": []}
        for _ in range(args.repeats):
            for side in runs:
                runs[side].append(await _one(server.url, side, args.streams, args.messages))
    ratios = [a / b for a, b in zip(runs["Inbox"], runs["next_msg"], strict=True)]
    rows = [
        [side, f"{median(v):.2f}", ", ".join(f"{x:.2f}" for x in v)] for side, v in runs.items()
    ]
    print(table(["reader", "µs per message (median)", "runs"], rows))
    print(f"Inbox ÷ next_msg per repeat: {', '.join(f'{r:.2f}' for r in ratios)}")
    write_json("frame_reader", {"settings": vars(args), "runs": runs, "ratios": ratios})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.frame_reader")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    asyncio.run(measure(parser.parse_args()))


if __name__ == "__main__":
    main()
