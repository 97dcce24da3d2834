"""Worker processes: one running worker (any `--worker-processes N`) or OpenAI server, loaded
from a load process of its own (bench.load_process) at one concurrency, logprobs off/5/20; each
labelled side's figures go to bench/out/side_<label>.json, and `--compare` sets sides against
baselines from those files.

The GPU script (bench/gpu/worker_processes.sh) runs the engine's ceiling (bench.ceiling), vLLM's
own server (`vllm serve --api-server-count 4`, loaded by the same load process over HTTP), the
worker with N processes and the OpenAI stack, one at a time, and `--compare` prints the ratios.

    python -m bench.worker_processes --nats-url URL --label n2 [--concurrency 256]
        [--logprobs off,5,20] [--max-tokens 128] [--requests-per-stream 2] [--repeats 3]
        [--vocab 32000] [--metrics-url http://127.0.0.1:9090/metrics] [--warmup 1]
        [--cpu-of worker=PID,frontend=PID,nats=PID]
    python -m bench.worker_processes --label serve4 --openai-url http://127.0.0.1:8000/v1 --model M
    python -m bench.worker_processes --compare serve4,n1,n2,n4 --to ceiling,serve4
    python -m bench.worker_processes --compare stack44,n4 --to serve4 --rounds r1,r2,r3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

import nats

from bench import cpu_cost, first_token
from bench.common import OUT_DIR, median, table, write_json
from bench.load import RunResult
from bench.load_process import LoadProcess
from worker.client import wait_for_worker


def side_name(label: str) -> str:
    """The JSON name (under bench/out/) of one labelled side; bench.ceiling writes the same."""
    return f"side_{label}"


def side_path(label: str) -> Path:
    return OUT_DIR / f"{side_name(label)}.json"


def read_round(label: str, round_: str, rounds: list[str]) -> dict[str, Any] | None:
    """One side's JSON in one of `rounds`. A side run once for all rounds (the ceiling, one
    engine start) has no round's file and is read from side_<label>.json in each; a side with
    round files but not this round's did not run in it (None)."""
    path = side_path(f"{label}-{round_}")
    if not path.exists():
        if any(side_path(f"{label}-{rd}").exists() for rd in rounds):
            return None
        path = side_path(label)
    side: dict[str, Any] = json.loads(path.read_text())
    return side


async def measure(args: argparse.Namespace) -> None:
    client = await nats.connect(args.nats_url)
    openai = (args.openai_url, args.model) if args.openai_url else None
    if openai is None and not await wait_for_worker(client, 600):
        raise SystemExit(f"no worker answers on {args.nats_url}")
    load = LoadProcess(client, args.nats_url, args.subject, openai).start()

    async def run(requests_per_stream: int, max_tokens: int, logprobs: int | None) -> RunResult:
        result, _ = await load.run(
            prompt_count=256,
            prompt_len=32,
            vocab=args.vocab,
            concurrency=args.concurrency,
            requests_per_stream=requests_per_stream,
            max_tokens=max_tokens,
            logprobs=logprobs,
        )
        return result

    if args.warmup:
        # Untimed, before the first setting: a side's first burst on a fresh host met one-off
        # costs (the H100 rounds of 2026-12-07: TTFT p99 1.4 s in the first side's first
        # setting only), which the first setting alone then carried. With the largest logprobs
        # asked, as vLLM compiles its logprobs ranking (`batched_count_greater_than`, a
        # torch.compile) at an engine's first request that asks for logprobs.
        asked = [int(level) for level in args.logprobs.split(",") if level != "off"]
        warm = await run(args.warmup, 16, max(asked, default=None))
        print(f"{args.label} warm-up: TTFT p99 {warm.ttft_ms(99):.0f} ms (not counted)", flush=True)
    results = []
    # With the side's trees, the load's own (this process and its load process) beside them.
    cpu_roots = {**cpu_cost.parse(args.cpu_of), "load": os.getpid()} if args.cpu_of else {}
    cpu: dict[str, dict[str, dict[str, float]]] = {}
    waits: dict[str, list[float]] = {}
    paces: dict[str, list[float]] = {}
    for level in args.logprobs.split(","):
        logprobs = None if level == "off" else int(level)
        runs = []
        before = first_token.snapshot(args.metrics_url) if args.metrics_url else None
        cpu_before = cpu_cost.read(cpu_roots) if cpu_roots else None
        for _ in range(args.repeats):
            runs.append(await run(args.requests_per_stream, args.max_tokens, logprobs))
        if cpu_before is not None:
            tokens = sum(r.tokens for r in runs)
            cpu[level] = cpu_cost.cost(cpu_before, cpu_cost.read(cpu_roots), tokens)
        rates = [r.tokens_per_s for r in runs]
        if before is not None:
            histograms = first_token.means(before, first_token.snapshot(args.metrics_url))
            ttfts = [t for r in runs for t in r.ttft_s]
            waits[level] = first_token.stretches(ttfts, histograms)
            paces[level] = first_token.after_first(histograms, args.concurrency, median(rates))
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
    if waits:
        print(first_token.render(waits), flush=True)
        print(first_token.render_pace(paces), flush=True)
    if cpu:
        print(cpu_cost.render(cpu), flush=True)
    write_json(
        side_name(args.label),
        {
            "settings": vars(args),
            "results": results,
            "first_token": waits,
            "pace": paces,
            "cpu": cpu,
        },
    )


