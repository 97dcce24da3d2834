"""`--processes N`: N frontend processes on one port, each with its own event loop, tokenizer and
NATS connection (the frontend's per-request work, tokenizing, detokenizing and SSE encoding, is
Python on one event loop, so one process is a ceiling of its own).

Each process listens on its own socket bound with SO_REUSEPORT, so the kernel spreads new
connections over the processes evenly by their addresses (one shared listening socket would let
whichever process wakes first accept a whole burst). The parent binds the port first, without
listening, to fail early when it is taken and to learn the port when 0 was asked for.

Invariants: never a half-alive frontend (a process that dies ends the others and the parent
exits non-zero); SIGTERM/SIGINT to the parent stop every process, each finishing its open
responses as uvicorn does, and the parent exits 0.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import multiprocessing.connection
import signal
import socket
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0


def reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run(
    args: argparse.Namespace, processes: int, serve: Callable[[argparse.Namespace, Any], None]
) -> int:
    """Runs `serve(args, listening_socket)` in `processes` spawned processes until one dies
    (exit 1) or a signal stops them all (exit 0). Blocks."""
    reserved = reuseport_socket(args.host, args.port)
    args.port = reserved.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    children = [
        context.Process(target=_child, args=(serve, args, index), name=f"frontend-{index}")
        for index in range(processes)
    ]
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            log.info("signal %d: stopping the frontend processes", signum)
            for child in children:
                if child.pid is not None and child.is_alive():
                    child.terminate()  # SIGTERM: uvicorn's graceful shutdown

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for child in children:
            child.start()
        print(f"frontend: {processes} processes on http://{args.host}:{args.port}/v1", flush=True)
        sentinels = {child.sentinel: child for child in children}
        ended = multiprocessing.connection.wait(list(sentinels))
        if not stopping:
            for sentinel in ended:
                child = sentinels[sentinel]  # type: ignore[index]  # wait() gives back the ints
                child.join(5)  # its sentinel closes a moment before it can be reaped
                log.error("frontend process %s died with exit code %s", child.name, child.exitcode)
            stopping = True
            for child in children:
                if child.is_alive():
                    child.terminate()
            _join(children)
            return 1
        _join(children)
        return 0
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
        reserved.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _join(children: list[Any]) -> None:
    for child in children:
        child.join(SHUTDOWN_TIMEOUT_S)


def _child(
    serve: Callable[[argparse.Namespace, Any], None], args: argparse.Namespace, index: int
) -> None:
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s frontend-{index} %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    sock = reuseport_socket(args.host, args.port)
    sock.listen(2048)
    serve(args, sock)
