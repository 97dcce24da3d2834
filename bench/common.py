"""What every benchmark shares: statistics, the machine line, tables and JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent / "out"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (pastes into RESULTS.md as is)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path


def offline() -> None:
    """Benchmarks run where there is no model hub: the models are built locally."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def add_sweep_arguments(group: Any, name: str) -> None:
    """The load sweep bench.worker_overhead and bench.vs_vllm_serve share: concurrencies ×
    logprob settings, and where the JSON goes (`group`: a parser or an argument group)."""
    group.add_argument("--concurrency", default="1,8,32")
    group.add_argument("--logprobs", default="off,5,20")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--prompt-len", type=int, default=32)
    group.add_argument("--repeats", type=int, default=5)
    group.add_argument("--requests-per-stream", type=int, default=8)
    group.add_argument("--name", default=name, help="JSON file name under bench/out")


def two_sides(
    sides: tuple[str, str], repeats: int, measure: Callable[[str], dict[str, float]]
) -> tuple[dict[str, list[dict[str, float]]], dict[str, float], dict[str, float]]:
    """`repeats` runs of both sides, alternating which goes first, each run `measure(side)` (a
    dict of figures). Returns every run's figures per side, each figure's median per side
    (keyed `<side>:<figure>`), and the median of the per-repeat ratios sides[0] ÷ sides[1]."""
    first, second = sides
    per_side: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    ratios: dict[str, list[float]] = {}
    for repeat in range(repeats):
        order = sides if repeat % 2 == 0 else sides[::-1]
        got = {side: measure(side) for side in order}
        for side in sides:
            per_side[side].append(got[side])
        for key in got[first]:
            ratios.setdefault(key, []).append(got[first][key] / got[second][key])
    medians = {
        f"{side}:{key}": statistics.median(run[key] for run in per_side[side])
        for side in sides
        for key in per_side[side][0]
    }
    return per_side, medians, {key: statistics.median(values) for key, values in ratios.items()}


def load_process(module: str, *args: str) -> dict[str, Any]:
    """`python -m <module> <args>` (a benchmark's own load generator, a process of its own) run
    to its end from the project's root; its last stdout line, as JSON. SystemExit with its
    stderr when it fails."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=root
    )
    if done.returncode != 0:
        raise SystemExit(f"{module} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def scrape(url: str) -> dict[str, float]:
    """A Prometheus endpoint's samples summed per name over their labels (a histogram's `le`
    buckets left out: its `_sum` and `_count` remain)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums
