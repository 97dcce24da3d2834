"""A worker on the synthetic fake engine (worker.dev.fakes.SyntheticFastEngine: no model, fixed
tokens as fast as it can), for benchmarks of what is in front of a worker (the frontend), never
served by the CLI.

    python -m bench.synthetic_worker NATS_URL [--subject bench.synthetic.generate]
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from messages.subjects import Subjects
from worker.config import NatsConfig, WorkerConfig
from worker.dev.fakes import SyntheticFastEngine
from worker.nats.runtime import open_worker


async def serve(url: str, subject: str) -> None:
    namespace, component, endpoint = subject.split(".")
    config = WorkerConfig(
        nats=NatsConfig(servers=[url]), subjects=Subjects(namespace, component, endpoint)
    )
    worker = await open_worker(SyntheticFastEngine(), config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("synthetic worker ready", flush=True)  # after the handlers: a stop now is clean
    await stop.wait()
    await worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("--subject", default="bench.synthetic.generate")
    args = parser.parse_args()
    asyncio.run(serve(args.url, args.subject))


if __name__ == "__main__":
    main()
