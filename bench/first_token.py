"""Where a new request's first token waits: the mean time to first token the load process saw,
cut into the stretches that the worker's and vLLM's own Prometheus histograms time, from the
change of their `_sum` and `_count` over one run (means subtract; percentiles would not):

- engine core, waiting: `vllm:request_queue_time_seconds` (queued until first scheduled);
- engine core, scheduled to first token: `vllm:request_prefill_time_seconds`;
- vLLM's client loop: `vllm:time_to_first_token_seconds` less the two above (the request's way
  into the engine core, and the first token's way back through vLLM's output handler, which
  waits behind every other request's outputs of the steps before);
- the worker: `nats_worker_time_to_first_token_seconds` (from the message's arrival at the
  worker to the first token's frame) less vLLM's own TTFT (decoding and admission before
  `add_request`, and the hand-over of the first output to the request's session);
- NATS and the caller: the load process's TTFT less the worker's (the request's publication
  and delivery, the worker's intake reading it, the frame's way back; with the OpenAI stack,
  the frontend's HTTP and SSE work as well).

vLLM records the engine-core stretches when a request finishes and its TTFT at the first token,
so a run's means cover nearly, not exactly, the same requests; runs here end with every request
finished. bench.worker_processes prints this table with `--metrics-url` (the worker's
`--metrics-port`).
"""

from __future__ import annotations

from collections.abc import Sequence

from bench.common import scrape, table

WORKER_TTFT = "nats_worker_time_to_first_token_seconds"
VLLM_TTFT = "vllm:time_to_first_token_seconds"
QUEUE = "vllm:request_queue_time_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
HISTOGRAMS = (WORKER_TTFT, VLLM_TTFT, QUEUE, PREFILL)

STRETCHES = (
    "engine core: waiting",
    "engine core: scheduled to first token",
    "vLLM's client loop (in, and the output handler out)",
    "the worker (arrival to add_request, output to frame)",
    "NATS and the caller (intake, frame delivery, frontend)",
)


def snapshot(url: str) -> dict[str, float]:
    """The `_sum` and `_count` of each histogram the breakdown reads (0 where absent)."""
    sums = scrape(url)
    return {
        f"{name}{part}": sums.get(f"{name}{part}", 0.0)
        for name in HISTOGRAMS
        for part in ("_sum", "_count")
    }


def means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each histogram's mean (s) over the observations between two snapshots; NaN for none."""
    out = {}
    for name in HISTOGRAMS:
        count = after[f"{name}_count"] - before[f"{name}_count"]
        total = after[f"{name}_sum"] - before[f"{name}_sum"]
        out[name] = total / count if count > 0 else float("nan")
    return out


def stretches(client_ttft_s: Sequence[float], histogram_means: dict[str, float]) -> list[float]:
    """The five stretches (s) of STRETCHES, in order, for a run whose load process saw these
    TTFTs; they add up to the run's mean TTFT."""
    client = sum(client_ttft_s) / len(client_ttft_s) if client_ttft_s else float("nan")
    queue, prefill = histogram_means[QUEUE], histogram_means[PREFILL]
    vllm, worker = histogram_means[VLLM_TTFT], histogram_means[WORKER_TTFT]
    return [queue, prefill, vllm - queue - prefill, worker - vllm, client - worker]


def render(rows: dict[str, list[float]]) -> str:
    """A table of stretches (ms) and their share of the mean TTFT, one column per setting."""
    settings = list(rows)
    lines = []
    for i, name in enumerate(STRETCHES):
        cells = []
        for setting in settings:
            values = rows[setting]
            total = sum(values)
            cells.append(f"{values[i] * 1e3:.0f} ms ({values[i] / total:.0%})")
        lines.append([name, *cells])
    lines.append(["mean TTFT", *(f"{sum(rows[s]) * 1e3:.0f} ms" for s in settings)])
    return table(["where the first token waits", *(f"logprobs {s}" for s in settings)], lines)
