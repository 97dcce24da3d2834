"""Tensor parallel against TP = 1 on the same model: greedy tokens and logprobs.

`record` sends a fixed set of prompts (seeded random token ids of several lengths), one at a
time, through the running worker with the client library (`worker.client.complete`): greedy,
ignore_eos, `max_tokens`, logprobs and prompt logprobs k; and writes what came back as JSON.
`compare` reads two records (TP = 1 first, as the reference) and prints, per prompt, how many
generated tokens are equal, where and why they diverge, and the largest |Δ logprob| over the
generated tokens and over the prompt positions; exit 1 when a prompt is outside the tolerance.

    python -m bench.gpu.tp_compare record --nats-url URL --label tp1 --out tp1.json
        [--prompts 8] [--max-tokens 64] [--logprobs 5] [--prompt-logprobs 5]
    python -m bench.gpu.tp_compare compare tp1.json tp2.json [--tie-gap 0.1] [--tolerance 0.1]

The tolerance (bf16). The model runs in bf16 (8 significant bits, relative rounding ~2^-9).
TP = 2 splits every row-parallel matmul (o_proj, down_proj: two partial sums, then an
all-reduce) and the vocabulary of the LM head, so each layer's output is rounded in another
order than with TP = 1; the differences travel down the residual stream through all layers and
move logits of this random model (lm_head std 0.02 × sqrt(4096) ≈ 1.3) by O(0.01–0.05). So:
- logprobs: |Δ| ≤ `--tolerance` (0.1) for the chosen token and for every token that is in both
  top-k rows, at every prompt position and at every generated position before the two runs'
  tokens diverge. 0.1 is a few times bf16's reduction-order noise, and far below what a real
  fault gives (a wrong shard, another rank's logits, a position off by one: O(1) differences);
- tokens: greedy takes the argmax, which that noise can flip only where the two best candidates
  are almost tied. Tokens must be equal until the first position where TP = 1's top-2 logprob
  gap is below `--tie-gap` (0.1); a divergence there is allowed (and reported with its gap),
  one at a wider gap fails. After a divergence the two runs continue from different contexts,
  so nothing later in that prompt is compared.
A random-weight model's next-token distribution is nearly flat (top-2 gaps average ~0.3, so
about a third of positions are near ties): the generated-token check covers only the first few
positions of each prompt; the prompt logprobs (teacher-forced, every position of every prompt,
~2,000 positions with the default prompts) are the comparison with the most weight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import machine, percentile

PROMPT_LENGTHS = [7, 16, 33, 64, 128, 250, 512, 1000]


def fixed_prompts(count: int, vocab: int, seed: int = 19) -> list[list[int]]:
    """`count` prompts of PROMPT_LENGTHS (cycled), token ids 3…vocab-1, seeded: the same on
    every run."""
    rng = random.Random(seed)
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(count)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _rows(rows: Any) -> list[list[list[float]] | None]:
    """Top-k rows as [[token_id, logprob], …] (JSON-ready), None where a position has none."""
    out: list[list[list[float]] | None] = []
    for row in rows or []:
        out.append(None if row is None else [[e.token_id, e.logprob] for e in row])
    return out


async def record(args: argparse.Namespace) -> None:
    import nats

    from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
    from worker.client import complete, wait_for_worker

    nc = await nats.connect(args.nats_url)
    if not await wait_for_worker(nc, args.wait):
        raise SystemExit(f"no worker answers on {args.nats_url}")
    results = []
    started = time.perf_counter()
    # One request at a time: each runs alone in its batch on both sides, so the only numerical
    # difference between the records is the tensor-parallel split.
    for i, prompt in enumerate(fixed_prompts(args.prompts, args.vocab)):
        request = GenerateRequest(
            request_id=f"tp-{args.label}-{i}",
            token_ids=prompt,
            sampling_options=SamplingOptions(temperature=0.0),
            stop_conditions=StopConditions(max_tokens=args.max_tokens, ignore_eos=True),
            output_options=OutputOptions(
                logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs or None
            ),
        )
        completion = await complete(nc, request, subject=args.subject, timeout=args.timeout)
        if completion.error is not None:
            raise SystemExit(f"prompt {i}: {completion.error}")
        choice = completion.choices[0]
        results.append(
            {
                "prompt": prompt,
                "tokens": choice.token_ids,
                "logprobs": choice.log_probs,
                "top": _rows(choice.top_logprobs),
                "finish_reason": choice.finish_reason,
                "prompt_logprobs": completion.prompt_log_probs,
                "prompt_top": _rows(completion.prompt_top_logprobs),
            }
        )
        print(f"{args.label} prompt {i} ({len(prompt)} tokens): {len(choice.token_ids)} tokens")
    await nc.close()
    payload = {
        "machine": machine(),
        "label": args.label,
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "seconds": time.perf_counter() - started,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(payload))
    print(f"wrote {args.out}")


def _gap(row: list[list[float]] | None) -> float:
    """Top-1 minus top-2 logprob of a row (inf when it has fewer than two finite entries)."""
    values = sorted((lp for _, lp in row or [] if lp is not None), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else float("inf")


def _row_deltas(a: list[list[float]] | None, b: list[list[float]] | None) -> list[float]:
    """|Δ logprob| of every token id in both rows."""
    if not a or not b:
        return []
    theirs = {int(t): lp for t, lp in b}
    return [
        abs(lp - theirs[int(t)])
        for t, lp in a
        if int(t) in theirs and lp is not None and theirs[int(t)] is not None
    ]


def compare_one(ref: dict, other: dict, tie_gap: float, tolerance: float) -> dict:
    """One prompt: token equality, the first divergence and its gap, |Δ logprob| maxima."""
    if ref["prompt"] != other["prompt"]:
        raise SystemExit("the two records were made with different prompts")
    a, b = ref["tokens"], other["tokens"]
    length = min(len(a), len(b))
    diverge = next((i for i in range(length) if a[i] != b[i]), None)
    same = length if diverge is None else diverge
    gen: list[float] = []
    for i in range(same):  # positions with the same context on both sides
        x, y = ref["logprobs"][i], other["logprobs"][i]
        if x is not None and y is not None:
            gen.append(abs(x - y))
        gen += _row_deltas(ref["top"][i], other["top"][i])
    prompt: list[float] = []
    for i in range(min(len(ref["prompt_logprobs"]), len(other["prompt_logprobs"]))):
        x, y = ref["prompt_logprobs"][i], other["prompt_logprobs"][i]
        if x is not None and y is not None:
            prompt.append(abs(x - y))
        prompt += _row_deltas(ref["prompt_top"][i], other["prompt_top"][i])
    gap = None if diverge is None else _gap(ref["top"][diverge])
    problems = []
    if len(a) != len(b):
        problems.append(f"lengths {len(a)} vs {len(b)}")
    if diverge is not None and gap is not None and gap >= tie_gap:
        problems.append(f"tokens diverge at {diverge} where TP=1's top-2 gap is {gap:.3f}")
    if gen and max(gen) > tolerance:
        problems.append(f"generated |Δ| {max(gen):.3f} > {tolerance}")
    if prompt and max(prompt) > tolerance:
        problems.append(f"prompt |Δ| {max(prompt):.3f} > {tolerance}")
    if not prompt and ref["prompt_logprobs"]:
        problems.append("no prompt logprobs to compare")
    return {
        "prompt_len": len(ref["prompt"]),
        "tokens": len(a),
        "equal_prefix": same,
        "diverge_at": diverge,
        "gap_at_divergence": gap,
        "other_gap_at_divergence": None if diverge is None else _gap(other["top"][diverge]),
        "near_ties_before": sum(1 for i in range(same) if _gap(ref["top"][i]) < tie_gap),
        "gen_deltas": gen,
        "prompt_deltas": prompt,
        "problems": problems,
    }


def compare(args: argparse.Namespace) -> None:
    ref = json.loads(Path(args.reference).read_text())
    other = json.loads(Path(args.other).read_text())
    if len(ref["results"]) != len(other["results"]):
        raise SystemExit("the records hold different numbers of prompts")
    rows = [
        compare_one(x, y, args.tie_gap, args.tolerance)
        for x, y in zip(ref["results"], other["results"], strict=True)
    ]
    print(
        f"{other['label']} against {ref['label']}: tolerance |Δ logprob| ≤ {args.tolerance}, "
        f"tokens equal until TP=1's top-2 gap < {args.tie_gap}"
    )
    print(
        "| prompt | prompt tokens | equal tokens | diverges at (gap ref / other) "
        "| max |Δ| generated | max |Δ| prompt | verdict |"
    )
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        where = (
            "–"
            if r["diverge_at"] is None
            else f"{r['diverge_at']} ({r['gap_at_divergence']:.3f} / "
            f"{r['other_gap_at_divergence']:.3f})"
        )
        gen = f"{max(r['gen_deltas']):.4f}" if r["gen_deltas"] else "–"
        prompt = f"{max(r['prompt_deltas']):.4f}" if r["prompt_deltas"] else "–"
        verdict = "ok" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])
        print(
            f"| {i} | {r['prompt_len']} | {r['equal_prefix']}/{r['tokens']} | {where} "
            f"| {gen} | {prompt} | {verdict} |"
        )
    gen_all = [d for r in rows for d in r["gen_deltas"]]
    prompt_all = [d for r in rows for d in r["prompt_deltas"]]
    for name, values in (("generated", gen_all), ("prompt", prompt_all)):
        if values:
            print(
                f"{name}: {len(values)} |Δ logprob| values, median {percentile(values, 50):.4f}, "
                f"p99 {percentile(values, 99):.4f}, max {max(values):.4f}"
            )
    failed = [i for i, r in enumerate(rows) if r["problems"]]
    identical = sum(1 for r in rows if r["diverge_at"] is None and not r["problems"])
    print(
        f"{len(rows) - len(failed)}/{len(rows)} prompts within tolerance "
        f"({identical} with every generated token equal); "
        + ("PASS" if not failed else f"FAIL (prompts {failed})")
    )
    if args.json:
        summary = {
            "reference": ref["label"],
            "other": other["label"],
            "tie_gap": args.tie_gap,
            "tolerance": args.tolerance,
            "prompts": [
                {k: v for k, v in r.items() if k not in ("gen_deltas", "prompt_deltas")}
                | {
                    "max_gen_delta": max(r["gen_deltas"], default=None),
                    "max_prompt_delta": max(r["prompt_deltas"], default=None),
                }
                for r in rows
            ],
            "passed": not failed,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))
    sys.exit(1 if failed else 0)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu.tp_compare", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record greedy tokens and logprobs from a running worker")
    rec.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    rec.add_argument("--subject", default="llm.vllm.generate")
    rec.add_argument("--label", required=True, help="e.g. tp1, tp2")
    rec.add_argument("--out", required=True, help="the JSON file to write")
    rec.add_argument("--prompts", type=int, default=8)
    rec.add_argument("--vocab", type=int, default=32000)
    rec.add_argument("--max-tokens", type=int, default=64)
    rec.add_argument("--logprobs", type=int, default=5)
    rec.add_argument("--prompt-logprobs", type=int, default=5, help="0: none")
    rec.add_argument("--timeout", type=float, default=120.0, help="seconds per frame")
    rec.add_argument("--wait", type=float, default=600.0, help="seconds to wait for a worker")
    rec.set_defaults(func=lambda a: asyncio.run(record(a)))
    cmp = sub.add_parser("compare", help="compare two records (TP = 1 first)")
    cmp.add_argument("reference", help="the TP = 1 record")
    cmp.add_argument("other", help="the TP = 2 record")
    cmp.add_argument("--tie-gap", type=float, default=0.1)
    cmp.add_argument("--tolerance", type=float, default=0.1)
    cmp.add_argument("--json", help="also write the per-prompt summary here")
    cmp.set_defaults(func=compare)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
