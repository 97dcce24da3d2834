"""One worker process, from its configuration to its exit: the metrics port, the engine, the
NATS runtime (worker/nats/runtime.py) and the console lines an operator reads; and the N
processes of `--worker-processes` over one engine core. `main` is the command
(`vllm-nats-worker`, `python -m worker`); worker/cli.py parses its options into configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from prometheus_client import REGISTRY

from messages.subjects import Subjects
from worker import health
from worker.cli import (
    build_parser,
    engine_args,
    missing_for_production,
    pooling,
    resolve_worker_processes,
    worker_config,
)
from worker.config import AUTO, WorkerConfig
from worker.engine import logs as engine_logs
from worker.engine import placement
from worker.metrics import WorkerMetrics
from worker.shared.gc_heap import freeze_startup_heap

log = logging.getLogger("worker")


@dataclass(frozen=True)
class Ready:
    """What a caller of `serve` learns once the worker takes requests."""

    nats_url: str
    subjects: Subjects
    instance_id: str
    metrics_port: int | None


def _say(line: str, stream: IO[str] | None = None) -> None:
    """One console line in one write: the processes of `--worker-processes N` share stdout, and
    a pipe keeps writes of up to PIPE_BUF (4096) bytes whole, where print's separate write of the
    newline (unbuffered output, PYTHONUNBUFFERED) let two processes' lines run together."""
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()


def _refused(args: argparse.Namespace) -> bool:
    if args.dev or not (missing := missing_for_production(args)):
        return False
    _say(
        f"vllm-nats-worker: {' and '.join(missing)} required (or --dev for an embedded "
        "nats-server and the tiny demo model)",
        sys.stderr,
    )
    return True


@contextlib.contextmanager
def _nats_for(args: argparse.Namespace) -> Iterator[None]:
    """--dev without a NATS URL: an embedded nats-server for the worker's lifetime."""
    from worker.dev.embedded import NatsServer

    if args.nats_url:
        yield
        return
    with NatsServer() as embedded:
        args.nats_url = embedded.url
        url = embedded.url
        _say(f"--dev: embedded nats-server on {url} (connect with NATS_URL={url})")
        yield


