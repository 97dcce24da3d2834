"""The engine's own ceiling for bench.worker_processes: vLLM's offline `LLM.generate` on the same
prompts and sampling as that load (256 streams x 2 requests of 128 greedy tokens, 32-token
prompts), all requests submitted at once, no detokenization, logprobs returned flat
(`flat_logprobs`). No transport, no per-request output processing beyond vLLM's own: what any
server of this engine can at most reach. Writes `side_<label>.json` in bench.worker_processes'
schema (no TTFT: offline generation has no stream), so `python -m bench.worker_processes
--compare` sets every side against it.

    python -m bench.ceiling --label ceiling [--logprobs off,5,20] [--repeats 3]
        [--concurrency 256] [--requests-per-stream 2] [--max-tokens 128] [--vocab 32000]
        -- <vLLM engine arguments, as the worker gets them>
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench.common import median, write_json
from bench.load import prompts
from bench.worker_processes import side_name


def llm_kwargs(engine_argv: list[str]) -> dict[str, Any]:
    """`LLM(**…)` from engine arguments as `vllm serve` (and so the worker) takes them, parsed
    by the worker's own parser so that the ceiling and the worker read the same flags the same
    way."""
    from vllm.engine.arg_utils import EngineArgs

    from worker.engine.args import parser as vllm_parser

    engine_parser = vllm_parser(
        "python -m bench.ceiling",
        "vLLM engine arguments, after `--`",
        usage="python -m bench.ceiling [options] -- <vLLM engine arguments>",
        own_groups=(),
    )
    EngineArgs.add_cli_args(engine_parser)
    engine = EngineArgs.from_cli_args(engine_parser.parse_args(engine_argv))
    return {k: v for k, v in vars(engine).items() if not k.startswith("_")}


def main() -> None:
    argv = sys.argv[1:]
    engine_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m bench.ceiling")
    parser.add_argument("--label", default="ceiling")
    parser.add_argument("--logprobs", default="off,5,20")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args(own)

    from vllm import LLM, SamplingParams

    llm = LLM(**llm_kwargs(engine_argv))

    # The same prompt per request as bench.load.run gives stream i's request j.
    token_prompts = prompts(256, 32, args.vocab)
    requests = [
        {"prompt_token_ids": token_prompts[(i * args.requests_per_stream + j) % len(token_prompts)]}
        for i in range(args.concurrency)
        for j in range(args.requests_per_stream)
    ]
    results = []
    for level in args.logprobs.split(","):
        params = SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=args.max_tokens,
            logprobs=None if level == "off" else int(level),
            flat_logprobs=True,
            detokenize=False,
        )
        llm.generate(requests[: args.concurrency], params, use_tqdm=False)  # warm-up, untimed
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            wall = time.perf_counter() - start
            rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / wall)
        results.append(
            {
                "logprobs": level,
                "tokens_per_s": median(rates),
                "tokens_per_s_runs": rates,
                "ttft_p50_ms": None,
                "ttft_p99_ms": None,
            }
        )
        print(
            f"{args.label} logprobs={level}: {median(rates):,.0f} tok/s "
            f"({', '.join(f'{r:,.0f}' for r in rates)})",
            flush=True,
        )
    write_json(side_name(args.label), {"settings": vars(args), "results": results})


if __name__ == "__main__":
    main()
