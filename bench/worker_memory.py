"""Worker memory: RSS of the worker process tree minus the engine alone, after the same load.

Two child processes, one after the other, on the tiny model with the same engine settings:
- engine alone: `AsyncLLM` serving the load directly (flat logprobs 5, DELTA), nothing else;
- the worker: `python -m worker` (its CLI) on a real nats-server, serving the load over NATS.
Each is measured after its load, as the sum of RSS over the process and its children (vLLM's
engine core), and as the main process's RSS alone (where the worker's code lives).

    python -m bench.worker_memory [--streams 32] [--requests-per-stream 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys

import nats
import psutil

from bench.common import table, write_json
from bench.load import NatsSender, prompts, run
from messages.subjects import Subjects
from worker.dev.embedded import NatsServer

GOAL_MB = 60.0
MB = 1024 * 1024


def tree_rss(pid: int) -> tuple[float, float]:
    """(main process RSS, RSS summed over the process tree), in MB."""
    main = psutil.Process(pid)
    processes = [main, *main.children(recursive=True)]
    total = sum(p.memory_info().rss for p in processes if p.is_running())
    return main.memory_info().rss / MB, total / MB


async def _engine_alone(args: argparse.Namespace) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from bench.common import offline
    from worker.dev.tiny_model import ensure_tiny_model
    from worker.engine.args import tiny_engine_args

    offline()
    llm = AsyncLLM.from_engine_args(tiny_engine_args(ensure_tiny_model()))
    token_prompts = prompts(256, 32, 1024)

    async def send(request) -> tuple[float, int]:
        params = SamplingParams(
            max_tokens=request.stop_conditions.max_tokens,
            ignore_eos=True,
            temperature=0.0,
            logprobs=request.output_options.logprobs,
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        tokens = 0
        prompt = TokensPrompt(prompt_token_ids=request.token_ids)
        async for out in llm.generate(prompt, params, request.request_id):
            tokens += len(out.outputs[0].token_ids)
        return 0.0, tokens

    await run(
        send,
        token_prompts,
        concurrency=args.streams,
        requests_per_stream=args.requests_per_stream,
        max_tokens=64,
        logprobs=5,
    )
    print("loaded", flush=True)
    await asyncio.sleep(3600)


async def _wait_line(proc, pattern: str, timeout: float = 300) -> None:
    async def read() -> None:
        while line := await proc.stdout.readline():
            if re.search(pattern, line.decode(errors="replace")):
                return
        raise RuntimeError(f"child exited before printing {pattern!r}")

    await asyncio.wait_for(read(), timeout)


async def _spawn(*argv: str):
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
        start_new_session=True,
        limit=1 << 20,
    )


async def _stop(proc) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    await proc.wait()


async def main_async(args: argparse.Namespace) -> None:
    alone = await _spawn(
        "-m",
        "bench.worker_memory",
        "--engine-alone",
        "--streams",
        str(args.streams),
        "--requests-per-stream",
        str(args.requests_per_stream),
    )
    try:
        await _wait_line(alone, r"^loaded")
        engine_main, engine_tree = tree_rss(alone.pid)
    finally:
        await _stop(alone)

    server = NatsServer().start()
    worker = await _spawn(
        "-m",
        "worker",
        "--nats-url",
        server.url,
        "--namespace",
        "mem",
        "--max-logprobs",
        "20",
        "--seed",
        "0",
    )
    try:
        await _wait_line(worker, r"vllm-nats-worker ready")
        client = await nats.connect(server.url)
        sender = NatsSender(client, Subjects("mem", "vllm", "generate").generate)
        await sender.start()
        await run(
            sender,
            prompts(256, 32, 1024),
            concurrency=args.streams,
            requests_per_stream=args.requests_per_stream,
            max_tokens=64,
            logprobs=5,
        )
        worker_main, worker_tree = tree_rss(worker.pid)
        await client.close()
    finally:
        await _stop(worker)
        server.stop()
    rows = [
        ["engine alone (AsyncLLM)", engine_main, engine_tree],
        ["worker (python -m worker)", worker_main, worker_tree],
        ["worker − engine", worker_main - engine_main, worker_tree - engine_tree],
    ]
    print(table(["process", "main RSS MB", "tree RSS MB"], rows))
    extra = worker_tree - engine_tree
    print(
        f"worker adds {extra:.1f} MB (goal ≤ {GOAL_MB:.0f}: "
        f"{'met' if extra <= GOAL_MB else 'MISSED'})"
    )
    print(
        "wrote",
        write_json(
            "worker_memory",
            {
                "settings": vars(args),
                "goal_mb": GOAL_MB,
                "engine_alone_mb": {"main": engine_main, "tree": engine_tree},
                "worker_mb": {"main": worker_main, "tree": worker_tree},
                "worker_minus_engine_mb": extra,
            },
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--engine-alone", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    asyncio.run(_engine_alone(args) if args.engine_alone else main_async(args))


if __name__ == "__main__":
    main()
