"""KV-aware routing: two workers on the real CPU engine, a prefix-heavy chat workload, and four
ways to send it: the queue group ("queue"), KvRouter least-busy ("least-busy"), KvRouter
KV-aware ("kv"), and everything to w1 ("one": the one-worker hit rate).

Workload per run: `--conversations` (16) chats × `--turns` (6), all chats at once, turns in order
within a chat; each turn sends BOS + a shared ~300-token system prompt + the whole history (the
earlier user messages of 40–60 tokens and the assistant's generated tokens, greedy,
`--max-tokens`, ignore_eos) + the new user message. Every run has its own seed (its own system
prompt and messages), so an earlier run's cache gives a later one no hits.

Measured per run: TTFT per request (publish → first frame with tokens; p50/p99) and vLLM's own
prefix-cache hit rate, Δhits ÷ Δqueries of `vllm:prefix_cache_{hits,queries}_total` summed over
both workers' /metrics. The parent starts nats-server and the two workers once, and drives each
run from a load process of its own (`--run MODE`: the router and the chats), which answers with
JSON on its last stdout line. Repeats alternate: repeat r runs the modes rotated by r.

The JSON (bench/out/kv_routing.json) keeps every request's record, with `seen`: each
worker's [overlap blocks, busy] as the router weighed them just before routing it.

    python -m bench.kv_routing [--repeats 3] [--hidden 512 --layers 4] [--block-size 32]
        [--load-weight 1.0] [--think-ms 0] [--bind split|auto] [--modes one,queue,least-busy,kv]
        [--probe] [--out NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import machine, median, offline, percentile, table, write_json
from bench.common import scrape as common_scrape
from worker.client.requests import make_request

ROOT = Path(__file__).resolve().parent.parent
MODES = ("one", "queue", "least-busy", "kv")
INSTANCES = ("w1", "w2")
FIRST_ID = 259
"""Prompt ids are drawn from the learned pieces (after the 3 specials and 256 byte tokens)."""


# --- the load process: one run of one mode ---------------------------------------------------


def system_prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(f"system-{seed}")
    return [rng.randrange(FIRST_ID, vocab) for _ in range(length)]


def what_router_sees(router: Any, prompt: list[int]) -> dict[str, list[int]]:
    """Per worker, [overlap blocks, its engine's busy] as the router weighs them just before
    routing (for the diagnosis of where chats go; reads the router's views, changes nothing)."""
    from worker.client.prefix_index import prefix_keys

    seen = {}
    for name, view in router.workers.items():
        overlap = 0
        if router.mode == "kv" and view.index is not None and not view.syncing:
            overlap = view.index.overlap(prefix_keys(prompt, view.index.block_size))
        engine = router.engines.get(view.engine_id)
        seen[name] = [overlap, engine.busy if engine is not None else 0]
    return seen


async def conversation(
    nc: Any,
    router: Any,
    subject: str | None,
    args: argparse.Namespace,
    system: list[int],
    index: int,
    records: list[dict[str, Any]],
) -> None:
    from worker.client.library import generate

    rng = random.Random(f"chat-{args.seed}-{index}")
    history: list[int] = []
    for turn in range(args.turns):
        if turn and args.think_ms:
            # The user's think time: chats that start together do not stay in lockstep.
            await asyncio.sleep(rng.uniform(0, args.think_ms) / 1000)
        history += [rng.randrange(FIRST_ID, args.vocab) for _ in range(rng.randint(40, 60))]
        prompt = [1, *system, *history]
        target, instance, overlap = subject, None, 0
        seen: dict[str, list[int]] = {}
        if router is not None:
            seen = what_router_sees(router, prompt)
            route = router.route(prompt)
            target, instance, overlap = (
                route.subject or subject,
                route.instance_id,
                route.overlap_blocks,
            )
        request = make_request(f"s{args.seed}-c{index}-t{turn}", prompt, max_tokens=args.max_tokens)
        sent = time.perf_counter()
        ttft = None
        output: list[int] = []
        try:
            async for frame in generate(nc, request, subject=target, timeout=600):
                if frame.token_ids and ttft is None:
                    ttft = time.perf_counter() - sent
                output += frame.token_ids
        finally:
            if router is not None:
                router.release(route)
        history += output
        records.append(
            {
                "chat": index,
                "turn": turn,
                "prompt_tokens": len(prompt),
                "ttft_s": ttft,
                "instance": instance,
                "overlap_blocks": overlap,
                "seen": seen,
            }
        )


async def one_run(args: argparse.Namespace) -> dict[str, Any]:
    import nats

    from messages.subjects import Subjects
    from worker.client.router import KvRouter

    nc = await nats.connect(args.nats_url)
    subjects = Subjects()
    router = None
    subject: str | None = subjects.generate
    if args.run == "one":
        subject = subjects.instance(INSTANCES[0])
    elif args.run in ("least-busy", "kv"):
        router = KvRouter(nc, subjects, mode=args.run, load_weight=args.load_weight)
        await router.start()
    known = sorted(router.workers) if router else []
    system = system_prompt(args.seed, args.system_tokens, args.vocab)
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    await asyncio.gather(
        *(
            conversation(nc, router, subject, args, system, i, records)
            for i in range(args.conversations)
        )
    )
    wall = time.perf_counter() - started
    resyncs = router.resyncs if router else 0
    if router:
        await router.stop()
    await nc.close()
    return {"wall_s": wall, "records": records, "router_workers": known, "resyncs": resyncs}


# --- the parent: workers, counters, alternation ----------------------------------------------


def scrape(port: int) -> dict[str, float]:
    return common_scrape(f"http://127.0.0.1:{port}/metrics")


HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
SUCCESS = "vllm:request_success_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"


def counters(ports: dict[str, int]) -> dict[str, dict[str, float]]:
    out = {}
    for name, port in ports.items():
        sums = scrape(port)
        out[name] = {k: sums.get(k, 0.0) for k in (HITS, QUERIES, SUCCESS, PROMPT_TOKENS)}
    return out


def worker_env(bind: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_worker(
    args: argparse.Namespace,
    nats_url: str,
    model: Path,
    instance: str,
    port: int,
    log: Path,
    bind: str | None,
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "worker",
        "--nats-url",
        nats_url,
        "--model",
        str(model),
        "--instance-id",
        instance,
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--enforce-eager",
        "--block-size",
        str(args.block_size),
        *args.worker_flags.split(),
    ]
    return subprocess.Popen(
        command,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=worker_env(bind),
        cwd=ROOT,
        start_new_session=True,
    )


def wait_ready(procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path]) -> None:
    deadline = time.monotonic() + 600
    waiting = set(procs)
    while waiting and time.monotonic() < deadline:
        for name in list(waiting):
            if procs[name].poll() is not None:
                raise SystemExit(f"worker {name} exited:\n{logs[name].read_text()[-3000:]}")
            if "vllm-nats-worker ready" in logs[name].read_text(errors="replace"):
                waiting.discard(name)
        time.sleep(0.5)
    if waiting:
        raise SystemExit(f"workers {waiting} not ready after 600 s")


def load_process(args: argparse.Namespace, nats_url: str, mode: str, seed: int) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "bench.kv_routing",
        "--nats-url",
        nats_url,
        "--run",
        mode,
        "--seed",
        str(seed),
        "--conversations",
        str(args.conversations),
        "--turns",
        str(args.turns),
        "--system-tokens",
        str(args.system_tokens),
        "--max-tokens",
        str(args.max_tokens),
        "--vocab",
        str(args.vocab),
        "--load-weight",
        str(args.load_weight),
        "--think-ms",
        str(args.think_ms),
    ]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=worker_env())
    if done.returncode != 0:
        raise SystemExit(f"load process {mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(
    mode: str, seed: int, answer: dict[str, Any], before: dict, after: dict
) -> dict[str, Any]:
    delta = {w: {k: after[w][k] - before[w][k] for k in after[w]} for w in after}  # per worker
    hits = sum(d[HITS] for d in delta.values())
    queries = sum(d[QUERIES] for d in delta.values())
    records = answer["records"]
    ttfts = [r["ttft_s"] * 1000 for r in records if r["ttft_s"] is not None]
    later = [r["ttft_s"] * 1000 for r in records if r["ttft_s"] is not None and r["turn"] > 0]
    # Did a chat stay on one worker (routed modes only)?
    by_chat: dict[int, set[str]] = {}
    for r in records:
        if r["instance"] is not None:
            by_chat.setdefault(r["chat"], set()).add(r["instance"])
    return {
        "mode": mode,
        "seed": seed,
        "wall_s": answer["wall_s"],
        "requests": len(records),
        "hit_rate": hits / queries if queries else float("nan"),
        "hits": hits,
        "queries": queries,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "ttft_p50_later_turns_ms": percentile(later, 50),
        "per_worker": {
            w: {
                "requests": d[SUCCESS],
                "prompt_tokens": d[PROMPT_TOKENS],
                "hit_rate": d[HITS] / d[QUERIES] if d[QUERIES] else float("nan"),
            }
            for w, d in delta.items()
        },
        "chats_on_one_worker": sum(1 for s in by_chat.values() if len(s) == 1),
        "mean_overlap_blocks": (
            sum(r["overlap_blocks"] for r in records) / len(records) if records else 0.0
        ),
        "router_workers": answer["router_workers"],
        "resyncs": answer["resyncs"],
        "records": records,
    }


