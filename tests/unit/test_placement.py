"""`--engine-core-cpus` without an engine: the CPU list it takes, the placement it plans and the
affinity a process started inside `engine_core_launch` gets (a real child process). The real
engine core on its CPUs: tests/e2e/test_scaleout.py."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading

import pytest

from worker.engine import placement
from worker.engine.placement import Placement

pytestmark = pytest.mark.timeout(20)


def test_the_cpu_list_takes_tasksets_syntax() -> None:
    assert placement.cpu_list("0-3,8") == frozenset({0, 1, 2, 3, 8})
    assert placement.cpu_list("5") == frozenset({5})
    assert placement.cpu_list("0-1, 8-9") == frozenset({0, 1, 8, 9})
    assert placement.text(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    for bad in ("", "a", "3-1", "-1", "0-", "0,,1"):
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            placement.cpu_list(bad)
        assert str(refused.value) == (
            f"must be a CPU list such as 0-3 or 0,8 (ascending ranges of CPU numbers), got {bad!r}"
        )


def test_the_plan_refuses_cpus_it_may_not_use_or_leaving_none() -> None:
    available = frozenset(range(16))
    assert placement.plan(None, available) is None
    assert placement.plan(frozenset({0, 8}), available) == Placement(
        frozenset({0, 8}), available - {0, 8}
    )
    with pytest.raises(ValueError) as outside:
        placement.plan(frozenset({15, 16, 17}), available)
    assert str(outside.value) == (
        "--engine-core-cpus: CPU 16-17 is not among the CPUs this worker may run on (0-15)"
    )
    with pytest.raises(ValueError) as nothing_left:
        placement.plan(available, available)
    assert str(nothing_left.value) == (
        "--engine-core-cpus 0-15 leaves no CPU of 0-15 for the worker's own processes"
    )


def _affinity(pid: int) -> frozenset[int]:
    return frozenset(os.sched_getaffinity(pid))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_process_started_in_the_launch_runs_on_the_engine_cores_cpus_and_the_rest_after() -> None:
    available = placement.allowed()
    first = min(available)
    where = placement.plan(frozenset({first}), available)
    assert where is not None
    stop = threading.Event()
    # A thread this process had before the launch (vLLM's, the metrics server's) ends up on
    # the rest too.
    before = threading.Thread(target=stop.wait)
    before.start()
    child = None
    try:
        with placement.engine_core_launch(where):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        after = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert _affinity(child.pid) == {first}  # the "engine core"
            assert _affinity(after.pid) == where.rest  # a worker process started after
            assert _affinity(0) == where.rest
            tasks = [int(t) for t in os.listdir("/proc/self/task")]
            assert before.native_id in tasks
            assert {_affinity(t) for t in tasks} == {where.rest}
        finally:
            after.kill()
            after.wait()
    finally:
        stop.set()
        before.join()
        if child is not None:
            child.kill()
            child.wait()
        for task in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(task), available)


def test_without_the_flag_the_launch_moves_nothing() -> None:
    available = placement.allowed()
    with placement.engine_core_launch(None):
        assert placement.allowed() == available
    assert placement.allowed() == available
