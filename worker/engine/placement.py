"""`--engine-core-cpus`: the vLLM engine core on CPUs of its own, the worker's processes on the
rest.

On a GPU host under high concurrency the engine core's one step thread is the bound (it
schedules, launches the kernels and handles every request's output each step), and it steps
slower when the worker's and the frontend's busy processes share its physical cores. Linux
hands a new process the CPU affinity of the thread that started it, so the engine core is
launched from a main thread set to the engine core's CPUs (its threads, and its executor's
processes, inherit them); then every thread of this process goes to the rest of the CPUs it may
use, and the worker processes it starts after inherit those. Nothing is moved later.

The rest of the host is left alone: a frontend on the same host keeps its own affinity (start it
with `taskset -c <the rest>`, or compose's `cpuset`). On the CPU engine the forward pass, in the
executor's process, runs on the engine core's CPUs too, so the flag is for GPU hosts.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker

log = logging.getLogger(__name__)


def cpu_list(text: str) -> frozenset[int]:
    """The command-line type of `--engine-core-cpus`: a CPU list in taskset's and numactl's
    syntax (`0-3`, `0,8`, `0-1,8-9`)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, dash, high = part.strip().partition("-")
            first, last = int(low), int(high) if dash else int(low)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a CPU list such as 0-3 or 0,8 (ascending ranges of CPU numbers), got {text!r}"
        ) from None
    return frozenset(cpus)


def allowed() -> frozenset[int]:
    """The CPUs this process may run on."""
    return frozenset(os.sched_getaffinity(0))


def text(cpus: frozenset[int]) -> str:
    """A CPU set as a compact list (`0-3,8`)."""
    ranges: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


@dataclass(frozen=True)
class Placement:
    engine_core: frozenset[int]
    rest: frozenset[int]


def plan(engine_core: frozenset[int] | None, available: frozenset[int]) -> Placement | None:
    """The placement `--engine-core-cpus` asks for among the CPUs `available`, or None without
    the flag. ValueError, naming the flag and the rule, for CPUs this process may not use or a
    list that leaves the worker's processes none."""
    if engine_core is None:
        return None
    if outside := engine_core - available:
        raise ValueError(
            f"--engine-core-cpus: CPU {text(outside)} is not among the CPUs this worker may run "
            f"on ({text(available)})"
        )
    rest = available - engine_core
    if not rest:
        raise ValueError(
            f"--engine-core-cpus {text(engine_core)} leaves no CPU of {text(available)} for the "
            "worker's own processes"
        )
    return Placement(engine_core, rest)


@contextlib.contextmanager
def engine_core_launch(placement: Placement | None) -> Iterator[None]:
    """Around the call that starts the engine core process: the main thread on the engine
    core's CPUs while it runs (the new process inherits them), then every thread of this
    process on the rest, the worker processes started afterwards with them."""
    if placement is None:
        yield
        return
    # The spawn start method's resource tracker starts with the first process spawned unless it
    # runs already: here, on the rest's CPUs rather than the engine core's.
    os.sched_setaffinity(0, placement.rest)
    resource_tracker.ensure_running()
    os.sched_setaffinity(0, placement.engine_core)
    try:
        yield
    finally:
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(task), placement.rest)
    log.info(
        "engine core on CPUs %s, this worker's processes on %s",
        text(placement.engine_core),
        text(placement.rest),
    )
