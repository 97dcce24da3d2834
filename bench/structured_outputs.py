"""Structured-output chat requests through the stack (the OpenAI frontend + a NATS worker) ÷ vLLM's
own OpenAI server, on the same model and engine arguments: streamed `/v1/chat/completions` with a
`response_format` json_schema, or a `structured_outputs` choice, at N concurrent streams.

Every process is its own: a nats-server, the worker (`python -m worker`), the frontend
(`python -m worker.frontend`), vLLM's server, and each run's load generator (this script with
`--load URL`, one process per run, so neither side's client shares a server's event loop or
core). Runs alternate between the sides; each ratio (stack ÷ vLLM) is per repeat, then the
median. Tokens are the answers' `usage.completion_tokens` (a constrained answer stops where its
grammar ends); TTFT is the first chunk that carries content.

    python -m bench.structured_outputs [--concurrency 32] [--requests-per-stream 4]
        [--max-tokens 64] [--repeats 3] [--kinds json_schema,choice]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import load_process, percentile, table, two_sides, write_json
from bench.vllm_server import VllmOpenAIServer, free_port

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("stack", "vllm serve")
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
KINDS: dict[str, dict[str, Any]] = {
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        }
    },
    "choice": {"structured_outputs": {"choice": ["sunny", "rainy", "cloudy", "windy"]}},
}


def body(model: str, kind: str, index: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Describe person number {index}, please."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **KINDS[kind],
    }


async def one(session: Any, url: str, payload: dict[str, Any]) -> tuple[float, int]:
    start = time.perf_counter()
    first, tokens = None, 0
    async with session.post(f"{url}/chat/completions", json=payload) as answer:
        answer.raise_for_status()
        async for line in answer.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (first or time.perf_counter()) - start, tokens


async def load(args: argparse.Namespace) -> dict[str, Any]:
    """One closed-loop run against `args.load` (in its own process)."""
    import aiohttp

    ttfts: list[float] = []
    tokens = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(600)
    ) as session:

        async def stream(s: int) -> None:
            nonlocal tokens
            for r in range(args.requests_per_stream):
                payload = body(args.model, args.kind, s * 1000 + r, args.max_tokens)
                ttft, count = await one(session, args.load, payload)
                ttfts.append(ttft)
                tokens += count

        start = time.perf_counter()
        await asyncio.gather(*(stream(s) for s in range(args.concurrency)))
        wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "ttft_s": ttfts}


def run_load(args: argparse.Namespace, url: str, model: str, kind: str) -> dict[str, Any]:
    return load_process(
        "bench.structured_outputs", "--load", url, "--model", model,
        "--kind", kind, "--concurrency", str(args.concurrency),
        "--requests-per-stream", str(args.requests_per_stream),
        "--max-tokens", str(args.max_tokens),
    )  # fmt: skip


def wait_http(url: str, process: subprocess.Popen[bytes], log: Path, within: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url} exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} not ready in {within} s")


def start_stack(
    model: Path | None, engine_argv: list[str], out: Path, name: str = "so"
) -> tuple[list[Any], str]:
    """nats-server, the worker and the frontend (with `--model`, or, None, learning the model
    from the worker); returns (what to stop, the frontend's /v1)."""
    from bench.kv_routing import worker_env
    from worker.dev.embedded import NatsServer

    nats_server = NatsServer().start()
    worker_log, frontend_log = out / f"{name}_worker.log", out / f"{name}_frontend.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "worker", "--nats-url", nats_server.url, *engine_argv],
        stdout=worker_log.open("wb"), stderr=subprocess.STDOUT, env=worker_env(), cwd=ROOT,
    )  # fmt: skip
    port = free_port()
    frontend = subprocess.Popen(
        [sys.executable, "-m", "worker.frontend", "--nats-url", nats_server.url,
         *(["--model", str(model)] if model is not None else []),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        stdout=frontend_log.open("wb"), stderr=subprocess.STDOUT, env=worker_env(), cwd=ROOT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", frontend, frontend_log)
    if worker.poll() is not None:
        raise SystemExit(f"worker exited:\n{worker_log.read_text()[-3000:]}")
    return [frontend, worker, nats_server], base + "/v1"


@contextlib.contextmanager
def beside_vllm(model: Path | None, engine_argv: list[str], name: str) -> Iterator[dict[str, str]]:
    """The stack (`start_stack`) and vLLM's own server on the same engine args, both ready:
    their `/v1` URLs by side ("stack", "vllm serve"); both stopped after."""
    from bench.common import OUT_DIR

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    peer = VllmOpenAIServer(engine_argv).launch()
    stack: list[Any] = []
    try:
        stack, stack_url = start_stack(model, engine_argv, OUT_DIR, name)
        peer.wait_ready()
        yield {"stack": stack_url, "vllm serve": peer.base_url}
    finally:
        stop(stack)
        peer.stop()


def stop(things: list[Any]) -> None:
    for thing in things:
        if isinstance(thing, subprocess.Popen):
            thing.terminate()
            try:
                thing.wait(timeout=60)
            except subprocess.TimeoutExpired:
                thing.kill()
        else:
            thing.stop()


def summary(result: dict[str, Any]) -> dict[str, float]:
    return {
        "tokens_per_s": result["tokens"] / result["wall_s"],
        "ttft_p50_s": percentile(result["ttft_s"], 50),
        "tokens": result["tokens"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="json_schema,choice")
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        print(json.dumps(asyncio.run(load(args))), flush=True)
        return
    from worker.dev.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    engine_argv = ["--model", str(model), "--dtype", "float32", "--max-model-len", "512",
                   "--enforce-eager", "--seed", "0"]  # fmt: skip
    with beside_vllm(model, engine_argv, "so") as urls:
        rows, raw = [], {}
        for kind in args.kinds.split(","):
            for side in SIDES:  # warm-up: compile each constraint once per side
                run_load(argparse.Namespace(**{**vars(args), "requests_per_stream": 1}),
                         urls[side], str(model), kind)  # fmt: skip

            def measure(side: str, kind: str = kind) -> dict[str, float]:
                return summary(run_load(args, urls[side], str(model), kind))

            raw[kind], m, ratio = two_sides(SIDES, args.repeats, measure)
            rows.append([
                kind, args.concurrency,
                m["stack:tokens_per_s"], m["vllm serve:tokens_per_s"], ratio["tokens_per_s"],
                m["stack:ttft_p50_s"], m["vllm serve:ttft_p50_s"], ratio["ttft_p50_s"],
            ])  # fmt: skip
        headers = ["kind", "streams", "stack tok/s", "vLLM tok/s", "tok/s ratio",
                   "stack TTFT p50 s", "vLLM TTFT p50 s", "TTFT ratio"]  # fmt: skip
        print(table(headers, rows))
        write_json("structured_outputs", {"args": vars(args), "rows": rows, "raw": raw})


if __name__ == "__main__":
    main()
