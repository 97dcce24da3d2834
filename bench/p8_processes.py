"""P8 worker processes: one running worker (any `--worker-processes N`) driven over NATS from a
load process of its own (bench.load_process), at one concurrency, logprobs off/5/20.

The GPU script (bench/gpu/g16_runs.sh) starts the worker with N = 1, 2, 4 in turn, runs this
against each and then `--compare` to print the ratios to N = 1 from the JSON files.

    python -m bench.p8_processes --nats-url URL --label n2 [--concurrency 256]
        [--logprobs off,5,20] [--max-tokens 128] [--requests-per-stream 2] [--repeats 3]
        [--vocab 32000]
    python -m bench.p8_processes --compare n1,n2,n4
"""

from __future__ import annotations

import argparse
import asyncio
import json

import nats

from bench.common import OUT_DIR, median, table, write_json
from bench.load_process import LoadProcess
from worker.client import wait_for_worker


async def measure(args: argparse.Namespace) -> None:
    client = await nats.connect(args.nats_url)
    if not await wait_for_worker(client, 600):
        raise SystemExit(f"no worker answers on {args.nats_url}")
    load = LoadProcess(client, args.nats_url, args.subject).start()
    results = []
    for level in args.logprobs.split(","):
        logprobs = None if level == "off" else int(level)
        runs = []
        for _ in range(args.repeats):
            result, _ = await load.run(
                prompt_count=256,
                prompt_len=32,
                vocab=args.vocab,
                concurrency=args.concurrency,
                requests_per_stream=args.requests_per_stream,
                max_tokens=args.max_tokens,
                logprobs=logprobs,
            )
            runs.append(result)
        rates = [r.tokens_per_s for r in runs]
        results.append(
            {
                "logprobs": level,
                "tokens_per_s": median(rates),
                "tokens_per_s_runs": rates,
                "ttft_p50_ms": median([r.ttft_ms(50) for r in runs]),
                "ttft_p99_ms": median([r.ttft_ms(99) for r in runs]),
            }
        )
        print(
            f"{args.label} logprobs={level}: {median(rates):,.0f} tok/s "
            f"({', '.join(f'{r:,.0f}' for r in rates)}), "
            f"TTFT p50 {results[-1]['ttft_p50_ms']:.0f} ms",
            flush=True,
        )
    await load.stop()
    await client.close()
    write_json(f"p8_{args.label}", {"settings": vars(args), "results": results})


def compare(labels: list[str]) -> None:
    data = {
        label: {
            r["logprobs"]: r
            for r in json.loads((OUT_DIR / f"p8_{label}.json").read_text())["results"]
        }
        for label in labels
    }
    base = data[labels[0]]
    rows = []
    for label in labels:
        for level, r in data[label].items():
            rows.append(
                [
                    label,
                    level,
                    r["tokens_per_s"],
                    f"{min(r['tokens_per_s_runs']):,.0f}–{max(r['tokens_per_s_runs']):,.0f}",
                    r["tokens_per_s"] / base[level]["tokens_per_s"],
                    r["ttft_p50_ms"],
                    r["ttft_p50_ms"] / base[level]["ttft_p50_ms"],
                ]
            )
    print(
        table(
            [
                "worker",
                "logprobs",
                "tok/s",
                "range",
                f"÷ {labels[0]}",
                "TTFT p50 ms",
                f"TTFT ÷ {labels[0]}",
            ],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.p8_processes")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--subject", default="llm.vllm.generate")
    parser.add_argument("--label", default="worker")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--logprobs", default="off,5,20")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--compare", help="comma-separated labels: print ratios to the first")
    args = parser.parse_args()
    if args.compare:
        compare(args.compare.split(","))
        return
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