async def probe(nats_url: str, vocab: int) -> dict[str, float]:
    """How long a 1500-token prefill takes against one decode step, on w2 alone."""
    import nats

    from messages.subjects import Subjects
    from worker.client.library import generate

    nc = await nats.connect(nats_url)
    subject = Subjects().instance(INSTANCES[1])
    rng = random.Random("probe")
    out: dict[str, float] = {}
    for attempt in range(3):
        prompt = [1, *(rng.randrange(FIRST_ID, vocab) for _ in range(1500))]
        request = make_request(f"probe-{attempt}", prompt, max_tokens=65)
        sent = time.perf_counter()
        first = None
        async for frame in generate(nc, request, subject=subject, timeout=600):
            if frame.token_ids and first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None
        out = {"prefill_1500_ms": (first - sent) * 1000, "decode_step_ms": (end - first) * 15.625}
    await nc.close()
    return out


def spread(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}"


def report(runs: list[dict[str, Any]], modes: list[str], repeats: int) -> dict[str, Any]:
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
    rows = []
    for mode in modes:
        mine = by_mode[mode]
        rows.append(
            [
                mode,
                median([r["hit_rate"] for r in mine]),
                spread([r["hit_rate"] for r in mine], 3),
                median([r["ttft_p50_ms"] for r in mine]),
                spread([r["ttft_p50_ms"] for r in mine], 0),
                median([r["ttft_p99_ms"] for r in mine]),
                median([r["ttft_p50_later_turns_ms"] for r in mine]),
                median([r["wall_s"] for r in mine]),
                " / ".join(
                    "+".join(f"{r['per_worker'][w]['requests']:.0f}" for w in INSTANCES)
                    for r in mine
                ),
            ]
        )
    print(
        table(
            [
                "mode",
                "hit rate",
                "range",
                "TTFT p50 ms",
                "range",
                "TTFT p99 ms",
                "p50 turns 2–6",
                "wall s",
                "requests w1+w2 per repeat",
            ],
            rows,
        )
    )
    ratios: dict[str, Any] = {}
    lines = []
    for mode in ("kv", "least-busy"):
        if mode not in by_mode or not by_mode[mode]:
            continue
        entry: dict[str, Any] = {}
        if by_mode.get("one"):
            per = [
                a["hit_rate"] / b["hit_rate"]
                for a, b in zip(by_mode[mode], by_mode["one"], strict=True)
            ]
            entry["hit_vs_one"] = per
            lines.append(
                f"{mode} hit rate ÷ one-worker hit rate: median {median(per):.2f} "
                f"(per repeat {', '.join(f'{v:.2f}' for v in per)}); goal ≥ 0.90: "
                f"{'met' if median(per) >= 0.9 else 'MISSED'}"
            )
        if by_mode.get("queue"):
            per = [
                a["ttft_p50_ms"] / b["ttft_p50_ms"]
                for a, b in zip(by_mode[mode], by_mode["queue"], strict=True)
            ]
            entry["ttft_p50_vs_queue"] = per
            lines.append(
                f"{mode} TTFT p50 ÷ queue TTFT p50: median {median(per):.2f} "
                f"(per repeat {', '.join(f'{v:.2f}' for v in per)}); goal ≤ 0.60: "
                f"{'met' if median(per) <= 0.6 else 'MISSED'}"
            )
        ratios[mode] = entry
    print("\n".join(lines))
    return {"ratios": ratios, "goal_lines": lines, "table_rows": rows}


