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


async def main(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.nats_url)
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    await nc.publish(f"$SRV.STATS.{SERVICE_NAME}", b"", reply=inbox)
    lines = []
    try:
        while True:
            msg = await subscription.next_msg(timeout=args.window)
            stats = json.loads(msg.data)
            parts = [
                f"{e['name']} {e['num_requests']} req, "
                f"{e['average_processing_time'] / 1e6:.0f} ms mean"
                for e in stats.get("endpoints") or []
            ]
            lines.append(f"{stats['metadata'].get('instance_id', stats['id'])}: {'; '.join(parts)}")
    except nats.errors.TimeoutError:
        pass
    finally:
        await nc.close()
    print("\n".join(sorted(lines)) or "no worker answered")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--window", type=float, default=0.5)
    asyncio.run(main(parser.parse_args()))
