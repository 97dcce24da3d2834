"""Where a new request's first token waits: the mean time to first token the load process saw,
cut into the stretches that the worker's and vLLM's own Prometheus histograms time, from the
change of their `_sum` and `_count` over one run (means subtract; percentiles would not):

- engine core, waiting: `vllm:request_queue_time_seconds` (queued until first scheduled);
- engine core, scheduled to first token: `vllm:request_prefill_time_seconds`;
- vLLM's client loop: `vllm:time_to_first_token_seconds` less the two above (the request's way
  into the engine core, and the first token's way back through vLLM's output handler, which
  waits behind every other request's outputs of the steps before);
- the worker, waiting for its turn: `nats_worker_admission_wait_seconds` (from the message's
  arrival at the worker to its request task's first step: the event loop's work queued ahead);
- the worker, the rest: `nats_worker_time_to_first_token_seconds` (arrival to the first token's
  frame) less vLLM's own TTFT and the wait above (decoding and admission before `add_request`,
  and the hand-over of the first output to the request's session);
- the frontend and NATS: `nats_frontend_time_to_first_token_seconds` (the frontend's arrival of
  the HTTP request to its first SSE event) less the worker's TTFT (the frontend's work before
  it publishes, the request's and the first frame's ways over NATS, the frame to its SSE
  event); 0 without a frontend;
- the caller's side: the load process's TTFT less the frontend's, or without a frontend the
  worker's (over NATS: the request's publication and delivery and the frame's way back; over
  HTTP: the connection, the server's reading of the request before its app runs, and the load's
  own loop).

vLLM records the engine-core stretches when a request finishes and its TTFT at the first token,
so a run's means cover nearly, not exactly, the same requests; runs here end with every request
finished. bench.worker_processes prints this table with `--metrics-url` (the worker's
`--metrics-port`, and the frontend's /metrics after a comma for the OpenAI stack; or `vllm
serve`'s own /metrics: it has no worker histogram, so its worker stretch is 0 and the caller's
side is its HTTP side).

After the first token, the same snapshots say who sets the pace of a stream (`after_first`),
per later token (each request's generated tokens less its first): the engine core's
(`vllm:request_decode_time_seconds`, from the engine core's own step timestamps, as is vLLM's
inter-token histogram), vLLM's client loop's (`vllm:e2e_request_latency_seconds` less vLLM's
TTFT: when its output handler read the first and the last token), the worker's frames
(`nats_worker_inter_token_latency_seconds`; none behind vllm serve) and the load's own (streams
÷ tok/s). An engine core slow per token is slow for everyone; a pace the engine does not show is
the clients' (output handling, frames, the frontend).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.common import scrape, table

WORKER_TTFT = "nats_worker_time_to_first_token_seconds"
VLLM_TTFT = "vllm:time_to_first_token_seconds"
QUEUE = "vllm:request_queue_time_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
DECODE = "vllm:request_decode_time_seconds"
GENERATED = "vllm:request_generation_tokens"
ADMISSION = "nats_worker_admission_wait_seconds"
E2E = "vllm:e2e_request_latency_seconds"
FRAME_GAP = "nats_worker_inter_token_latency_seconds"
FRONTEND_TTFT = "nats_frontend_time_to_first_token_seconds"
HISTOGRAMS = (
    WORKER_TTFT,
    ADMISSION,
    VLLM_TTFT,
    QUEUE,
    PREFILL,
    DECODE,
    GENERATED,
    E2E,
    FRAME_GAP,
    FRONTEND_TTFT,
)

STRETCHES = (
    "engine core: waiting",
    "engine core: scheduled to first token",
    "vLLM's client loop (in, and the output handler out)",
    "the worker: waiting for its turn (arrival to the request's task)",
    "the worker: the rest (to add_request, output to frame)",
    "the frontend and NATS (its arrival to its first SSE event, less the worker's)",
    "the caller's side (NATS or HTTP, and the load's loop)",
)


def snapshot(urls: str) -> dict[str, float]:
    """The `_sum` and `_count` of each histogram the breakdown reads, from one /metrics URL or
    several joined by commas (the worker's and the frontend's); 0 where absent."""
    sums: dict[str, float] = {}
    for url in urls.split(","):
        for name, value in scrape(url).items():
            sums[name] = sums.get(name, 0.0) + value
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
    """The seven stretches (s) of STRETCHES, in order, for a run whose load process saw these
    TTFTs; they add up to the run's mean TTFT."""
    client = sum(client_ttft_s) / len(client_ttft_s) if client_ttft_s else float("nan")
    queue, prefill = histogram_means[QUEUE], histogram_means[PREFILL]
    vllm, worker = histogram_means[VLLM_TTFT], histogram_means[WORKER_TTFT]
    wait = histogram_means[ADMISSION]
    if math.isnan(worker):  # no worker in front (vllm serve's own /metrics)
        worker, wait = vllm, 0.0
    if math.isnan(wait):  # a worker without the histogram: all of its stretch is "the rest"
        wait = 0.0
    frontend = histogram_means[FRONTEND_TTFT]
    if math.isnan(frontend):  # no frontend in front (loaded over NATS, or vllm serve)
        frontend = worker
    return [
        queue,
        prefill,
        vllm - queue - prefill,
        wait,
        worker - vllm - wait,
        frontend - worker,
        client - frontend,
    ]


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


PACE = (
    "engine core: decode per output token",
    "vLLM's client loop: per output token",
    "the worker's frames: gap per token",
    "the load: per token and stream",
)


def after_first(
    histogram_means: dict[str, float], streams: int, tokens_per_s: float
) -> list[float]:
    """The four paces of PACE (s per token), in order. The decode, end-to-end, TTFT and
    generated-token histograms are per request, so their means over the tokens after the first
    are per later token."""
    later = histogram_means[GENERATED] - 1
    if not later > 0:
        later = float("nan")
    decode = histogram_means[DECODE] / later
    client = (histogram_means[E2E] - histogram_means[VLLM_TTFT]) / later
    return [decode, client, histogram_means[FRAME_GAP], streams / tokens_per_s]


def render_pace(rows: dict[str, list[float]]) -> str:
    """A table of the paces (ms per token), one column per setting."""
    settings = list(rows)
    lines = [
        [name, *(f"{rows[s][i] * 1e3:.2f} ms" for s in settings)] for i, name in enumerate(PACE)
    ]
    return table(["after the first token", *(f"logprobs {s}" for s in settings)], lines)