def parent(args: argparse.Namespace) -> None:
    from bench.kv_model import ensure_kv_model
    from worker.dev.embedded import NatsServer

    offline()
    info = machine()
    print("machine:", json.dumps(info))
    model = ensure_kv_model(args.hidden, args.layers)
    config = json.loads((model / "config.json").read_text())
    args.vocab = config["vocab_size"]
    print(
        f"model {model.name}: hidden {config['hidden_size']}, layers "
        f"{config['num_hidden_layers']}, heads {config['num_attention_heads']}, "
        f"vocab {args.vocab}; block size {args.block_size}"
    )
    modes = args.modes.split(",")
    started = time.monotonic()
    server = NatsServer(jetstream=False).start()
    logs_dir = Path(args.log_dir)
    logs_dir.mkdir(parents=True, exist_ok=True)
    ports = {name: args.metrics_port + i for i, name in enumerate(INSTANCES)}
    logs = {name: logs_dir / f"kv_routing_{name}.log" for name in INSTANCES}
    # vLLM's "auto" OpenMP binding reserves one core and pins every engine's compute to the
    # same other core: two engines on this 2-core host then share one core. "split" gives
    # each worker a core of its own (VLLM_CPU_OMP_THREADS_BIND), as two GPUs would be.
    binds = {name: (str(i) if args.bind == "split" else None) for i, name in enumerate(INSTANCES)}
    procs = {
        name: start_worker(args, server.url, model, name, ports[name], logs[name], binds[name])
        for name in INSTANCES
    }
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    try:
        wait_ready(procs, logs)
        print(f"workers ready after {time.monotonic() - started:.0f} s", flush=True)
        names = sorted(k for k in scrape(ports["w1"]) if "prefix_cache" in k)
        print("prefix cache counters:", ", ".join(names), flush=True)
        probed = asyncio.run(probe(server.url, args.vocab)) if args.probe else {}
        if probed:
            print(
                f"probe on w2: 1500-token prefill {probed['prefill_1500_ms']:.0f} ms, "
                f"decode step {probed['decode_step_ms']:.1f} ms (one request)",
                flush=True,
            )
        if args.warmup:
            # Both engines see the workload's shapes once before anything is timed.
            load_process(args, server.url, "least-busy", args.seed)
            print(f"warm-up run done at {time.monotonic() - started:.0f} s", flush=True)
        bench_started = time.monotonic()
        seed = args.seed
        for repeat in range(args.repeats):
            order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]
            for mode in order:
                seed += 1
                before = counters(ports)
                answer = load_process(args, server.url, mode, seed)
                time.sleep(1.0)  # vLLM's counters are updated per logging step
                after = counters(ports)
                run = summarize(mode, seed, answer, before, after)
                run["repeat"] = repeat + 1
                runs.append(run)
                print(
                    f"repeat {repeat + 1} {mode:>10}: hit rate {run['hit_rate']:.3f}, TTFT p50 "
                    f"{run['ttft_p50_ms']:.0f} ms, p99 {run['ttft_p99_ms']:.0f} ms, wall "
                    f"{run['wall_s']:.1f} s, requests w1/w2 "
                    f"{run['per_worker']['w1']['requests']:.0f}/"
                    f"{run['per_worker']['w2']['requests']:.0f}, chats on one worker "
                    f"{run['chats_on_one_worker']}, mean overlap "
                    f"{run['mean_overlap_blocks']:.1f} blocks, resyncs {run['resyncs']}",
                    flush=True,
                )
        bench_s = time.monotonic() - bench_started
        print(f"runs took {bench_s:.0f} s ({time.monotonic() - started:.0f} s with startup)")
        result = report(runs, modes, args.repeats)
        path = write_json(
            args.out,
            {
                "settings": vars(args),
                "model": {k: config[k] for k in ("hidden_size", "num_hidden_layers")},
                "probe": probed,
                "runs_s": bench_s,
                "runs": runs,
                **result,
            },
        )
        print(f"wrote {path}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 15)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_routing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--load-weight", type=float, default=1.0)
    parser.add_argument(
        "--think-ms", type=float, default=0.0, help="a pause before each later turn, 0..N ms"
    )
    parser.add_argument(
        "--bind",
        choices=("split", "auto"),
        default="split",
        help="split: w1 on core 0, w2 on core 1; auto: vLLM's default binding",
    )
    parser.add_argument("--worker-flags", default="", help="more engine/worker flags, one string")
    parser.add_argument("--metrics-port", type=int, default=9410)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="skip the untimed first run"
    )
    parser.add_argument("--probe", action="store_true", help="time a prefill and a decode step")
    parser.add_argument("--log-dir", default=str(Path(__file__).resolve().parent / "out"))
    parser.add_argument("--out", default="kv_routing")
    # The load process (one run):
    parser.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=1024, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(asyncio.run(one_run(args))))
    else:
        parent(args)


if __name__ == "__main__":
    main()