def compare(labels: list[str], baselines: list[str]) -> None:
    """Every label's tok/s and TTFT p50 with its ratio to each baseline (a baseline without
    TTFT, the offline ceiling, gets none)."""
    data = {
        label: {r["logprobs"]: r for r in json.loads(side_path(label).read_text())["results"]}
        for label in dict.fromkeys(labels + baselines)
    }

    def ratio(value: float | None, base: float | None) -> str:
        return "–" if value is None or not base else f"{value / base:.2f}"

    rows = []
    for label in labels:
        for level, r in data[label].items():
            row = [
                label,
                level,
                r["tokens_per_s"],
                f"{min(r['tokens_per_s_runs']):,.0f}–{max(r['tokens_per_s_runs']):,.0f}",
            ]
            row += [ratio(r["tokens_per_s"], data[b][level]["tokens_per_s"]) for b in baselines]
            row.append("–" if r["ttft_p50_ms"] is None else f"{r['ttft_p50_ms']:.0f}")
            row += [ratio(r["ttft_p50_ms"], data[b][level]["ttft_p50_ms"]) for b in baselines]
            rows.append(row)
    header = ["side", "logprobs", "tok/s", "range"]
    header += [f"÷ {b}" for b in baselines] + ["TTFT p50 ms"]
    header += [f"TTFT ÷ {b}" for b in baselines]
    print(table(header, rows))


def compare_rounds(labels: list[str], baselines: list[str], rounds: list[str]) -> None:
    """Alternating rounds (the GPU script's ROUND): each ratio is taken within one round, side
    by side, and printed per round with its range; tok/s and TTFT are the rounds' medians."""

    def load(label: str, round_: str) -> dict[str, dict] | None:
        # A side that did not run in a round (None) takes its ratios from the rounds it ran in.
        side = read_round(label, round_, rounds)
        return None if side is None else {r["logprobs"]: r for r in side["results"]}

    data = {
        (label, rd): load(label, rd) for label in dict.fromkeys(labels + baselines) for rd in rounds
    }

    def spread(values: list[float]) -> str:
        if not values:  # the two sides shared no round
            return "–"
        return f"{min(values):.2f}–{max(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"

    rows = []
    for label in labels:
        ran = [rd for rd in rounds if data[(label, rd)] is not None]
        for level in data[(label, ran[0])]:
            mine = {rd: data[(label, rd)][level] for rd in ran}
            row = [label, level, median([r["tokens_per_s"] for r in mine.values()])]
            ttfts = {rd: r["ttft_p50_ms"] for rd, r in mine.items()}
            ttft_cells = []
            for base in baselines:
                both = [rd for rd in ran if data[(base, rd)] is not None]
                theirs = {rd: data[(base, rd)][level] for rd in both}
                row.append(
                    spread([mine[rd]["tokens_per_s"] / theirs[rd]["tokens_per_s"] for rd in both])
                )
                ok = all(ttfts[rd] is not None and theirs[rd]["ttft_p50_ms"] for rd in both)
                ttft_cells.append(
                    spread([ttfts[rd] / theirs[rd]["ttft_p50_ms"] for rd in both]) if ok else "–"
                )
            known = [t for t in ttfts.values() if t is not None]
            row.append(f"{median(known):.0f}" if len(known) == len(ttfts) else "–")
            rows.append(row + ttft_cells)
    header = ["side", "logprobs", "tok/s (median)"] + [f"÷ {b} per round" for b in baselines]
    header += ["TTFT p50 ms"] + [f"TTFT ÷ {b} per round" for b in baselines]
    print(table(header, rows))


