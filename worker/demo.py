"""One-command demo: embedded nats-server + tiny model + worker + one streamed request.

    python -m worker.demo

Prints each generated token as its frame arrives, with its logprob and the top alternatives.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import nats

from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
from worker.client import generate
from worker.config import NatsConfig, WorkerConfig
from worker.embedded import NatsServer
from worker.tiny_model import cpu_env_defaults, ensure_tiny_model, tiny_engine_args
from worker.transport import connect

PROMPT = "Hello world → the tiny model says"
TOP_K = 3


def _show(token: str, raw: bytes) -> str:
    return f"{token!r:<16} {raw.hex(' '):<24}"


async def run_demo() -> int:
    from transformers import AutoTokenizer

    from worker.service import Worker
    from worker.vllm_engine import VllmEngine

    cpu_env_defaults()
    model = ensure_tiny_model()
    with NatsServer() as server:
        print(f"embedded nats-server: {server.url}   (try: nats --server {server.url} sub '>')")
        engine = await VllmEngine.start(tiny_engine_args(model))
        config = WorkerConfig(nats=NatsConfig(servers=[server.url]))
        worker_nc = await connect(config.nats)
        worker = Worker(engine, worker_nc, config)
        await worker.start()
        client = await nats.connect(server.url)
        try:
            tokenizer = AutoTokenizer.from_pretrained(model)
            token_ids = tokenizer(PROMPT).input_ids
            request = GenerateRequest(
                request_id="demo-1",
                token_ids=token_ids,
                sampling_options=SamplingOptions(temperature=0.0),
                stop_conditions=StopConditions(max_tokens=16, ignore_eos=True),
                output_options=OutputOptions(logprobs=TOP_K),
            )
            print(f"\nprompt {PROMPT!r} → token_ids {token_ids}")
            print(
                f"request on {config.subjects.generate}: greedy, max_tokens 16, logprobs {TOP_K}\n"
            )
            print(f"{'seq':>3} {'id':>5} {'token':<16} {'bytes':<24} {'logprob':>9}   top {TOP_K}")
            final = None
            async for frame in generate(client, request, subject=config.subjects.generate):
                rows = frame.top_logprobs or [[] for _ in frame.token_ids]
                for token_id, logprob, row in zip(
                    frame.token_ids, frame.log_probs or [], rows, strict=True
                ):
                    chosen = next(e for e in row if e.token_id == token_id)
                    top = "  ".join(f"{e.token!r}:{e.logprob:.3f}" for e in row[:TOP_K])
                    print(
                        f"{frame.seq:>3} {token_id:>5} {_show(chosen.token, chosen.bytes)}"
                        f" {logprob:>9.4f}   {top}"
                    )
                if frame.finish_reason is not None:
                    final = frame
            if final is None or final.finish_reason == "error":
                print(f"request failed: {final.error if final else 'no final frame'}")
                return 1
            print(f"\nfinish_reason={final.finish_reason!r} usage={final.completion_usage}")
            return 0
        finally:
            await client.close()
            await worker.stop()
            await worker_nc.close()
            engine.shutdown()


def main() -> None:
    # vLLM's per-step INFO lines would drown the table; our own log says what loads when.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("worker").setLevel(logging.INFO)
    sys.exit(asyncio.run(run_demo()))


if __name__ == "__main__":
    main()
