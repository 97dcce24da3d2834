"""`python -m bench.worker_processes --compare … --rounds …`: ratios are taken within each round, a
side run once (the ceiling) is read for every round, and a side that ran in some rounds only is
set beside the others in those rounds alone; no vllm, no nats-server."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import worker_processes


def write(out: Path, name: str, rates: dict[str, float], ttft: float | None) -> None:
    results = [
        {"logprobs": level, "tokens_per_s": rate, "ttft_p50_ms": ttft}
        for level, rate in rates.items()
    ]
    (out / f"{worker_processes.side_name(name)}.json").write_text(json.dumps({"results": results}))


def rows(printed: str) -> dict[tuple[str, str], list[str]]:
    cells = [line.strip("|").split("|") for line in printed.splitlines()[2:]]
    return {(c[0].strip(), c[1].strip()): [x.strip() for x in c[2:]] for c in cells}


def test_rounds_pair_each_side_with_its_baseline_in_the_rounds_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(worker_processes, "OUT_DIR", tmp_path)
    write(tmp_path, "ceiling", {"off": 100.0}, None)
    write(tmp_path, "serve4-r1", {"off": 50.0}, 200.0)
    write(tmp_path, "serve4-r2", {"off": 80.0}, 100.0)
    write(tmp_path, "serve4-r3", {"off": 40.0}, 100.0)
    write(tmp_path, "n4-r1", {"off": 60.0}, 100.0)
    write(tmp_path, "n4-r2", {"off": 88.0}, 50.0)
    write(tmp_path, "n4-r3", {"off": 60.0}, 80.0)
    write(tmp_path, "n8-r1", {"off": 75.0}, 100.0)
    # n8 ran in r1 only: the plain side_n8.json, left by an earlier, unrelated run, must not stand
    # in for its r2 and r3.
    write(tmp_path, "n8", {"off": 1000.0}, 1.0)

    worker_processes.compare_rounds(["n4", "n8", "ceiling"], ["serve4"], ["r1", "r2", "r3"])
    table = rows(capsys.readouterr().out)

    # tok/s median, ÷ serve4 per round, TTFT p50 median, TTFT ÷ serve4 per round
    assert table[("n4", "off")] == [
        "60",
        "1.10–1.50 (1.20, 1.10, 1.50)",
        "80",
        "0.50–0.80 (0.50, 0.50, 0.80)",
    ]
    assert table[("n8", "off")] == ["75", "1.50–1.50 (1.50)", "100", "0.50–0.50 (0.50)"]
    # The ceiling ran once; it is read for every round and has no TTFT.
    assert table[("ceiling", "off")] == ["100", "1.25–2.50 (2.00, 1.25, 2.50)", "–", "–"]


def test_the_first_token_breakdown_cuts_the_callers_mean_ttft_by_the_histograms() -> None:
    """bench.first_token: the means of two snapshots' histogram deltas, and the caller's mean
    TTFT cut into the seven stretches, which add up to it; without the frontend's histogram
    (loaded over NATS) the frontend's stretch is 0 and the caller's side is the rest."""
    from bench import first_token

    names = first_token.HISTOGRAMS
    before = {f"{name}{part}": 1.0 for name in names for part in ("_sum", "_count")}
    # 4 observations each: worker 0.4 s, vLLM 0.3 s, queue 0.05 s, prefill 0.1 s on average.
    added = {
        first_token.WORKER_TTFT: 1.6,
        first_token.ADMISSION: 0.16,
        first_token.VLLM_TTFT: 1.2,
        first_token.QUEUE: 0.2,
        first_token.PREFILL: 0.4,
        first_token.DECODE: 2.0,
        first_token.GENERATED: 404.0,
        first_token.E2E: 4.0,
        first_token.FRAME_GAP: 0.02,
        first_token.FRONTEND_TTFT: 2.0,
    }
    after = {
        **{f"{name}_sum": 1.0 + added[name] for name in names},
        **{f"{name}_count": 5.0 for name in names},
    }
    means = first_token.means(before, after)
    assert means == pytest.approx(
        {
            first_token.WORKER_TTFT: 0.4,
            first_token.ADMISSION: 0.04,
            first_token.VLLM_TTFT: 0.3,
            first_token.QUEUE: 0.05,
            first_token.PREFILL: 0.1,
            first_token.DECODE: 0.5,
            first_token.GENERATED: 101.0,
            first_token.E2E: 1.0,
            first_token.FRAME_GAP: 0.005,
            first_token.FRONTEND_TTFT: 0.5,
        }
    )
    cut = first_token.stretches([0.5, 0.7], means)
    assert cut == pytest.approx([0.05, 0.1, 0.15, 0.04, 0.06, 0.1, 0.1])
    assert sum(cut) == pytest.approx(0.6)
    printed = first_token.render({"off": cut})
    assert (
        "the frontend and NATS (its arrival to its first SSE event, less the worker's) | "
        "100 ms (17%)"
    ) in printed
    assert "the caller's side (NATS or HTTP, and the load's loop) | 100 ms (17%)" in printed
    assert "mean TTFT | 600 ms" in printed
    over_nats = first_token.stretches([0.5, 0.7], {**means, first_token.FRONTEND_TTFT: math.nan})
    assert over_nats == pytest.approx([0.05, 0.1, 0.15, 0.04, 0.06, 0.0, 0.2])
    assert math.isnan(first_token.means(before, before)[first_token.QUEUE]), "none observed"


def test_the_pace_after_the_first_token_is_per_later_token_and_the_worker_stretch_absent_is_0() -> (
    None
):
    """bench.first_token.after_first: the engine's decode time and vLLM's client loop's
    (end-to-end less TTFT) per request over its tokens less the first, the worker's frame gap,
    the load's streams per tok/s; and vllm serve's own /metrics (no worker histograms) put no
    time on the worker."""
    from bench import first_token

    means = {
        first_token.DECODE: 0.5,
        first_token.GENERATED: 101.0,
        first_token.E2E: 1.0,
        first_token.FRAME_GAP: float("nan"),
        first_token.WORKER_TTFT: float("nan"),
        first_token.ADMISSION: float("nan"),
        first_token.VLLM_TTFT: 0.3,
        first_token.QUEUE: 0.05,
        first_token.PREFILL: 0.1,
        first_token.FRONTEND_TTFT: float("nan"),
    }
    pace = first_token.after_first(means, streams=32, tokens_per_s=3200.0)
    assert pace[:2] == pytest.approx([0.005, 0.007])
    assert math.isnan(pace[2])
    assert pace[3] == pytest.approx(0.01)
    printed = first_token.render_pace({"off": pace})
    assert "engine core: decode per output token | 5.00 ms" in printed
    assert "vLLM's client loop: per output token | 7.00 ms" in printed
    assert "the load: per token and stream | 10.00 ms" in printed
    cut = first_token.stretches([0.5], means)
    assert cut == pytest.approx([0.05, 0.1, 0.15, 0.0, 0.0, 0.0, 0.2])


def test_split_cuts_the_ratio_to_the_ceiling_into_the_engines_and_the_loops_shares(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--split`: a side's tok/s ÷ the ceiling's is the engine's share (the ceiling's time per
    token and stream ÷ the side's engine decode per token) times the loop's (that decode ÷ the
    load's time per token and stream), and the turnaround is their difference over a request's
    tokens; a round the side did not run in has no row."""
    monkeypatch.setattr(worker_processes, "OUT_DIR", tmp_path)
    write(tmp_path, "ceiling", {"off": 40_000.0}, None)
    # 256 streams at 32,000 tok/s: 8 ms per token and stream; the engine decoded at 6.8 ms.
    side = {
        "settings": {"concurrency": 256, "max_tokens": 128},
        "results": [{"logprobs": "off", "tokens_per_s": 32_000.0, "ttft_p50_ms": 120.0}],
        "pace": {"off": [0.0068, 0.0069, 0.0070, 256 / 32_000.0]},
    }
    (tmp_path / "side_stack-r1.json").write_text(json.dumps(side))

    worker_processes.split_by_pace(["stack"], "ceiling", ["r1", "r2"])
    table = rows(capsys.readouterr().out)

    ratio, engine, loop, turnaround = table[("stack-r1", "off")]
    assert ratio == "0.80"  # 32,000 ÷ 40,000
    assert engine == "0.94"  # 6.4 ms (256 ÷ 40,000) ÷ 6.8 ms
    assert loop == "0.85"  # 6.8 ms ÷ 8.0 ms
    assert math.isclose(float(engine) * float(loop), float(ratio), abs_tol=0.01)
    assert turnaround == "154"  # (8.0 − 6.8) ms × 128 tokens
    assert ("stack-r2", "off") not in table
