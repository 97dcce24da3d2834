"""What vLLM's KV cache events cost a busy engine core's step loop, on this host.

The engine core's one thread steps through Python (the scheduler, the model runner's host work)
and, with `--kv-events` (the worker's default), also builds a `BlockStored` for every block a
step fills and a `BlockRemoved` for the cached blocks it evicts, and hands each step's batch to
vLLM's own `ZmqEventPublisher`, whose thread encodes and sends it under the same GIL. This
stands in a synthetic step for the engine core's (pure Python for `--step-ms`, then a GIL release
as a step's wait for the device gives one) and runs it three ways, rotating the order each
repeat, a subscriber process reading every batch as a worker does: no events (`off`); the events
through vLLM's publisher (`vllm`); the same events encoded and sent from the step's own thread
(`inline`: msgspec and a non-blocking ZMQ send, no hand-off to another thread), the design a
change upstream could take. Steps per second of each ÷ `off`, per repeat. It bounds what the
events cost the engine core; it does not reproduce its cache effects or the GPU step.

    python -m bench.kv_events_cost --step-ms 2.3 --blocks-per-step 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from bench.common import machine, median, table, write_json

# Reads every batch of both publishers, as a worker's reader does (one SUB socket on both).
SUBSCRIBER = """
import sys, zmq
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"kv")
for endpoint in sys.argv[1:]:
    sub.connect(endpoint)
print("ready", flush=True)
while True:
    sub.recv_multipart()
"""


def busy(seconds: float) -> None:
    """Pure Python for `seconds`, holding the GIL throughout, as the scheduler's work does."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i * i


def step_events(first_hash: int, blocks: int, block_size: int) -> Any:
    """One step's batch as vLLM's block pool builds it: `blocks` full blocks stored, each
    chained to the one before, and as many cached blocks evicted to make room."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    events: list[Any] = [
        BlockStored(
            block_hashes=[first_hash + i],
            parent_block_hash=first_hash + i - 1,
            token_ids=list(range(first_hash + i, first_hash + i + block_size)),
            block_size=block_size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        for i in range(blocks)
    ]
    events.append(
        BlockRemoved(block_hashes=list(range(first_hash, first_hash + blocks)), medium="GPU")
    )
    return KVEventBatch(ts=time.time(), events=events)


def run_phase(publish: Callable[[int], None] | None, seconds: float, step_s: float) -> float:
    """Steps per second of the synthetic loop for `seconds`, `publish(step)` after each step's
    Python work (None: no events)."""
    steps = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        busy(step_s)
        if publish is not None:
            publish(steps)
        time.sleep(0)  # the step's wait for the device: the GIL is free for a moment
        steps += 1
    return steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=7.0, help="the step's Python work")
    parser.add_argument(
        "--blocks-per-step", type=int, default=16, help="blocks filled (and evicted) a step"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0, help="each run")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import msgspec
    import zmq
    from vllm.distributed.kv_events import EventPublisherFactory

    from worker.engine import kv_events

    # The worker's own publisher settings (`--kv-events`, its default), made as its CLI makes
    # them for an engine with prefix caching on.
    engine_args = SimpleNamespace(
        enable_prefix_caching=None, data_parallel_size=1, kv_events_config=None
    )
    kv_events.configure(engine_args)
    config = engine_args.kv_events_config
    endpoint = config.endpoint
    directory = tempfile.mkdtemp(prefix="kv-events-cost-")
    inline_endpoint = f"ipc://{os.path.join(directory, 'inline')}"
    publisher = EventPublisherFactory.create(config, 0)
    inline: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    inline.bind(inline_endpoint)
    encoder = msgspec.msgpack.Encoder()
    blocks, size = args.blocks_per_step, args.block_size

    def via_vllm(step: int) -> None:
        publisher.publish(step_events(step * blocks, blocks, size))

    def via_inline(step: int) -> None:
        payload = encoder.encode(step_events(step * blocks, blocks, size))
        inline.send_multipart((b"kv", step.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    sides: dict[str, Callable[[int], None] | None] = {
        "off": None,
        "vllm": via_vllm,
        "inline": via_inline,
    }
    subscriber = subprocess.Popen(
        [sys.executable, "-c", SUBSCRIBER, endpoint, inline_endpoint],
        stdout=subprocess.PIPE,
        text=True,
    )
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        assert subscriber.stdout is not None and subscriber.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        names = list(sides)
        for repeat in range(args.repeats):
            # The order rotates each repeat, so a drift of the host's speed favours no side.
            for name in names[repeat % 3 :] + names[: repeat % 3]:
                rates[name].append(run_phase(sides[name], args.seconds, args.step_ms / 1000))
    finally:
        publisher.shutdown()
        inline.close(linger=0)
        subscriber.kill()
        subscriber.wait()
        shutil.rmtree(directory, ignore_errors=True)

    ratios = {
        name: [a / b for a, b in zip(rates[name], rates["off"], strict=True)] for name in sides
    }
    print(
        f"step {args.step_ms} ms of Python, {blocks} blocks stored and evicted a step, "
        f"{args.repeats} repeats of {args.seconds} s, order rotated"
    )
    print(
        table(
            ["events", "steps/s per repeat", "median", "÷ off per repeat", "median ÷ off"],
            [
                [
                    name,
                    ", ".join(f"{r:.1f}" for r in rates[name]),
                    f"{median(rates[name]):.1f}",
                    ", ".join(f"{r:.3f}" for r in ratios[name]),
                    f"{median(ratios[name]):.3f}",
                ]
                for name in sides
            ],
        )
    )
    write_json(
        "kv_events_cost",
        {"machine": machine(), "settings": vars(args), "rates": rates, "ratios": ratios},
    )


if __name__ == "__main__":
    main()
