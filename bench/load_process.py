"""A load generator in its own process, driven over NATS: the worker side's client then does not
share the worker's event loop (or its core), as a real frontend would not.

The parent sends a run's settings as a NATS request to `<control>`; this process runs
`bench.load.run` with a `NatsSender` against the worker (or, with `--openai-url`, an
`OpenAISender` against an OpenAI-compatible server such as `vllm serve`) and answers with the
RunResult. Prompts are rebuilt from (count, length, vocab, seed), so both processes use the same
ones.

    python -m bench.load_process --nats-url URL --control SUBJECT
        (--subject SUBJECT | --openai-url http://HOST:PORT/v1 --model NAME)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
from typing import Any

import msgspec
import nats

from bench.load import LibrarySender, NatsSender, OpenAISender, RunResult, prompts, run
from worker.shared.nats_compat import flush_ordered


class RunSpec(msgspec.Struct):
    prompt_count: int
    prompt_len: int
    vocab: int
    concurrency: int
    requests_per_stream: int
    max_tokens: int
    logprobs: int | None


class RunAnswer(msgspec.Struct):
    wall_s: float
    tokens: int
    ttft_s: list[float]
    frames: int


async def serve(
    nats_url: str,
    subject: str,
    control: str,
    openai: tuple[str, str] | None,
    library_migration_limit: int | None = None,
) -> None:
    nc = await nats.connect(nats_url)
    http = None
    sender: NatsSender | OpenAISender | LibrarySender
    if library_migration_limit is not None:
        sender = LibrarySender(nc, subject, library_migration_limit)
    elif openai is None:
        sender = NatsSender(nc, subject)
        await sender.start()
    else:
        import aiohttp

        # No connection cap (aiohttp's default of 100 would cap the server's concurrency).
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(600)
        )
        sender = OpenAISender(http, *openai)
    done = asyncio.Event()

    async def on_run(msg) -> None:
        if not msg.data:
            done.set()
            await msg.respond(b"")
            return
        spec = msgspec.json.decode(msg.data, type=RunSpec)
        before = getattr(sender, "frames", 0)
        result = await run(
            sender,
            prompts(spec.prompt_count, spec.prompt_len, spec.vocab),
            concurrency=spec.concurrency,
            requests_per_stream=spec.requests_per_stream,
            max_tokens=spec.max_tokens,
            logprobs=spec.logprobs,
        )
        frames = getattr(sender, "frames", 0) - before
        answer = RunAnswer(result.wall_s, result.tokens, result.ttft_s, frames)
        await msg.respond(msgspec.json.encode(answer))

    await nc.subscribe(control, cb=on_run)
    await flush_ordered(nc)
    print("ready", flush=True)
    await done.wait()
    if isinstance(sender, NatsSender):
        await sender.stop()
    if http is not None:
        await http.close()
    await nc.drain()


_LOAD_PROCESSES = itertools.count()


class LoadProcess:
    """The parent's handle: `await load.run(spec)` → RunResult measured in the child."""

    def __init__(
        self,
        nc,
        nats_url: str,
        subject: str,
        openai: tuple[str, str] | None = None,
        library_migration_limit: int | None = None,
    ) -> None:
        """`openai`: (base URL, model) to load an OpenAI-compatible server instead of the
        worker (the control channel stays on NATS). `library_migration_limit`: send through
        the client library with this migration limit (bench.load.LibrarySender)."""
        self.nc = nc
        self.control = f"_bench.control.{os.getpid()}.{next(_LOAD_PROCESSES)}"
        self._argv = [
            sys.executable, "-m", "bench.load_process",
            "--nats-url", nats_url, "--subject", subject, "--control", self.control,
        ]  # fmt: skip
        if openai is not None:
            self._argv += ["--openai-url", openai[0], "--model", openai[1]]
        if library_migration_limit is not None:
            self._argv += ["--library-migration-limit", str(library_migration_limit)]
        self._process: subprocess.Popen[str] | None = None

    def start(self) -> LoadProcess:
        self._process = subprocess.Popen(self._argv, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        if self._process.stdout.readline().strip() != "ready":
            raise RuntimeError("the load process did not start")
        return self

    async def run(self, **spec: Any) -> tuple[RunResult, int]:
        msg = await self.nc.request(
            self.control, msgspec.json.encode(RunSpec(**spec)), timeout=1800
        )
        answer = msgspec.json.decode(msg.data, type=RunAnswer)
        return RunResult(answer.wall_s, answer.tokens, answer.ttft_s), answer.frames

    async def stop(self) -> None:
        if self._process is None:
            return
        await self.nc.request(self.control, b"", timeout=30)
        self._process.wait(timeout=30)
        self._process = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--subject", required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--openai-url", help="load this OpenAI-compatible server instead")
    parser.add_argument("--model", help="the model name the OpenAI server serves")
    parser.add_argument(
        "--library-migration-limit",
        type=int,
        help="send through the client library (worker.client.generate) with this migration limit",
    )
    args = parser.parse_args()
    openai = (args.openai_url, args.model) if args.openai_url else None
    limit = args.library_migration_limit
    asyncio.run(serve(args.nats_url, args.subject, args.control, openai, limit))


if __name__ == "__main__":
    main()
