"""A watchdog process that kills the worker's leftover processes when its main process dies.

Invariant: once `watch_this_process()` has returned, no process started by this process or by its
descendants (vLLM's EngineCore, its executor workers, an embedded nats-server, ...) outlives this
process by more than about one poll interval, however it ends: a normal exit, a crash, or a
SIGKILL of the main process alone. The reaper kills nothing else: never itself, never a process it
did not see as a descendant of the watched process, never a process that merely reuses such a PID.

Why: vLLM 0.32 gives EngineCore no parent-death handling. multiprocessing only terminates its
children from the parent's atexit hook, which a SIGKILL (or the OOM killer) never runs, so an
orphaned EngineCore keeps its memory (2.1 GiB seen, still held 30 s later) and, on a GPU, the
device. PR_SET_PDEATHSIG is no fix: vLLM starts EngineCore with `fork` (GPU default) or `spawn`
(forced on CPU, and on GPU once CUDA is initialized; `vllm.utils.system_utils.get_mp_context`), and
a spawned child is forked and exec'd inside `_posixsubprocess`, where no `os.register_at_fork`
hook runs; the signal is also tied to the forking *thread* (not process) and covers only direct
children, not the executor workers EngineCore starts in turn.

How: `watch_this_process()` starts `python -m worker.engine.reaper <pid>` (no vllm/torch import;
ready in ~0.1 s) in its own session, so terminal and process-group signals aimed at the worker
leave it alive to clean up. Every `interval` s the reaper records the watched process's
descendants, each by a pidfd (or, where pidfds are missing, by PID plus creation time), so a signal
can never reach a process that reused a recorded PID. It wakes as soon as the watched process exits
(its pidfd becomes readable; its own parent PID changes, since the reaper is the watched process's
child), then freezes (SIGSTOP) the recorded processes still alive plus any descendants they have,
so nothing new can be forked meanwhile, SIGKILLs them all, logs one line on stderr if it killed
anything, and exits. Because it works on the process tree, the start method does not matter.

One descendant is left to end by itself: multiprocessing's resource tracker. It exits once every
other holder of its pipe is gone, and first unlinks the shared memory and semaphores the killed
processes registered (vLLM's EngineCore queues live in /dev/shm). Killed, it would leave them
there until reboot. The reaper continues it (it may have been stopped with its process group) and
kills it only if it is still there `CLEANUP_GRACE_S` later.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.5
CLEANUP_GRACE_S = 5.0
_READY = b"ready\n"
_RESOURCE_TRACKER = "from multiprocessing.resource_tracker import main"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# The worker's side: start one reaper per process.


@dataclass
class Reaper:
    """The handle of a running reaper; it needs no stopping (it exits after its watched process)."""

    watched_pid: int
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None


_reaper: Reaper | None = None


def watch_this_process(
    interval: float = DEFAULT_INTERVAL_S, ready_timeout: float = 10.0
) -> Reaper | None:
    """Starts the reaper for this process (once per process) and waits until it watches.

    Never raises: a reaper that cannot start is logged and the worker runs without it.
    """
    global _reaper
    me = os.getpid()
    if _reaper is not None and _reaper.watched_pid == me and _reaper.running():
        return _reaper
    command = [sys.executable, "-m", "worker.engine.reaper", str(me), "--interval", str(interval)]
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            # `python -m` puts its working directory first on sys.path: the package is found
            # from a source checkout as from an install, whatever the worker's own cwd.
            cwd=_PACKAGE_ROOT,
            start_new_session=True,
        )
    except OSError as error:
        log.warning("reaper not started (%s): leftovers may outlive a killed worker", error)
        return None
    assert process.stdout is not None
    try:
        ready = _readable(process.stdout.fileno(), ready_timeout)
        ready = ready and process.stdout.readline() == _READY
    finally:
        process.stdout.close()
    if not ready:
        log.warning("reaper pid %d did not report ready within %.0fs", process.pid, ready_timeout)
    _reaper = Reaper(me, process)
    return _reaper


# --------------------------------------------------------------------------------------------
# The reaper's side (runs in its own process).


@dataclass
class _Tracked:
    """One recorded descendant: its psutil handle and, where the kernel has them, a pidfd."""

    process: psutil.Process
    pidfd: int | None
    name: str = field(default="?")

    def exited(self) -> bool:
        if self.pidfd is not None:  # readable once the process has exited (zombies included)
            return _readable(self.pidfd, 0)
        import psutil

        try:
            return not self.process.is_running() or self.process.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def cleans_up(self) -> bool:
        """Whether this is multiprocessing's resource tracker (see the module's docstring)."""
        import psutil

        try:
            return _RESOURCE_TRACKER in " ".join(self.process.cmdline())
        except psutil.Error:
            return False

    def signal(self, sig: int) -> bool:
        """Sends `sig` to exactly this process; False if it is gone (its PID is never reused)."""
        import psutil

        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            elif self.process.is_running():  # checks the creation time, i.e. no PID reuse
                os.kill(self.process.pid, sig)
            else:
                return False
        except (ProcessLookupError, psutil.Error):
            return False
        except PermissionError:
            return False
        return True

    def close(self) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None


def _readable(fd: int, timeout: float) -> bool:
    """Whether `fd` is readable within `timeout` s (poll, not select: any fd number works)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined,unused-ignore]
    except (AttributeError, OSError):
        return None


