"""The NATS worker ÷ vLLM's own OpenAI server (its peer) on the same model, prompts and settings.

Both sides run the same engine arguments in their own engine: the worker in this process (as in
bench.worker_overhead, driven over a real nats-server), vLLM's server as a child process on
loopback, driven by streamed `/v1/completions` calls (aiohttp, one connection pool). Runs
alternate between the sides; ratios are per repeat, then the median. The load generators of
both sides share this process and its event loop.

    python -m bench.vs_vllm_serve [--concurrency 1,8,32] [--logprobs off,5,20]
        [--max-tokens 64] [--repeats 5] [--requests-per-stream 8]
        [vLLM engine args, e.g. --model PATH]

Engine args go unchanged to both sides (without --model: the tiny model, fp32, eager).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

import nats

from bench.common import add_sweep_arguments, table, write_json
from bench.load import NatsSender, OpenAISender, alternate, prompts, runner
from bench.vllm_server import VllmOpenAIServer
from messages.subjects import Subjects
from worker.config import NatsConfig, WorkerConfig
from worker.dev.embedded import NatsServer

GOAL = {"tokens_per_s_ratio": 1.25, "ttft_p50_ratio": 0.8}
SIDES = ("worker", "vllm serve")


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    bench = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_arguments(bench, "vs_vllm_serve")
    args, engine_argv = bench.parse_known_args(argv)
    if "--model" not in engine_argv:
        from worker.dev.tiny_model import ensure_tiny_model

        engine_argv = [
            "--model",
            str(ensure_tiny_model()),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--enforce-eager",
            *engine_argv,
        ]
    if not any(a.startswith("--max-logprobs") for a in engine_argv):
        engine_argv += ["--max-logprobs", "20"]
    return args, engine_argv


async def main_async(argv: list[str]) -> None:
    import aiohttp

    from worker.cli import build_parser, engine_args
    from worker.engine import fast_merge as vllm_fast_merge
    from worker.engine.vllm_adapter import VllmEngine
    from worker.nats.runtime import open_worker

    args, engine_argv = _parse(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    logprob_levels = [None if v == "off" else int(v) for v in args.logprobs.split(",")]
    peer = VllmOpenAIServer(engine_argv)
    peer.start()
    try:
        # The worker's side as its CLI serves it; the peer is another process (stock vLLM).
        vllm_fast_merge.install()
        engine = await VllmEngine.start(engine_args(build_parser().parse_args(engine_argv)))
        server = NatsServer().start()
        subjects = Subjects("bench", "vllm", "generate")
        config = WorkerConfig(nats=NatsConfig(servers=[server.url]), subjects=subjects)
        worker = await open_worker(engine, config)
        client = await nats.connect(server.url)
        via_nats = NatsSender(client, subjects.generate)
        await via_nats.start()
        connector = aiohttp.TCPConnector(limit=0)
        http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(600))
        sides = {
            "worker": via_nats,
            "vllm serve": OpenAISender(http, peer.base_url, peer.models[0]),
        }
        token_prompts = prompts(256, args.prompt_len, engine.limits.vocab_size)
        results = await _measure(args, sides, token_prompts, levels, logprob_levels)
        _report(args, results, engine.limits, engine_argv)
        await http.close()
        await via_nats.stop()
        await client.close()
        await worker.stop()
        engine.shutdown()
        server.stop()
    finally:
        peer.stop()


async def _measure(args, sides, token_prompts, levels, logprob_levels) -> list[dict]:
    once = runner(
        sides,
        token_prompts,
        max_tokens=args.max_tokens,
        requests_per_stream=args.requests_per_stream,
    )

    for side in sides:  # warm-up: first-use costs are nobody's figure
        await once(side, 4, 5, 1)
    return await alternate(once, SIDES, levels, logprob_levels, args.repeats)


def _report(args, results: list[dict], limits, engine_argv: list[str]) -> None:
    rows = [
        [
            "off" if r["logprobs"] is None else r["logprobs"],
            r["concurrency"],
            r["vllm serve"]["tokens_per_s"],
            r["worker"]["tokens_per_s"],
            r["ratio_tokens_per_s"],
            r["vllm serve"]["ttft_p50_ms"],
            r["worker"]["ttft_p50_ms"],
            r["ratio_ttft_p50"],
        ]
        for r in results
    ]
    print(
        table(
            [
                "logprobs",
                "streams",
                "vllm serve tok/s (SSE text + logprob maps)",
                "worker tok/s (msgpack token ids + rows)",
                "tok/s ratio",
                "vllm serve TTFT p50 ms",
                "worker TTFT p50 ms",
                "TTFT p50 ratio",
            ],
            rows,
        )
    )
    print(
        f"model {limits.model} ({limits.engine}), max_tokens {args.max_tokens}, "
        f"{args.requests_per_stream} requests per stream, {args.repeats} repeats; "
        f"goals: tok/s ratio ≥ {GOAL['tokens_per_s_ratio']}, TTFT ratio ≤ {GOAL['ttft_p50_ratio']}"
    )
    settings = {**vars(args), "engine_argv": engine_argv}
    print("wrote", write_json(args.name, {"settings": settings, "goal": GOAL, "results": results}))


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from bench.common import offline

    offline()
    # SIGTERM (a timeout, a CI cancel) unwinds like an exception, so vLLM's server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    asyncio.run(main_async(sys.argv[1:]))
    print(f"{time.time() - started:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
