"""`vllm-nats-worker` / `python -m worker`: vLLM's own engine arguments plus the NATS worker's.

Every vLLM engine argument is accepted exactly as `vllm serve` accepts it (the parser is vLLM's
FlexibleArgumentParser filled by `AsyncEngineArgs.add_cli_args`, worker/engine/args.py), so
`--model`, `--tensor-parallel-size`, `--max-logprobs`, `--max-model-len` … mean what they mean
there. The worker's own options are declared once in `OPTIONS`, each bound to the config field
(worker/config.py) that holds its default; environment variables give defaults through
`config.environment()`.

`--model` and a NATS URL (`--nats-url` or NATS_URL) are required: a production worker never
starts on a model or a broker nobody chose. `--dev` (and the demo) asks for the development
defaults instead, loudly: an embedded nats-server on loopback and the tiny random-weight model.
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
from worker.config import (
    ENVIRONMENT,
    JetStreamSettings,
    WorkerConfig,
    at_least_one,
    default,
    environment,
)
from worker.engine import args as engine_cli
from worker.engine import logs as engine_logs
from worker.metrics import WorkerMetrics
from worker.shared.nats_options import add_nats_arguments, nats_config

log = logging.getLogger("worker")

DESCRIPTION = (
    "Serve a vLLM engine over NATS: tokenized generation requests on "
    "<namespace>.<component>.<endpoint> (queue group), streamed token/logprob frames to each "
    "request's reply subject. Takes every vLLM engine argument, as `vllm serve` does."
)
USAGE = "%(prog)s --model MODEL --nats-url URL [NATS options] [vLLM engine options]"
NATS_GROUPS = ("NATS connection", "NATS worker")
"""The worker's own argument groups: --help shows them first, in full."""


@dataclass(frozen=True)
class Option:
    """One worker option: its flag, the config field it sets (and takes its default from)."""

    flag: str
    config: type | None
    field: str
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    default: Any = None
    """Only for options without a config field."""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


