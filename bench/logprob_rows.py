"""Logprob rows: µs per token to turn vLLM's logprob output into frame rows (top 5 and top 20).

Input is vLLM's own `FlatLogprobs` (what the worker asks for), filled as the engine fills it:
per position the chosen token first, then the top-k in rank order. Two call shapes: one token
per call (a decode step's DELTA output, the common case) and 64 per call (a prompt or a burst).
The token table is the tiny model's real one (byte-fallback pieces included).

    python -m bench.logprob_rows [--repeats 7]
"""

from __future__ import annotations

import argparse
import random
import time

from bench.common import median, table, write_json
from worker.dev.tiny_model import ensure_tiny_model
from worker.engine import logprobs
from worker.shared.tokens import TokenTable

GOALS_US = {5: 2.0, 20: 6.0}


def _flat(positions: int, k: int, vocab: int, rng: random.Random):  # -> (token_ids, FlatLogprobs)
    from vllm.logprobs import FlatLogprobs

    flat = FlatLogprobs()
    chosen: list[int] = []
    for _ in range(positions):
        top = rng.sample(range(vocab), k)
        values = sorted((-rng.random() * 10 for _ in range(k)), reverse=True)
        if rng.random() < 0.8:  # usually the sampled token is one of the top-k
            rank = rng.randint(1, k)
            token = top[rank - 1]
            value = values[rank - 1]
        else:
            token, rank, value = rng.randrange(vocab), k + rng.randint(1, 50), -20.0
        chosen.append(token)
        flat.append_fast(
            [token, *top], [value, *values], iter([rank, *range(1, k + 1)]), [None] * (k + 1)
        )
    return chosen, flat


def measure(table_: TokenTable, k: int, per_call: int, calls: int, rng: random.Random) -> float:
    batches = [_flat(per_call, k, len(table_.texts), rng) for _ in range(calls)]
    start = time.perf_counter_ns()
    for token_ids, flat in batches:
        logprobs.extract(token_ids, flat, k, table_)
    elapsed = time.perf_counter_ns() - start
    return elapsed / 1000 / (per_call * calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=20_000, help="tokens per measurement")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    table_ = TokenTable.from_tokenizer(tokenizer, len(tokenizer))
    rng = random.Random(0)
    rows, results = [], []
    for k in (5, 20):
        for per_call in (1, 64):
            samples = [
                measure(table_, k, per_call, args.tokens // per_call, rng)
                for _ in range(args.repeats)
            ]
            us = median(samples)
            goal = GOALS_US[k]
            verdict = "met" if us <= goal else "MISSED"
            rows.append([k, per_call, us, min(samples), goal, verdict])
            results.append(
                {
                    "k": k,
                    "tokens_per_call": per_call,
                    "us_per_token_median": us,
                    "us_per_token_min": min(samples),
                    "goal_us": goal,
                    "samples": samples,
                }
            )
    print(table(["top k", "tokens/call", "µs/token (median)", "min", "goal", ""], rows))
    print("wrote", write_json("logprob_rows", {"results": results}))


if __name__ == "__main__":
    main()
