"""CPU time per output token of each process tree serving a load: where a side's CPU goes.

A side is named process trees (`worker=PID,frontend=PID,nats=PID`, or `serve=PID`); the engine
core (vLLM titles its process `VLLM::EngineCore`) and the model executor's processes
(`VLLM::Worker`) are counted on their own, whichever tree spawned them. Read before and after a
timed run: CPU seconds (user + system, every thread) per 1,000 output tokens, and the share of
one core each kept busy over the run's wall time. On a host where the engine core shares cores
with the side's other processes, its share and the others' cost per token say whether they
compete (bench/gpu/worker_processes.sh passes the PIDs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

ENGINE_CORE = "engine core"
MODEL_EXECUTOR = "engine's model executor"
"""vLLM's `VLLM::Worker` processes, where an executor runs the model outside the engine core
(vLLM's CPU backend here; on one GPU the model runs inside the engine core)."""


def parse(spec: str) -> dict[str, int]:
    """`name=pid,name=pid` → {name: pid}."""
    roots: dict[str, int] = {}
    for part in spec.split(","):
        name, _, pid = part.partition("=")
        if not name or not pid.isdigit():
            raise SystemExit(f"--cpu-of: {part!r} is not name=pid")
        roots[name] = int(pid)
    return roots


def _engine_part(process: psutil.Process) -> str | None:
    """The engine's own processes, by the titles vLLM gives them (setproctitle)."""
    try:
        title = " ".join([process.name(), *process.cmdline()])
    except psutil.Error:
        return None
    if "EngineCore" in title:
        return ENGINE_CORE
    if "VLLM::Worker" in title:
        return MODEL_EXECUTOR
    return None


def _cpu_s(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.Error:  # ended meanwhile: its time is gone from both readings' trees
        return 0.0
    return times.user + times.system


@dataclass(frozen=True)
class Reading:
    at: float
    cpu_s: dict[str, float]


def read(roots: dict[str, int]) -> Reading:
    """CPU seconds so far of each named tree, and of the engine core apart."""
    cpu: dict[str, float] = {}
    seen: set[int] = set()
    for name, pid in roots.items():
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for process in tree:
            if process.pid in seen:
                continue
            seen.add(process.pid)
            group = _engine_part(process) or name
            cpu[group] = cpu.get(group, 0.0) + _cpu_s(process)
    return Reading(time.monotonic(), cpu)


def cost(before: Reading, after: Reading, tokens: int) -> dict[str, dict[str, float]]:
    """Per group: CPU ms per 1,000 output tokens and the share of one core over the interval."""
    wall = after.at - before.at
    out: dict[str, dict[str, float]] = {}
    for group, total in after.cpu_s.items():
        used = total - before.cpu_s.get(group, 0.0)
        out[group] = {
            "cpu_ms_per_1k_tokens": 1e6 * used / tokens if tokens else 0.0,
            "cores": used / wall if wall > 0 else 0.0,
        }
    return out


def render(costs: dict[str, dict[str, dict[str, float]]]) -> str:
    """One row per group, a column per logprobs setting: `ms per 1k tokens (cores)`."""
    levels = list(costs)
    first = (ENGINE_CORE, MODEL_EXECUTOR)
    groups = sorted(
        {g for per in costs.values() for g in per},
        key=lambda g: (first.index(g) if g in first else len(first), g),
    )
    lines = [
        "CPU per 1,000 output tokens, ms (cores busy)",
        "| process | " + " | ".join(f"logprobs {level}" for level in levels) + " |",
        "|---|" + "---|" * len(levels),
    ]
    for group in groups:
        cells = []
        for level in levels:
            c = costs[level].get(group)
            cells.append(
                "–" if c is None else f"{c['cpu_ms_per_1k_tokens']:,.0f} ({c['cores']:.2f})"
            )
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