class _Watch:
    def __init__(self, watched: int) -> None:
        self.watched = watched
        self.own_pid = os.getpid()
        self.tracked: dict[int, _Tracked] = {}
        self.watched_fd = _open_pidfd(watched)

    def watched_alive(self) -> bool:
        # The reaper is the watched process's child: it is re-parented the moment that one exits.
        return os.getppid() == self.watched

    def wait(self, timeout: float) -> None:
        if self.watched_fd is not None:
            _readable(self.watched_fd, timeout)
        else:
            time.sleep(timeout)

    def _track(self, child: psutil.Process) -> _Tracked | None:
        """Records `child`, making sure the pidfd names the process that was listed."""
        import psutil

        if child.pid == self.own_pid or child.pid in self.tracked:
            return None
        pidfd = _open_pidfd(child.pid)
        try:
            same = psutil.Process(child.pid).create_time() == child.create_time()
            name = child.name()
        except psutil.Error:
            same, name = False, "?"
        if not same:  # it exited (and its PID may be reused) between listing and pidfd_open
            if pidfd is not None:
                os.close(pidfd)
            return None
        tracked = _Tracked(child, pidfd, name)
        self.tracked[child.pid] = tracked
        return tracked

    def scan(self) -> None:
        """Records the watched process's current descendants and forgets the exited ones."""
        import psutil

        for pid, tracked in list(self.tracked.items()):
            if tracked.exited():
                tracked.close()
                del self.tracked[pid]
        try:
            children = psutil.Process(self.watched).children(recursive=True)
        except psutil.Error:
            return
        if not self.watched_alive():  # the listing may be of a process that reused the PID
            return
        for child in children:
            self._track(child)

    def reap(self) -> list[str]:
        """Freezes and kills every recorded process still alive (and its descendants)."""
        import psutil

        frozen: list[_Tracked] = []
        alive = [t for t in self.tracked.values() if not t.exited()]
        cleaners = [t for t in alive if t.cleans_up()]
        batch = [t for t in alive if t not in cleaners]
        try:
            for _ in range(8):  # stopped processes cannot fork: a few rounds reach a fixpoint
                for tracked in batch:
                    with contextlib.suppress(psutil.Error):
                        tracked.name = tracked.process.name()
                    if tracked.signal(signal.SIGSTOP):
                        frozen.append(tracked)
                newcomers: list[_Tracked] = []
                for tracked in batch:
                    try:
                        children = tracked.process.children(recursive=True)
                    except psutil.Error:
                        continue
                    for child in children:
                        found = self._track(child)
                        if found is not None and not found.exited() and not found.cleans_up():
                            newcomers.append(found)
                if not newcomers:
                    break
                batch = newcomers
        finally:
            killed = [f"{t.process.pid} ({t.name})" for t in frozen if t.signal(signal.SIGKILL)]
        killed += self._let_clean_up(cleaners)
        for tracked in self.tracked.values():
            tracked.close()
        self.tracked.clear()
        return killed

    @staticmethod
    def _let_clean_up(cleaners: list[_Tracked]) -> list[str]:
        """Continues the resource trackers, waits for their exit, and kills any still there."""
        for tracked in cleaners:
            tracked.signal(signal.SIGCONT)
        deadline = time.monotonic() + CLEANUP_GRACE_S
        while any(not t.exited() for t in cleaners) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [
            f"{t.process.pid} ({t.name})"
            for t in cleaners
            if not t.exited() and t.signal(signal.SIGKILL)
        ]


def run(watched: int, interval: float = DEFAULT_INTERVAL_S, ready: IO[bytes] | None = None) -> int:
    """The reaper's main loop; `watched` must be the reaper's parent. Returns the exit status."""
    if os.getppid() != watched:
        print(
            f"vllm-nats-worker reaper: pid {watched} is not this reaper's parent; not watching",
            file=sys.stderr,
            flush=True,
        )
        return 2
    watch = _Watch(watched)
    watch.scan()
    if ready is not None:
        with contextlib.suppress(OSError):
            ready.write(_READY)
            ready.flush()
            ready.close()
    while watch.watched_alive():
        watch.wait(interval)
        if watch.watched_alive():
            watch.scan()
    killed = watch.reap()
    if killed:
        print(
            f"vllm-nats-worker reaper: worker process {watched} is gone; killed "
            f"{len(killed)} leftover process(es): {', '.join(killed)}",
            file=sys.stderr,
            flush=True,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker.engine.reaper",
        description="Kill PID's descendants once PID (this reaper's parent) is gone.",
    )
    parser.add_argument("pid", type=int, help="the process to watch (must be the parent)")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S)
    args = parser.parse_args(argv)
    # Signals meant for the worker (Ctrl-C, a terminal hang-up) must not stop its cleanup.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    ready = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # stdout is the ready pipe: keep nothing else on it
    os.close(devnull)
    return run(args.pid, args.interval, ready)


if __name__ == "__main__":
    sys.exit(main())