async def serve(
    args: argparse.Namespace,
    *,
    on_ready: Callable[[Ready], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
    client_config: dict[str, Any] | None = None,
    where: placement.Placement | None = None,
) -> int:
    """Runs the worker until SIGTERM/SIGINT (exit 0 after draining), a dead engine or a dead
    JetStream intake (exit 1); exit 2 for a configuration it refuses. With `client_config` it
    is one of --worker-processes over a shared engine core (`serve_processes`); `where`: the
    engine core it starts on CPUs of its own (`--engine-core-cpus`)."""
    from worker.engine import fast_merge
    from worker.engine.vllm_adapter import VllmEngine

    if _refused(args):
        return 2
    # Under load vLLM merges each request's pending DELTA outputs; the worker makes that cheap.
    fast_merge.install()
    stop = stop or asyncio.Event()
    with _nats_for(args):
        count = client_config.get("client_count", 1) if client_config else 1
        config = worker_config(args, count)
        # The parent of --worker-processes checked before it launched the engine core.
        if client_config is None and (refusal := await preflight(config)):
            _say(f"vllm-nats-worker: {refusal}", sys.stderr)
            return 2
        # The metrics port answers from before the engine loads: /health says "starting".
        live = _LiveHealth()
        server = None
        if args.metrics_port is not None:
            server = health.serve(args.metrics_host, args.metrics_port, REGISTRY, live.processes)
            log.info("metrics and health on http://%s:%d", args.metrics_host, server.server_port)
        try:
            engine = await VllmEngine.start(engine_args(args), client_config, where)
            try:
                try:
                    _check_kind(args, engine.limits.kind)
                    await engine.admin.load_static(args.lora_modules or [])
                except ValueError as error:
                    _say(f"vllm-nats-worker: {error}", sys.stderr)
                    return 2
                port = server.server_port if server is not None else None
                return await _run(args, config, engine, on_ready, stop, live, port)
            finally:
                engine.shutdown()
        finally:
            if server is not None:
                server.shutdown()


def _check_kind(args: argparse.Namespace, kind: str) -> None:
    """The endpoint was chosen from the flags (worker.cli.endpoint_of) before the engine said
    what the model serves: a model whose own architecture pools, started without the flags,
    would sit on the generate subject. ValueError then."""
    if args.endpoint is None and (kind == "embed") != pooling(args):
        raise ValueError(
            f"the model serves {kind} requests: start it with --runner pooling (an embedding "
            "model) or name its --endpoint"
        )


class _LiveHealth:
    """This process's health provider for its metrics port: none reported while the engine
    loads, then the serving worker's live state (`_run` sets `current`)."""

    def __init__(self) -> None:
        self.current: Callable[[], health.ProcessHealth] | None = None

    def processes(self) -> list[health.ProcessHealth]:
        return [] if self.current is None else [self.current()]


async def preflight(config: WorkerConfig) -> str | None:
    """What would fail only after the model loaded (minutes on a GPU), checked before it: the
    NATS URL and credentials (bounded attempts, `NatsConfig.start_attempts`) and, in jetstream
    mode, the stream and consumer (created when absent; refused when their settings differ).
    The refusal's one line, or None."""
    from worker.nats.intake.jetstream import JetStreamConfigError, ensure_stream_and_consumer
    from worker.shared.nats_connection import ConnectFailed, connect

    try:
        nc = await connect(config.nats, attempts=config.nats.start_attempts)
    except ConnectFailed as error:
        return str(error)
    try:
        if config.jetstream is not None:
            await ensure_stream_and_consumer(nc.jetstream(), config.subjects, config.jetstream)
    except JetStreamConfigError as error:
        return f"refusing to start: {error}"
    finally:
        await nc.close()
    return None


def serve_processes(args: argparse.Namespace, where: placement.Placement | None = None) -> int:
    """--worker-processes N > 1: the engine core once (on its own CPUs with `where`), N worker
    processes over it (each runs `serve` with its client_config), metrics summed over them and
    health read from their gauges on --metrics-port."""
    from worker.engine import reaper, scaleout

    if _refused(args):
        return 2
    try:
        scaleout.check_supported()
    except scaleout.ScaleOutUnsupported as error:
        _say(f"vllm-nats-worker: {error}", sys.stderr)
        return 2
    reaper.watch_this_process()
    args.instance_id = args.instance_id or uuid.uuid4().hex[:12]
    with _nats_for(args):
        config = worker_config(args, args.worker_processes)
        if refusal := asyncio.run(preflight(config)):
            _say(f"vllm-nats-worker: {refusal}", sys.stderr)
            return 2
        if args.metrics_port is not None:
            _serve_summed_metrics(args)
        timeout = float(args.drain_timeout) + 10.0
        return scaleout.run(
            engine_args(args), args, args.worker_processes, _worker_process, timeout, where
        )


def _serve_summed_metrics(args: argparse.Namespace) -> None:
    """The processes' metrics, summed, and their health (from their gauges) on one port served
    by this parent process."""
    from worker.engine import scaleout

    registry = scaleout.summed_metrics_registry()
    server = health.serve(
        args.metrics_host,
        args.metrics_port,
        registry,
        functools.partial(health.from_gauges, registry),
        expected=args.worker_processes,
    )
    log.info(
        "metrics and health of every worker process on http://%s:%d",
        args.metrics_host,
        server.server_port,
    )
    _say(f"metrics http://{args.metrics_host}:{server.server_port}/metrics")
    args.metrics_port = None  # the processes themselves serve none


def _worker_process(
    listen_address: str, sock: Any, args: argparse.Namespace, client_config: dict[str, Any]
) -> None:
    """One of --worker-processes (vLLM's APIServerProcessManager calls it in a fresh process)."""
    setup_logging(args.worker_log_level)
    index = client_config["client_index"]
    args.client_index = index
    args.engine_id = args.instance_id
    args.instance_id = f"{args.instance_id}-{index}"
    sys.exit(asyncio.run(serve(args, client_config=client_config)))


async def _run(
    args: argparse.Namespace,
    config: WorkerConfig,
    engine: Any,  # VllmEngine
    on_ready: Callable[[Ready], Awaitable[None]] | None,
    stop: asyncio.Event,
    live: _LiveHealth,
    metrics_port: int | None,
) -> int:
    from worker.nats.intake.jetstream import JetStreamConfigError
    from worker.nats.runtime import open_worker

    metrics = WorkerMetrics(engine.limits.model, REGISTRY)
    # Before the runtime's tasks start (KV event forwarding, probes, intake): the collection
    # holds the event loop for as long as it walks the engine's heap.
    freeze_startup_heap()
    try:
        runtime = await open_worker(engine, config, metrics)
    except JetStreamConfigError as error:
        _say(f"vllm-nats-worker: refusing to start: {error}", sys.stderr)
        return 2
    service = runtime.service

    def current() -> health.ProcessHealth:
        # Draining from the signal on, before the drain itself begins.
        return health.ProcessHealth(
            engine_alive=not service.engine_dead.is_set(),
            nats_connected=runtime.nc.is_connected,
            draining=stop.is_set() or service.draining,
        )

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    background = [asyncio.create_task(health.publish(current, metrics))]
    if not args.disable_log_stats:  # vLLM's engine argument, as `vllm serve` honours it
        interval = engine_logs.stats_interval_s()
        background.append(asyncio.create_task(engine_logs.log_stats_every(engine, interval)))
    live.current = current
    ready = Ready(config.nats.servers[0], config.subjects, config.instance_id, metrics_port)
    serving = (
        config.subjects.queue + " (jetstream)" if config.jetstream else config.subjects.generate
    )
    _say(
        f"vllm-nats-worker ready: model {engine.limits.model} on {serving} "
        f"(instance {config.instance_id}) via {ready.nats_url}"
        + (f", metrics http://{args.metrics_host}:{metrics_port}/metrics" if metrics_port else "")
    )
    try:
        if on_ready is not None:
            await on_ready(ready)
        # The health gauges say "draining" or "engine dead" at once, not at the next publish.
        return await runtime.run(stop, on_stopping=lambda: health.record(metrics, current()))
    finally:
        for task in background:
            task.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runtime.stop()


def setup_logging(level: str) -> None:
    """One format for the worker's lines and vLLM's (worker/engine/logs.py)."""
    engine_logs.configure(level)


def main(argv: list[str] | None = None) -> None:
    """The command. Its last console line is always `vllm-nats-worker stopped (exit N)`, on
    every way it ends but a kill: after a drain (0), a dead engine or intake (1), a refused
    configuration (2), an unexpected error (1, after its traceback) or SIGINT before it is
    ready (130)."""
    args = build_parser().parse_args(argv)
    setup_logging(args.worker_log_level)
    code = 1
    try:
        asked = args.worker_processes
        args.worker_processes = resolve_worker_processes(args)
        if asked == AUTO:
            log.info("--worker-processes auto: %d", args.worker_processes)
        try:
            where = placement.plan(args.engine_core_cpus, placement.allowed())
        except ValueError as error:
            _say(f"vllm-nats-worker: {error}", sys.stderr)
            code = 2
        else:
            if args.worker_processes > 1:
                code = serve_processes(args, where)
            else:
                code = asyncio.run(serve(args, where=where))
    except KeyboardInterrupt:
        code = 130
    except Exception:
        log.exception("vllm-nats-worker failed")
    finally:
        _say(f"vllm-nats-worker stopped (exit {code})")
    sys.exit(code)
