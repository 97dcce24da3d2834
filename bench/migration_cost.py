"""What migration costs a stream that is never disturbed: the client library with migration on
(its default limit, 3) ÷ off (0), against the same worker, each side sent from a load process of
its own (bench.load_process with `--library-migration-limit`).

The worker runs the synthetic fake engine (bench.synthetic_worker: no model, fixed tokens and
rows as fast as it can) in a process of its own, so the client's per-frame work (reading,
`Seam.translate`) is the largest share of a stream it can be: a real engine only makes it
smaller. Runs alternate between the sides (order flipped each repeat); each ratio is per
repeat, then the median.

    python -m bench.migration_cost [--concurrency 8,32] [--logprobs off,5]
        [--max-tokens 256] [--repeats 6] [--requests-per-stream 8]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import nats

from bench.common import add_sweep_arguments, table, write_json
from bench.load import RunResult, alternate
from bench.load_process import LoadProcess
from worker.dev.embedded import NatsServer

SIDES = ("migration on", "migration off")
LIMITS = {"migration on": 3, "migration off": 0}
SUBJECT = "bench.synthetic.generate"
VOCAB = 1024


async def main_async(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_arguments(parser, "migration_cost")
    parser.set_defaults(concurrency="8,32", logprobs="off,5", max_tokens=256, repeats=6)
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    logprob_levels = [None if v == "off" else int(v) for v in args.logprobs.split(",")]
    with NatsServer() as server:
        worker = subprocess.Popen(
            [sys.executable, "-m", "bench.synthetic_worker", server.url, "--subject", SUBJECT],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert worker.stdout is not None and "ready" in worker.stdout.readline()
        nc = await nats.connect(server.url)
        loads = {
            side: LoadProcess(nc, server.url, SUBJECT, library_migration_limit=limit).start()
            for side, limit in LIMITS.items()
        }
        try:

            async def once(side: str, concurrency: int, logprobs: int | None) -> RunResult:
                result, _ = await loads[side].run(
                    prompt_count=256,
                    prompt_len=args.prompt_len,
                    vocab=VOCAB,
                    concurrency=concurrency,
                    requests_per_stream=args.requests_per_stream,
                    max_tokens=args.max_tokens,
                    logprobs=logprobs,
                )
                return result

            for side in SIDES:  # warm-up: first-use costs are nobody's figure
                await once(side, 4, 5)
            results = await alternate(once, SIDES, levels, logprob_levels, args.repeats)
        finally:
            for load in loads.values():
                await load.stop()
            await nc.close()
            worker.terminate()
            worker.wait(30)
    rows = [
        [
            "off" if r["logprobs"] is None else r["logprobs"],
            r["concurrency"],
            r["migration off"]["tokens_per_s"],
            r["migration on"]["tokens_per_s"],
            r["ratio_tokens_per_s"],
            min(r["ratios"]),
            max(r["ratios"]),
            r["ratio_ttft_p50"],
        ]
        for r in results
    ]
    print(
        table(
            [
                "logprobs",
                "streams",
                "off tok/s",
                "on tok/s",
                "on ÷ off tok/s (median)",
                "min",
                "max",
                "on ÷ off TTFT p50",
            ],
            rows,
        )
    )
    write_json(args.name, {"args": vars(args), "results": results})


def main() -> None:
    asyncio.run(main_async(sys.argv[1:]))


if __name__ == "__main__":
    main()
