"""bench.cpu_cost: CPU per output token of named process trees, the engine core apart."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench import cpu_cost


def test_names_and_pids_are_parsed_and_a_bad_pair_is_refused() -> None:
    assert cpu_cost.parse("worker=12,frontend=34") == {"worker": 12, "frontend": 34}
    with pytest.raises(SystemExit, match="'worker' is not name=pid"):
        cpu_cost.parse("worker")


def test_a_tree_counts_its_children_and_an_engine_core_child_apart() -> None:
    # Each child burns 0.3 s of CPU, then idles while it is read (psutil reads live processes).
    busy = (
        "import time\nend = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\ntime.sleep(10)"
    )
    roots = {"worker": os.getpid()}
    before = cpu_cost.read(roots)
    # One child titled as vLLM titles its engine core (here its command line names it).
    core = subprocess.Popen([sys.executable, "-c", busy, "VLLM::EngineCore"])
    other = subprocess.Popen([sys.executable, "-c", busy])
    try:
        deadline = time.monotonic() + 20  # inside the unit layer's 30 s limit
        while True:
            after = cpu_cost.read(roots)
            burnt = (
                after.cpu_s.get("engine core", 0.0),
                after.cpu_s["worker"] - before.cpu_s["worker"],
            )
            if min(burnt) >= 0.3 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        costs = cpu_cost.cost(before, after, tokens=1000)
    finally:
        core.kill()
        other.kill()
    assert costs["engine core"]["cpu_ms_per_1k_tokens"] >= 290
    assert costs["worker"]["cpu_ms_per_1k_tokens"] >= 290  # the other child is the worker's
    assert 0 < costs["engine core"]["cores"] <= 2.0
    table = cpu_cost.render({"off": costs}).splitlines()
    assert table[0] == "CPU per 1,000 output tokens, ms (cores busy)"
    assert table[1] == "| process | logprobs off |"
    assert table[3].startswith("| engine core | ") and table[4].startswith("| worker | ")
