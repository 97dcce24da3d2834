"""Embeddings through the stack (the OpenAI frontend, started without `--model`, + a NATS worker
of a pooling model) ÷ vLLM's own OpenAI server, on the same tiny embedding model and engine
arguments (`--runner pooling --convert embed`): `/v1/embeddings` with `--batch` text inputs per
request, at N concurrent streams.

Every process is its own: a nats-server, the worker, the frontend, vLLM's server, and each
run's load generator (this script with `--load URL`, one process per run). Runs alternate
between the sides; each ratio (stack ÷ vLLM) is per repeat, then the median. Throughput counts
embedded inputs per second; latency is the request's.

    python -m bench.embeddings [--concurrency 16] [--requests-per-stream 8] [--batch 8]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from bench.common import load_process, percentile, table, two_sides, write_json
from bench.structured_outputs import beside_vllm

SIDES = ("stack", "vllm serve")
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def inputs(stream: int, request: int, batch: int) -> list[str]:
    """`batch` texts of 6-20 words, different for every request."""
    texts = []
    for i in range(batch):
        seed = stream * 7919 + request * 104729 + i * 31
        length = 6 + seed % 15
        texts.append(" ".join(WORDS[(seed + k * 3) % len(WORDS)] for k in range(length)))
    return texts


async def load(args: argparse.Namespace) -> dict[str, Any]:
    """One closed-loop run against `args.load` (in its own process)."""
    import aiohttp

    latencies: list[float] = []
    embedded = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(600)
    ) as session:

        async def stream(s: int) -> None:
            nonlocal embedded
            for r in range(args.requests_per_stream):
                body = {"model": args.model, "input": inputs(s, r, args.batch)}
                start = time.perf_counter()
                async with session.post(f"{args.load}/embeddings", json=body) as answer:
                    answer.raise_for_status()
                    embedded += len((await answer.json())["data"])
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(stream(s) for s in range(args.concurrency)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "embedded": embedded, "latency_s": latencies}


def run_load(args: argparse.Namespace, url: str, model: str) -> dict[str, Any]:
    return load_process(
        "bench.embeddings", "--load", url, "--model", model,
        "--concurrency", str(args.concurrency),
        "--requests-per-stream", str(args.requests_per_stream), "--batch", str(args.batch),
    )  # fmt: skip


def summary(result: dict[str, Any]) -> dict[str, float]:
    return {
        "inputs_per_s": result["embedded"] / result["wall_s"],
        "latency_p50_s": percentile(result["latency_s"], 50),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests-per-stream", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        print(json.dumps(asyncio.run(load(args))), flush=True)
        return
    from worker.dev.tiny_model import ensure_tiny_embedding_model

    model = ensure_tiny_embedding_model()
    engine_argv = ["--model", str(model), "--dtype", "float32", "--max-model-len", "512",
                   "--enforce-eager", "--seed", "0", "--runner", "pooling",
                   "--convert", "embed"]  # fmt: skip
    with beside_vllm(None, engine_argv, "embed") as urls:
        warm = argparse.Namespace(**{**vars(args), "requests_per_stream": 1})
        for side in SIDES:
            run_load(warm, urls[side], str(model))
        per_side, m, ratio = two_sides(
            SIDES, args.repeats, lambda side: summary(run_load(args, urls[side], str(model)))
        )
        row = [
            args.concurrency, args.batch,
            m["stack:inputs_per_s"], m["vllm serve:inputs_per_s"], ratio["inputs_per_s"],
            m["stack:latency_p50_s"], m["vllm serve:latency_p50_s"], ratio["latency_p50_s"],
        ]  # fmt: skip
        headers = ["streams", "inputs/request", "stack inputs/s", "vLLM inputs/s",
                   "inputs/s ratio", "stack p50 s", "vLLM p50 s", "p50 ratio"]  # fmt: skip
        print(table(headers, [row]))
        write_json("embeddings", {"args": vars(args), "rows": [row], "raw": per_side})


if __name__ == "__main__":
    main()