OPTIONS: list[Option] = [
    Option("--namespace", Subjects, "namespace", "first subject token"),
    Option("--component", Subjects, "component", "second subject token"),
    Option("--endpoint", Subjects, "endpoint", "third subject token"),
    Option(
        "--queue-group",
        WorkerConfig,
        "queue_group",
        "workers of one queue group share the subject",
    ),
    Option(
        "--instance-id",
        None,
        "instance_id",
        "this worker's id; it also serves <subject>.<instance-id> (default: random)",
    ),
    Option(
        "--worker-processes",
        WorkerConfig,
        "processes",
        "worker processes over one engine core, each an AsyncLLM client with its own NATS "
        "connection in the queue group (vLLM's front-end scale-out, vLLM 0.24 and 0.32+); "
        "as vllm serve's --api-server-count; 4 on a GPU host under high "
        "concurrency (README: Worker processes)",
        at_least_one,
    ),
    Option(
        "--max-concurrency",
        WorkerConfig,
        "max_concurrency",
        "requests served at once; more get an immediate retryable 'overloaded' error frame "
        "(default: unlimited; in jetstream mode the pull's capacity, 64)",
        int,
    ),
    Option(
        "--drain-timeout",
        WorkerConfig,
        "drain_timeout_s",
        "on SIGTERM/SIGINT, seconds in-flight requests may still run before they get a "
        "retryable 'worker_shutdown' error frame",
        float,
    ),
    Option(
        "--kv-events",
        WorkerConfig,
        "kv_events",
        "KV-aware routing: publish vLLM's prefix-cache events, snapshots and load reports on "
        "NATS (README: KV-aware routing); --no-kv-events turns it off",
        bool,
    ),
    Option("--max-n", WorkerConfig, "max_n", "largest n (choices) accepted", int),
    Option(
        "--max-tokens-limit",
        WorkerConfig,
        "max_tokens_limit",
        "largest max_tokens a request may ask (default: the model's context length)",
        int,
    ),
    Option(
        "--max-request-bytes",
        WorkerConfig,
        "max_request_bytes",
        "larger request payloads are refused",
        int,
    ),
    Option(
        "--liveness-interval",
        WorkerConfig,
        "liveness_interval_s",
        "seconds between probes of in-flight requests' clients (one probe per client and "
        "round, see --client-gone-grace)",
        float,
    ),
    Option(
        "--client-gone-grace",
        WorkerConfig,
        "client_gone_grace_s",
        "seconds a client's reply subject must stay without a subscriber before its requests "
        "are aborted; covers a client's reconnect after a broker outage",
        float,
    ),
    Option(
        "--outage-wait",
        WorkerConfig,
        "outage_wait_s",
        "seconds a request's frames may wait for the broker and its client to come back before "
        "the request is aborted",
        float,
    ),
    Option(
        "--health-interval",
        WorkerConfig,
        "health_interval_s",
        "seconds between engine health checks; a dead engine exits non-zero",
        float,
    ),
    Option(
        "--metrics-port",
        None,
        "metrics_port",
        "serve Prometheus /metrics and the JSON /health on this port, 0 = any free port "
        "(default: off)",
        int,
    ),
    Option("--metrics-host", None, "metrics_host", "metrics bind address", default="0.0.0.0"),
    Option(
        "--mode",
        None,
        "mode",
        "core: a queue group on the core subjects (at most once); jetstream: a durable "
        "work-queue stream on <namespace>.<component>.queue.<endpoint>, pulled by free capacity",
        choices=("core", "jetstream"),
        default="core",
    ),
    Option(
        "--js-stream",
        JetStreamSettings,
        "stream",
        "stream name (default: NS_COMPONENT_ENDPOINT)",
    ),
    Option("--js-durable", JetStreamSettings, "durable", "shared durable consumer name"),
    Option(
        "--js-ack-wait",
        JetStreamSettings,
        "ack_wait_s",
        "seconds without an ack (or in-progress ack) before redelivery",
        float,
    ),
    Option(
        "--js-max-deliver",
        JetStreamSettings,
        "max_deliver",
        "delivery attempts before a request is terminated with an error frame",
        int,
    ),
    Option(
        "--js-max-ack-pending",
        JetStreamSettings,
        "max_ack_pending",
        "deliveries the consumer lets be unacknowledged at once",
        int,
    ),
    Option(
        "--js-max-age",
        JetStreamSettings,
        "max_age_s",
        "seconds a queued request may wait before the stream drops it",
        float,
    ),
    Option(
        "--worker-log-level",
        None,
        "worker_log_level",
        "log level of the worker's own logs (vLLM's: --log-level / VLLM_LOGGING_LEVEL)",
        choices=("debug", "info", "warning", "error"),
        default="info",
    ),
]


def build_parser(prog: str = "vllm-nats-worker") -> argparse.ArgumentParser:
    parser = engine_cli.parser(prog, DESCRIPTION, USAGE, NATS_GROUPS)
    # No default URL: a production worker needs one (or --dev).
    add_nats_arguments(parser, url_default=None)
    group = parser.add_argument_group("NATS worker", "Subjects, limits and lifecycle.")
    env_of = {dest: name for name, dest in ENVIRONMENT.items()}
    for option in OPTIONS:
        value = option.default if option.config is None else default(option.config, option.field)
        shown = ",".join(value) if isinstance(value, list) else value
        help_text = option.help
        if shown is not None:
            help_text += f" (default: {shown})"
        if option.dest in env_of:
            help_text += f" [env {env_of[option.dest]}]"
        if option.type is bool:
            group.add_argument(
                option.flag, action=argparse.BooleanOptionalAction, default=value, help=help_text
            )
            continue
        group.add_argument(
            option.flag, type=option.type, choices=option.choices, default=value, help=help_text
        )
    group.add_argument(
        "--dev",
        action="store_true",
        help="development mode: an embedded nats-server when no NATS URL is given and the tiny "
        "random-weight demo model when no --model is given (never for production)",
    )
    engine_cli.add_engine_args(parser, NATS_GROUPS)
    parser.set_defaults(**environment())
    return parser


