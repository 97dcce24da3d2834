"""A LoRA adapter's request throughput ÷ the base model's, on the same worker: one worker
(`python -m worker --enable-lora --lora-modules tiny-lora=…`, the tiny model and its seeded
adapter) and the same requests (greedy, `ignore_eos`, logprobs 5), once naming the adapter in
`model` and once not, at N concurrent streams.

Each run's load generator is its own process (this script with `--load URL`, sending through
`worker.client`); runs alternate between base and adapter; each ratio is per repeat, then the
median. What LoRA costs is the engine's (punica's kernels on the CPU); the worker adds one
lookup of the adapter's name.

    python -m bench.lora_throughput [--concurrency 16] [--requests-per-stream 4]
        [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.common import load_process, table, write_json
from bench.structured_outputs import ROOT, stop

SIDES = ("base", "tiny-lora")
SUBJECT = "llm.vllm.generate"


async def load(args: argparse.Namespace) -> dict[str, Any]:
    """One closed-loop run against the worker (in its own process)."""
    import nats

    from worker.client import complete
    from worker.client.requests import make_request

    nc = await nats.connect(args.load)
    tokens = 0

    async def stream(s: int) -> None:
        nonlocal tokens
        for r in range(args.requests_per_stream):
            prompt = [1] + [300 + (s * 13 + r * 7 + k) % 600 for k in range(16)]
            request = make_request(None, prompt, max_tokens=args.max_tokens, logprobs=5)
            request.model = args.adapter or None
            done = await complete(nc, request, subject=SUBJECT)
            assert done.error is None, done.error
            tokens += len(done.choices[0].token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(stream(s) for s in range(args.concurrency)))
    wall = time.perf_counter() - start
    await nc.close()
    return {"wall_s": wall, "tokens": tokens}


def run_load(args: argparse.Namespace, url: str, adapter: str) -> float:
    result = load_process(
        "bench.lora_throughput", "--load", url, "--adapter", adapter,
        "--concurrency", str(args.concurrency),
        "--requests-per-stream", str(args.requests_per_stream),
        "--max-tokens", str(args.max_tokens),
    )  # fmt: skip
    return float(result["tokens"] / result["wall_s"])


def start_worker(url: str) -> subprocess.Popen[bytes]:
    from bench.common import OUT_DIR
    from bench.kv_routing import worker_env
    from worker.dev.tiny_model import ensure_tiny_lora, ensure_tiny_model

    log = OUT_DIR / "lora_worker.log"
    command = [
        sys.executable, "-m", "worker", "--nats-url", url, "--model", str(ensure_tiny_model()),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--seed", "0",
        "--enable-lora", "--max-lora-rank", "8", "--lora-modules",
        f"tiny-lora={ensure_tiny_lora(seed=1)}",
    ]  # fmt: skip
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    worker = subprocess.Popen(
        command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=worker_env(), cwd=ROOT
    )
    deadline = time.monotonic() + 600
    while "vllm-nats-worker ready" not in log.read_text(errors="replace"):
        if worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"worker not ready:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    return worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        print(json.dumps(asyncio.run(load(args))), flush=True)
        return
    from worker.dev.embedded import NatsServer

    nats_server = NatsServer().start()
    things: list[Any] = [nats_server]
    try:
        things.insert(0, start_worker(nats_server.url))
        adapters = {"base": "", "tiny-lora": "tiny-lora"}
        warm = argparse.Namespace(**{**vars(args), "requests_per_stream": 1})
        for side in SIDES:
            run_load(warm, nats_server.url, adapters[side])
        per_side: dict[str, list[float]] = {side: [] for side in SIDES}
        ratios = []
        for repeat in range(args.repeats):
            order = SIDES if repeat % 2 == 0 else SIDES[::-1]
            got = {side: run_load(args, nats_server.url, adapters[side]) for side in order}
            for side in SIDES:
                per_side[side].append(got[side])
            ratios.append(got["tiny-lora"] / got["base"])
        row = [
            args.concurrency, args.max_tokens,
            statistics.median(per_side["base"]), statistics.median(per_side["tiny-lora"]),
            statistics.median(ratios),
        ]  # fmt: skip
        headers = ["streams", "max_tokens", "base tok/s", "adapter tok/s", "adapter ÷ base"]
        print(table(headers, [row]))
        write_json("lora_throughput", {"args": vars(args), "rows": [row], "raw": per_side})
    finally:
        stop(things)


if __name__ == "__main__":
    main()
