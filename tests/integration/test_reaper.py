"""worker/engine/reaper.py: a worker's processes die with its main process, even SIGKILLed.

These tests run the reaper under a small Python parent (no vllm). On the real `python -m worker`
and the CPU engine, tests/e2e/test_jetstream.py SIGKILLs the main process alone and checks that
vLLM's engine processes went with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.helpers import REAPER, kill_all, process_text, wait_gone
from worker.engine import reaper

ROOT = Path(__file__).resolve().parents[2]
REAPED = REAPER + " worker process"


PARENT = textwrap.dedent(
    """
    import multiprocessing, subprocess, sys, time
    from worker.engine import reaper

    handle = reaper.watch_this_process(interval=0.2)
    assert reaper.watch_this_process() is handle  # once per process
    quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # a child with a grandchild, and a child the parent ends itself
    tree = subprocess.Popen(
        ["sh", "-c", "sleep 300 & exec sleep 301"], start_new_session=True, **quiet
    )
    ended = subprocess.Popen(["sleep", "302"], **quiet)
    if sys.argv[1:2] == ["multiprocessing"]:  # as vLLM starts EngineCore: on GPU, on CPU
        for method in ("fork", "spawn"):
            context = multiprocessing.get_context(method)
            context.Process(target=time.sleep, args=(300,), daemon=True).start()
        # A segment a child created and never unlinked, as a killed EngineCore leaves its queues.
        from multiprocessing import shared_memory
        leaker = multiprocessing.get_context("spawn").Process(
            target=shared_memory.SharedMemory, kwargs=dict(name=sys.argv[2], create=True, size=4096)
        )
        leaker.start()
        leaker.join()
    time.sleep(0.5)  # the reaper's next scan sees the grandchild
    ended.kill()
    ended.wait()
    print("ready", handle.pid, ended.pid, flush=True)
    how = sys.stdin.readline().strip()  # the test SIGKILLs the parent here, or tells it to exit
    if how == "clean-exit":  # end the child and grandchild, and wait until they are gone
        import os, signal, psutil
        grandchildren = psutil.Process(tree.pid).children()
        os.killpg(tree.pid, signal.SIGKILL)
        tree.wait()
        for p in grandchildren:
            try:
                while p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    time.sleep(0.01)
            except psutil.Error:
                pass
    sys.exit(0)
    """
)


class Parent:
    """A Python parent with a reaper, a child, a grandchild and a child it ended itself."""

    def __init__(self, *args: str) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-c", PARENT, *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline().split()
        assert line[:1] == ["ready"], (line, self.popen.stderr and self.popen.stderr.read())
        self.reaper = psutil.Process(int(line[1]))
        self.ended_pid = int(line[2])
        self.descendants = [
            p
            for p in psutil.Process(self.popen.pid).children(recursive=True)
            if p.pid != self.reaper.pid
        ]

    def stderr_at_end(self) -> str:
        """The parent's stderr, which its reaper shares: complete once both are gone."""
        _, err = self.popen.communicate(timeout=10)
        return err

    def cleanup(self) -> None:
        self.popen.kill()
        self.popen.wait()
        kill_all([*self.descendants, self.reaper])


@pytest.mark.parametrize("children", ["popen", "multiprocessing"])
def test_sigkill_of_the_parent_kills_its_children_and_grandchildren_only(children: str) -> None:
    bystander = subprocess.Popen(["sleep", "300"])  # not the parent's: must survive
    segment = Path(f"/dev/shm/vnw-reaper-test-{os.getpid()}")
    parent = Parent(children, segment.name)
    try:
        names = sorted(process_text(p).split(" ")[0] for p in parent.descendants)
        # popen: sh (exec'd to sleep) and its sleep; multiprocessing adds a fork child, a spawn
        # child and the spawn context's resource tracker (python processes)
        assert len(names) == (2 if children == "popen" else 5), names
        tracker = [p for p in parent.descendants if "resource_tracker" in process_text(p)]
        assert len(tracker) == (0 if children == "popen" else 1)
        assert segment.exists() == (children == "multiprocessing")
        assert parent.reaper.ppid() == parent.popen.pid
        maps = Path(f"/proc/{parent.reaper.pid}/maps").read_text()
        # A cheap process: no torch or vllm loaded (torch's libgomp may be mapped all the same:
        # vLLM's CPU platform puts it in LD_PRELOAD, which every later child inherits).
        assert "libtorch" not in maps and "/vllm/" not in maps
        parent.popen.send_signal(signal.SIGKILL)
        parent.popen.wait()
        assert wait_gone(parent.descendants, 5) == []
        assert wait_gone([parent.reaper], 5) == []
        err = parent.stderr_at_end()
        # The resource tracker is not killed: it ends by itself and unlinks what the killed left.
        killed = f"killed {len(names) - len(tracker)} leftover process(es)"
        assert err.count(REAPED) == 1 and killed in err, err
        for p in parent.descendants:
            assert (f"{p.pid} (" in err) == (p not in tracker), err
        assert f"{parent.ended_pid} (" not in err
        assert not segment.exists()
        if tracker:
            assert "leaked shared_memory objects to clean up" in err, err
        assert bystander.poll() is None
    finally:
        parent.cleanup()
        bystander.kill()
        bystander.wait()
        segment.unlink(missing_ok=True)


def test_normal_exit_kills_the_leftovers_and_the_reaper_exits() -> None:
    parent = Parent()
    try:
        parent.popen.stdin.write("exit\n")  # leaves its child and grandchild running
        parent.popen.stdin.flush()
        assert parent.popen.wait(10) == 0
        assert wait_gone(parent.descendants, 5) == []
        assert wait_gone([parent.reaper], 5) == []
        err = parent.stderr_at_end()
        assert err.count(REAPED) == 1 and "killed 2 leftover process(es)" in err, err
    finally:
        parent.cleanup()


def test_clean_exit_leaves_nothing_to_reap_and_logs_nothing() -> None:
    parent = Parent()
    try:
        parent.popen.stdin.write("clean-exit\n")
        parent.popen.stdin.flush()
        assert parent.popen.wait(10) == 0
        assert wait_gone([parent.reaper], 5) == []
        assert REAPED not in parent.stderr_at_end()
    finally:
        parent.cleanup()


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "pid-and-create-time"])
def test_a_recorded_process_that_exited_is_never_signalled(monkeypatch, pidfd: bool) -> None:
    if not pidfd:  # kernels or sandboxes without pidfd_open
        monkeypatch.setattr(reaper, "_open_pidfd", lambda pid: None)
    child = subprocess.Popen(["sleep", "300"])
    watch = reaper._Watch(os.getpid())
    tracked = watch._track(psutil.Process(child.pid))
    assert tracked is not None and (tracked.pidfd is not None) == pidfd
    assert not tracked.exited()
    child.kill()
    child.wait()  # its PID is free for reuse now
    assert tracked.exited()
    assert tracked.signal(signal.SIGKILL) is False
    tracked.close()


def test_reaper_refuses_to_watch_a_process_that_is_not_its_parent() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "worker.engine.reaper", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "not this reaper's parent" in done.stderr


def test_watching_costs_little_and_imports_nothing_heavy() -> None:
    code = (
        "import sys, time; t = time.monotonic(); from worker.engine import reaper; "
        "h = reaper.watch_this_process(); print(time.monotonic() - t, h is not None, "
        "[m for m in ('vllm', 'torch', 'psutil') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30
    ).stdout.split(maxsplit=2)
    assert float(out[0]) < 3.0 and out[1] == "True" and out[2].strip() == "[]", out