def _fields(args: argparse.Namespace, config: type) -> dict[str, Any]:
    return {
        option.field: getattr(args, option.dest) for option in OPTIONS if option.config is config
    }


def worker_config(args: argparse.Namespace, client_count: int = 1) -> WorkerConfig:
    """The config of one worker process (one of `client_count` over a shared engine core, whose
    share of --max-concurrency it takes)."""
    settings = _fields(args, WorkerConfig)
    if args.mode == "jetstream" and settings["max_concurrency"] is None:
        settings["max_concurrency"] = default(JetStreamSettings, "capacity")
    if settings["max_concurrency"] is not None and client_count > 1:
        settings["max_concurrency"] = -(-settings["max_concurrency"] // client_count)
    config = WorkerConfig(
        nats=nats_config(args),
        subjects=Subjects(**_fields(args, Subjects)),
        **settings,
    )
    if args.instance_id:
        config.instance_id = args.instance_id
    config.engine_id = getattr(args, "engine_id", None)  # set in a --worker-processes child
    config.kv_event_source = getattr(args, "client_index", 0) == 0
    return config


def jetstream_settings(args: argparse.Namespace, config: WorkerConfig) -> JetStreamSettings:
    return JetStreamSettings(
        **_fields(args, JetStreamSettings), capacity=config.max_concurrency or 0
    )


def missing_for_production(args: argparse.Namespace) -> list[str]:
    """What a non-dev worker lacks: it must be told its model and its broker."""
    missing = []
    if args.model is None:
        missing.append("--model")
    if not args.nats_url:
        missing.append("--nats-url (or NATS_URL)")
    return missing


def engine_args(args: argparse.Namespace) -> Any:
    """vLLM's AsyncEngineArgs; in --dev mode without --model, the tiny demo model's."""
    dev_model = None
    if args.dev and args.model is None:
        from worker.dev.tiny_model import ensure_tiny_model

        dev_model = ensure_tiny_model()
        log.warning("--dev and no --model: serving the tiny demo model %s (random)", dev_model)
    engine = engine_cli.engine_args(args, dev_model=dev_model)
    if args.kv_events and args.mode == "core":
        from worker.engine import kv_events

        kv_events.configure(engine)
        # The processes of --worker-processes build their engine arguments again from `args`:
        # they must read the publisher the engine core was launched with.
        args.kv_events_config = engine.kv_events_config
    return engine


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
) -> int:
    """Runs the worker until SIGTERM/SIGINT (exit 0 after draining), a dead engine or a dead
    JetStream intake (exit 1); exit 2 for a configuration it refuses. With `client_config` it
    is one of --worker-processes over a shared engine core (`serve_processes`)."""
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
        if client_config is None and (refusal := await preflight(args, config)):
            _say(f"vllm-nats-worker: {refusal}", sys.stderr)
            return 2
        # The metrics port answers from before the engine loads: /health says "starting".
        live = _LiveHealth()
        server = None
        if args.metrics_port is not None:
            server = health.serve(args.metrics_host, args.metrics_port, REGISTRY, live.processes)
            log.info("metrics and health on http://%s:%d", args.metrics_host, server.server_port)
        try:
            engine = await VllmEngine.start(engine_args(args), client_config)
            try:
                port = server.server_port if server is not None else None
                return await _run(args, config, engine, on_ready, stop, live, port)
            finally:
                engine.shutdown()
        finally:
            if server is not None:
                server.shutdown()


class _LiveHealth:
    """This process's health provider for its metrics port: none reported while the engine
    loads, then the serving worker's live state (`_run` sets `current`)."""

    def __init__(self) -> None:
        self.current: Callable[[], health.ProcessHealth] | None = None

    def processes(self) -> list[health.ProcessHealth]:
        return [] if self.current is None else [self.current()]


