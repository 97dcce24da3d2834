"""How a benchmark's requests spread over the worker's processes: every answer to
`$SRV.STATS.<service>` within a window, one line per process with its requests per endpoint
(the queue group's `generate`, the router's `generate-direct`) and its mean processing time.

    python -m bench.worker_stats [--nats-url URL] [--window 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json

import nats

from messages.subjects import SERVICE_NAME
from worker.client.library import discovery_answers


async def main(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.nats_url)
    lines = []
    try:
        async for data in discovery_answers(nc, f"$SRV.STATS.{SERVICE_NAME}", args.window):
            stats = json.loads(data)
            parts = [
                f"{e['name']} {e['num_requests']} req, "
                f"{e['average_processing_time'] / 1e6:.0f} ms mean"
                for e in stats.get("endpoints") or []
            ]
            lines.append(f"{stats['metadata'].get('instance_id', stats['id'])}: {'; '.join(parts)}")
    finally:
        await nc.close()
    print("\n".join(sorted(lines)) or "no worker answered")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--window", type=float, default=0.5)
    asyncio.run(main(parser.parse_args()))
