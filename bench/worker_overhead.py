"""Worker overhead: the NATS worker ÷ the same requests on the same in-process AsyncLLM.

One process holds one engine. The baseline sends each request straight to `AsyncLLM.generate`
with the worker's own SamplingParams; the worker side sends it over a real nats-server
(loopback) to a worker runtime on that same engine, which builds logprob rows, encodes frames and
publishes them, and the load generator decodes every frame. Runs alternate between the sides
(order flipped each repeat); ratios are per repeat, then the median.
By default the load generator shares the worker's process and event loop, so its cost is billed
to the worker side: the ratio is a lower bound. With `--load-process` it runs in a process of its
own (bench.load_process), as a frontend would; use that where there are cores to spare.

    python -m bench.worker_overhead [--concurrency 1,8,32] [--logprobs off,5,20]
        [--max-tokens 64] [--repeats 3] [--requests-per-stream 4]
        [vLLM engine args, e.g. --model PATH]

On a GPU, bench/gpu/worker_overhead.sh runs it against a worker started by its own CLI
(`--external-worker URL --load-process --concurrency 1,64,256 --max-tokens 128`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time

import nats

from bench.common import add_sweep_arguments, table, write_json
from bench.load import DirectSender, NatsSender, RunResult, alternate, prompts, runner
from bench.load_process import LoadProcess
from messages.subjects import Subjects
from worker.cli import build_parser, engine_args
from worker.client import wait_for_worker
from worker.config import NatsConfig, WorkerConfig
from worker.dev.embedded import NatsServer
from worker.engine import fast_merge as vllm_fast_merge

GOAL = {"concurrency": 32, "logprobs": 5, "tokens_per_s_ratio": 0.97}


def _parse(argv: list[str]):
    parser = build_parser()
    bench = parser.add_argument_group("benchmark")
    add_sweep_arguments(bench, "worker_overhead")
    bench.add_argument(
        "--load-process",
        action="store_true",
        help="drive the worker from a load generator in its own process",
    )
    bench.add_argument(
        "--external-worker",
        metavar="NATS_URL",
        help="drive a worker already serving on this NATS server (e.g. one started by its own "
        "CLI with the same engine args) instead of one on this process's engine",
    )
    bench.add_argument("--external-subject", default="llm.vllm.generate")
    args = parser.parse_args(argv)
    args.dev = args.dev or args.model is None  # without --model: the tiny model
    return args


async def main_async(argv: list[str]) -> None:
    from worker.engine.vllm_adapter import VllmEngine
    from worker.nats.runtime import open_worker

    args = _parse(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    logprob_levels = [None if v == "off" else int(v) for v in args.logprobs.split(",")]
    engine = await VllmEngine.start(engine_args(args))
    server = worker = None
    if args.external_worker:
        # Its own process and engine: the baseline's engine here idles while it is measured.
        url, subject = args.external_worker, args.external_subject
    else:
        server = NatsServer().start()
        url, subject = server.url, Subjects("bench", "vllm", "generate").generate
        config = WorkerConfig(
            nats=NatsConfig(servers=[url]), subjects=Subjects(*subject.split("."))
        )
        worker = await open_worker(engine, config)
    client = await nats.connect(url)
    if not await wait_for_worker(client, 600):
        raise SystemExit(f"no worker answers on {url}")
    via_nats = NatsSender(client, subject)
    await via_nats.start()
    load = None
    if args.load_process:
        load = LoadProcess(client, url, subject).start()
    direct = DirectSender(engine)
    sides = {"direct": direct, "worker": via_nats}
    token_prompts = prompts(256, args.prompt_len, engine.limits.vocab_size)
    in_process = runner(
        sides,
        token_prompts,
        max_tokens=args.max_tokens,
        requests_per_stream=args.requests_per_stream,
    )

    async def once(
        side: str,
        concurrency: int,
        logprobs: int | None,
        per_stream: int = args.requests_per_stream,
    ) -> RunResult:
        # The worker side runs as the worker's CLI serves, with the fast logprob merge; the
        # stock-vLLM baseline with vLLM's own (sides run one at a time on the shared engine).
        if side == "worker":
            vllm_fast_merge.install()
        else:
            vllm_fast_merge.uninstall()
        if side == "worker" and load is not None:
            result, _ = await load.run(
                prompt_count=len(token_prompts),
                prompt_len=args.prompt_len,
                vocab=engine.limits.vocab_size,
                concurrency=concurrency,
                requests_per_stream=per_stream,
                max_tokens=args.max_tokens,
                logprobs=logprobs,
            )
            return result
        return await in_process(side, concurrency, logprobs, per_stream)

    for side in sides:  # warm-up: first-use costs are nobody's figure
        await once(side, 4, 5, 1)
    started = time.time()
    results = await alternate(once, ("worker", "direct"), levels, logprob_levels, args.repeats)
    # What logprobs cost: each side's tokens/s with logprobs ÷ the same side without.
    off = {r["concurrency"]: r for r in results if r["logprobs"] is None}
    rows = []
    for r in results:
        base = off.get(r["concurrency"])
        vs_off = r["worker"]["tokens_per_s"] / base["worker"]["tokens_per_s"] if base else None
        rows.append(
            [
                "off" if r["logprobs"] is None else r["logprobs"],
                r["concurrency"],
                r["direct"]["tokens_per_s"],
                r["worker"]["tokens_per_s"],
                r["ratio_tokens_per_s"],
                r["direct"]["ttft_p50_ms"],
                r["worker"]["ttft_p50_ms"],
                r["direct"]["ttft_p99_ms"],
                r["worker"]["ttft_p99_ms"],
                "-" if vs_off is None else vs_off,
            ]
        )
        r["worker_vs_no_logprobs"] = vs_off
    print(
        table(
            [
                "logprobs",
                "streams",
                "AsyncLLM tok/s",
                "worker tok/s",
                "ratio",
                "AsyncLLM TTFT p50 ms",
                "worker TTFT p50 ms",
                "AsyncLLM TTFT p99 ms",
                "worker TTFT p99 ms",
                "worker ÷ no-logprobs",
            ],
            rows,
        )
    )
    print(
        f"model {engine.limits.model} ({engine.limits.engine}), max_tokens {args.max_tokens}, "
        f"{args.requests_per_stream} requests per stream, {args.repeats} repeats, "
        f"{time.time() - started:.0f} s"
    )
    settings = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))}
    print("wrote", write_json(args.name, {"settings": settings, "goal": GOAL, "results": results}))
    await via_nats.stop()
    if load is not None:
        await load.stop()
    await client.close()
    if worker is not None:
        await worker.stop()
        server.stop()
    engine.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from bench.common import offline

    offline()
    asyncio.run(main_async(sys.argv[1:]))


if __name__ == "__main__":
    main()