async def preflight(args: argparse.Namespace, config: WorkerConfig) -> str | None:
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
        if args.mode == "jetstream":
            settings = jetstream_settings(args, config)
            await ensure_stream_and_consumer(nc.jetstream(), config.subjects, settings)
    except JetStreamConfigError as error:
        return f"refusing to start: {error}"
    finally:
        await nc.close()
    return None


def serve_processes(args: argparse.Namespace) -> int:
    """--worker-processes N > 1: the engine core once, N worker processes over it (each runs
    `serve` with its client_config), metrics summed over them and health read from their gauges
    on --metrics-port."""
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
        if refusal := asyncio.run(preflight(args, config)):
            _say(f"vllm-nats-worker: {refusal}", sys.stderr)
            return 2
        if args.metrics_port is not None:
            _serve_summed_metrics(args)
        timeout = float(args.drain_timeout) + 10.0
        return scaleout.run(
            engine_args(args), args, args.worker_processes, _worker_process, timeout
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
    from worker.nats.intake.jetstream import JetStreamConfigError, JetStreamIntake
    from worker.nats.worker import NatsWorker
    from worker.shared.nats_connection import connect

    metrics = WorkerMetrics(engine.limits.model, REGISTRY)
    nc = await connect(config.nats)
    worker = NatsWorker(engine, nc, config, metrics)

    def current() -> health.ProcessHealth:
        # Draining from the signal on, before the drain itself begins.
        return health.ProcessHealth(
            engine_alive=not worker.engine_dead.is_set(),
            nats_connected=nc.is_connected,
            draining=stop.is_set() or worker.draining,
        )

    settings = jetstream_settings(args, config) if args.mode == "jetstream" else None
    await worker.start(jetstream=settings)
    intake = None
    if settings is not None:
        intake = JetStreamIntake(worker, nc, settings, settings.capacity)
        try:
            await intake.start()
        except JetStreamConfigError as error:
            _say(f"vllm-nats-worker: refusing to start: {error}", sys.stderr)
            await worker.stop()
            await nc.drain()
            return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    background = [
        asyncio.create_task(worker.watch_engine()),
        asyncio.create_task(health.publish(current, metrics)),
    ]
    if not args.disable_log_stats:  # vLLM's engine argument, as `vllm serve` honours it
        interval = engine_logs.stats_interval_s()
        background.append(asyncio.create_task(engine_logs.log_stats_every(engine, interval)))
    live.current = current
    ready = Ready(config.nats.servers[0], config.subjects, config.instance_id, metrics_port)
    serving = config.subjects.queue + " (jetstream)" if intake else config.subjects.generate
    _say(
        f"vllm-nats-worker ready: model {engine.limits.model} on {serving} "
        f"(instance {config.instance_id}) via {ready.nats_url}"
        + (f", metrics http://{args.metrics_host}:{metrics_port}/metrics" if metrics_port else "")
    )
    try:
        if on_ready is not None:
            await on_ready(ready)
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(worker.engine_dead.wait())]
        if intake is not None:
            waits.append(asyncio.create_task(intake.failed.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        health.record(metrics, current())  # the gauges say so at once, not a second later
        if intake is not None:
            await intake.stop()
            if intake.failed.is_set():
                log.error("jetstream intake failed: draining and exiting non-zero")
                await worker.drain(config.drain_timeout_s)
                return 1
        if worker.engine_dead.is_set():
            log.error("engine is dead: answering in-flight requests and exiting")
            tasks = worker.interrupt_all("engine_error", "the engine died: retry on another worker")
            await asyncio.gather(*tasks, return_exceptions=True)
            return 1
        log.info("stopping: draining (timeout %.1fs)", config.drain_timeout_s)
        await worker.drain(config.drain_timeout_s)
        return 0
    finally:
        for task in background:
            task.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await worker.stop()
        await nc.drain()


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
        if args.worker_processes > 1:
            code = serve_processes(args)
        else:
            code = asyncio.run(serve(args))
    except KeyboardInterrupt:
        code = 130
    except Exception:
        log.exception("vllm-nats-worker failed")
    finally:
        _say(f"vllm-nats-worker stopped (exit {code})")
    sys.exit(code)