def split_by_pace(labels: list[str], ceiling: str, rounds: list[str]) -> None:
    """Each side's tok/s ÷ the ceiling's, cut in two factors whose product it is (the side's
    `pace`, bench.first_token, per round): the engine's (the ceiling's time per token and stream,
    its streams ÷ its tok/s, ÷ the side's engine core decode per token) and the closed loop's
    (that decode ÷ the load's time per token and stream, whose difference is each request's
    turnaround: its first token and the previous request's last frame on the way, spread over
    its tokens; an offline queue pays none). Meaningful where the ceiling holds as many
    requests as the side has streams (`--max-num-seqs 256` at 256 streams). The ceiling's time
    per token holds its own prefill steps, which the side's decode leaves out and its
    turnaround holds: the engine's share is high, and the loop's low, by the same factor
    (1 + prefill step ÷ 128 decode steps: ~1.05 for a 40 ms step of 256 prompts at 6.5 ms a
    token)."""

    base_rates = {}
    for rd in rounds:
        if (base := read_round(ceiling, rd, rounds)) is not None:
            base_rates[rd] = {r["logprobs"]: r["tokens_per_s"] for r in base["results"]}
    rows = []
    for label in labels:
        for rd, base_rate in base_rates.items():
            path = side_path(f"{label}-{rd}")
            if not path.exists():
                continue
            side = json.loads(path.read_text())
            streams = side["settings"]["concurrency"]
            for r in side["results"]:
                level = r["logprobs"]
                decode, _, _, per_stream = side["pace"][level]
                ceiling_pace = streams / base_rate[level]
                rows.append(
                    [
                        f"{label}-{rd}",
                        level,
                        f"{r['tokens_per_s'] / base_rate[level]:.2f}",
                        f"{ceiling_pace / decode:.2f}",
                        f"{decode / per_stream:.2f}",
                        f"{(per_stream - decode) * 1e3 * side['settings']['max_tokens']:.0f}",
                    ]
                )
    header = ["side", "logprobs", f"÷ {ceiling}", "the engine's share", "the loop's share"]
    print(table(header + ["turnaround per request ms"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_processes")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--subject", default="llm.vllm.generate")
    parser.add_argument("--label", default="worker")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--logprobs", default="off,5,20")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed requests per stream (16 tokens, the largest logprobs of --logprobs) "
        "before the first setting",
    )
    parser.add_argument("--openai-url", help="load this OpenAI server (vllm serve) instead")
    parser.add_argument("--model", help="with --openai-url: the model name it serves")
    parser.add_argument(
        "--metrics-url",
        help="the worker's /metrics (--metrics-port): also print where the first token waits "
        "(bench.first_token)",
    )
    parser.add_argument(
        "--cpu-of",
        help="name=pid,... of the process trees serving the load (worker=PID,frontend=PID): "
        "also print their CPU per output token (bench.cpu_cost); they run on this host",
    )
    parser.add_argument("--compare", help="comma-separated labels to print with their ratios")
    parser.add_argument(
        "--to", help="comma-separated baseline labels for --compare (default: the first label)"
    )
    parser.add_argument(
        "--rounds",
        help="with --compare: comma-separated round names (side_<label>-<round>.json; a side "
        "without a round's file is read from side_<label>.json, the same in every round)",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="with --compare and --rounds: also cut each side's ratio to the first --to (a "
        "ceiling) into the engine's share and the closed loop's (split_by_pace)",
    )
    args = parser.parse_args()
    if args.compare:
        labels = args.compare.split(",")
        baselines = args.to.split(",") if args.to else labels[:1]
        if args.rounds:
            rounds = args.rounds.split(",")
            compare_rounds(labels, baselines, rounds)
            if args.split:
                split_by_pace(labels, baselines[0], rounds)
        else:
            compare(labels, baselines)
        return
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
