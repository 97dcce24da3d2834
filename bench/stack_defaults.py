"""The whole OpenAI stack at its defaults (nats-server, `python -m worker` and `python -m
worker.frontend` with no process or tuning flags) ÷ vLLM's own OpenAI server
(`python -m vllm.entrypoints.openai.api_server`) on the same tiny model and engine flags:
streamed `/v1/completions` with token-id prompts, greedy, `ignore_eos`, logprobs off / 5 / 20,
at N concurrent streams.

Every process is its own, and each run's load generator too (this script with `--load URL`, one
HTTP client process per run, aiohttp without a connection cap). Runs alternate between the
sides; each ratio (stack ÷ vLLM) is per repeat, then the median. TTFT is the first chunk with
text or a token.

    python -m bench.stack_defaults [--concurrency 32] [--requests-per-stream 4]
        [--max-tokens 64] [--logprobs off,5,20] [--repeats 3]
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


async def load(args: argparse.Namespace) -> dict[str, Any]:
    """One closed-loop run against `args.load` (in its own process)."""
    import aiohttp

    ttfts: list[float] = []
    tokens = 0
    logprobs = None if args.level == "off" else int(args.level)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(600)
    ) as session:

        async def one(s: int, r: int) -> None:
            nonlocal tokens
            prompt = [1] + [300 + (s * 31 + r * 7 + k) % 600 for k in range(31)]
            body: dict[str, Any] = {
                "model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            if logprobs is not None:
                body["logprobs"] = logprobs
            start = time.perf_counter()
            first = None
            async with session.post(f"{args.load}/completions", json=body) as answer:
                answer.raise_for_status()
                async for line in answer.content:
                    if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"]:
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
            ttfts.append((first or time.perf_counter()) - start)

        async def stream(s: int) -> None:
            for r in range(args.requests_per_stream):
                await one(s, r)

        start = time.perf_counter()
        await asyncio.gather(*(stream(s) for s in range(args.concurrency)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "ttft_s": ttfts}


def run_load(
    args: argparse.Namespace, url: str, model: str, level: str, failures: list[str] | None = None
) -> dict[str, float]:
    """One run's figures. A run whose load process fails (a server that dropped a stream:
    vLLM's own server did once, 2026-12-07) is run once more, and why goes to `failures`."""
    argv = (
        "bench.stack_defaults", "--load", url, "--model", model,
        "--level", level, "--concurrency", str(args.concurrency),
        "--requests-per-stream", str(args.requests_per_stream),
        "--max-tokens", str(args.max_tokens),
    )  # fmt: skip
    try:
        result = load_process(*argv)
    except SystemExit as failure:
        if failures is None:
            raise
        why = str(failure).strip().splitlines()[-1]
        failures.append(f"{url} logprobs {level}: {why}")
        print(f"a run failed and runs again: {failures[-1]}", flush=True)
        result = load_process(*argv)
    return {
        "tokens_per_s": result["tokens"] / result["wall_s"],
        "ttft_p50_s": percentile(result["ttft_s"], 50),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--logprobs", default="off,5,20")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--level", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        print(json.dumps(asyncio.run(load(args))), flush=True)
        return
    from worker.dev.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    engine_argv = ["--model", str(model), "--dtype", "float32", "--max-model-len", "512",
                   "--enforce-eager", "--seed", "0", "--max-logprobs", "20"]  # fmt: skip
    with beside_vllm(model, engine_argv, "defaults") as urls:
        warm = argparse.Namespace(**{**vars(args), "requests_per_stream": 1})
        for side in SIDES:
            run_load(warm, urls[side], str(model), "5")
        rows, raw = [], {}
        failures: list[str] = []
        for level in args.logprobs.split(","):

            def measure(side: str, level: str = level) -> dict[str, float]:
                return run_load(args, urls[side], str(model), level, failures)

            raw[level], m, ratio = two_sides(SIDES, args.repeats, measure)
            rows.append([
                level, args.concurrency,
                m["stack:tokens_per_s"], m["vllm serve:tokens_per_s"], ratio["tokens_per_s"],
                m["stack:ttft_p50_s"], m["vllm serve:ttft_p50_s"], ratio["ttft_p50_s"],
            ])  # fmt: skip
        headers = ["logprobs", "streams", "stack tok/s", "vLLM tok/s", "tok/s ratio",
                   "stack TTFT p50 s", "vLLM TTFT p50 s", "TTFT ratio"]  # fmt: skip
        print(table(headers, rows))
        print(f"runs failed and run again: {failures or 'none'}")
        write_json(
            "stack_defaults",
            {"args": vars(args), "rows": rows, "raw": raw, "urls": urls, "failed_runs": failures},
        )


if __name__ == "__main__":
    main()
