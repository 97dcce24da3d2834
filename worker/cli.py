"""`vllm-nats-worker` / `python -m worker`: vLLM's own engine arguments plus the NATS worker's.

Every vLLM engine argument is accepted exactly as `vllm serve` accepts it (the parser is vLLM's
FlexibleArgumentParser filled by `AsyncEngineArgs.add_cli_args`), so `--model`,
`--tensor-parallel-size`, `--max-logprobs`, `--max-model-len` … mean what they mean there.

Defaults that make one command work on a fresh machine:
- no `--nats-url` (nor NATS_URL): an embedded nats-server is started on loopback;
- no `--model`: the tiny demo model is built (or reused) and served in fp32 with
  max_model_len 512 and eager mode, unless those are given too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import REGISTRY, start_http_server

from messages.subjects import Subjects
from worker.config import NatsConfig, WorkerConfig
from worker.embedded import NatsServer
from worker.metrics import WorkerMetrics
from worker.service import Worker
from worker.transport import connect

log = logging.getLogger("worker")

DESCRIPTION = (
    "Serve a vLLM engine over NATS: tokenized generation requests on "
    "<namespace>.<component>.<endpoint> (queue group), streamed token/logprob frames to each "
    "request's reply subject. Takes every vLLM engine argument, as `vllm serve` does."
)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def build_parser() -> argparse.ArgumentParser:
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    parser = FlexibleArgumentParser(prog="vllm-nats-worker", description=DESCRIPTION)
    nats = parser.add_argument_group(
        "NATS worker", "Transport, subjects and lifecycle (NATS settings also from env vars)."
    )
    nats.add_argument(
        "--nats-url",
        default=os.environ.get("NATS_URL"),
        help="NATS server URL, or a comma-separated list of a cluster's nodes [env NATS_URL]. "
        "Unset: start an embedded nats-server on loopback and print its URL.",
    )
    nats.add_argument("--namespace", default="llm", help="first subject token (default: llm)")
    nats.add_argument("--component", default="vllm", help="second subject token (default: vllm)")
    nats.add_argument(
        "--endpoint", default="generate", help="third subject token (default: generate)"
    )
    nats.add_argument(
        "--queue-group",
        default="vllm-workers",
        help="workers of one queue group share the subject (default: vllm-workers)",
    )
    nats.add_argument(
        "--instance-id",
        default=None,
        help="this worker's id; it also serves <subject>.<instance-id> (default: random)",
    )
    nats.add_argument("--nats-user", default=os.environ.get("NATS_USER"), help="[env NATS_USER]")
    nats.add_argument(
        "--nats-password", default=os.environ.get("NATS_PASSWORD"), help="[env NATS_PASSWORD]"
    )
    nats.add_argument("--nats-token", default=os.environ.get("NATS_TOKEN"), help="[env NATS_TOKEN]")
    nats.add_argument(
        "--nats-creds",
        default=os.environ.get("NATS_CREDS"),
        help="credentials (JWT + nkey) file [env NATS_CREDS]",
    )
    nats.add_argument(
        "--nats-nkey-seed",
        default=os.environ.get("NATS_NKEY_SEED"),
        help="nkey seed file [env NATS_NKEY_SEED]",
    )
    nats.add_argument(
        "--tls-ca", default=os.environ.get("NATS_TLS_CA"), help="CA file [env NATS_TLS_CA]"
    )
    nats.add_argument(
        "--tls-cert",
        default=os.environ.get("NATS_TLS_CERT"),
        help="client cert [env NATS_TLS_CERT]",
    )
    nats.add_argument(
        "--tls-key", default=os.environ.get("NATS_TLS_KEY"), help="client key [env NATS_TLS_KEY]"
    )
    nats.add_argument(
        "--max-concurrency",
        type=int,
        default=_env_int("WORKER_MAX_CONCURRENCY"),
        help="requests served at once; more get an immediate retryable 'overloaded' error frame "
        "(default: unlimited) [env WORKER_MAX_CONCURRENCY]",
    )
    nats.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds in-flight requests may still run before they get a "
        "retryable 'worker_shutdown' error frame (default: 30)",
    )
    nats.add_argument(
        "--max-n", type=int, default=16, help="largest n (choices) accepted (default: 16)"
    )
    nats.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask (default: the model's context length)",
    )
    nats.add_argument(
        "--max-request-bytes",
        type=int,
        default=1024 * 1024,
        help="larger request payloads are refused (default: 1 MiB)",
    )
    nats.add_argument(
        "--liveness-interval",
        type=float,
        default=2.0,
        help="seconds between probes of in-flight requests' clients (one probe per client and "
        "round, see --client-gone-grace) (default: 2)",
    )
    nats.add_argument(
        "--client-gone-grace",
        type=float,
        default=WorkerConfig.client_gone_grace_s,
        help="seconds a client's reply subject must stay without a subscriber before its "
        "requests are aborted; covers a client's reconnect after a broker outage "
        f"(default: {WorkerConfig.client_gone_grace_s:g})",
    )
    nats.add_argument(
        "--outage-wait",
        type=float,
        default=WorkerConfig.outage_wait_s,
        help="seconds a request's frames may wait for the broker and its client to come back "
        f"before the request is aborted (default: {WorkerConfig.outage_wait_s:g})",
    )
    nats.add_argument(
        "--health-interval",
        type=float,
        default=5.0,
        help="seconds between engine health checks; a dead engine exits non-zero (default: 5)",
    )
    nats.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("WORKER_METRICS_PORT"),
        help="serve Prometheus /metrics on this port, 0 = any free port (default: off)",
    )
    nats.add_argument("--metrics-host", default="0.0.0.0", help="metrics bind address")
    nats.add_argument(
        "--mode",
        choices=["core", "jetstream"],
        default="core",
        help="core: a queue group on the core subjects (at most once); jetstream: a durable "
        "work-queue stream on <namespace>.<component>.queue.<endpoint>, pulled by free capacity",
    )
    nats.add_argument(
        "--js-stream", default=None, help="stream name (default: NS_COMPONENT_ENDPOINT)"
    )
    nats.add_argument("--js-durable", default="vllm-workers", help="shared durable consumer name")
    nats.add_argument(
        "--js-ack-wait",
        type=float,
        default=30.0,
        help="seconds without an ack (or in-progress ack) before redelivery (default: 30)",
    )
    nats.add_argument(
        "--js-max-deliver",
        type=int,
        default=3,
        help="delivery attempts before a request is terminated with an error frame (default: 3)",
    )
    nats.add_argument("--js-max-ack-pending", type=int, default=1024, help="(default: 1024)")
    nats.add_argument(
        "--js-max-age",
        type=float,
        default=3600.0,
        help="seconds a queued request may wait before the stream drops it (default: 3600)",
    )
    nats.add_argument(
        "--worker-log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level of the worker's own logs (vLLM's: --log-level / VLLM_LOGGING_LEVEL)",
    )
    AsyncEngineArgs.add_cli_args(parser)
    # Our default model is the tiny demo model (see module doc), not vLLM's hub default.
    parser.set_defaults(model=None)
    return parser


def worker_config(args: argparse.Namespace, nats_url: str) -> WorkerConfig:
    config = WorkerConfig(
        nats=NatsConfig(
            servers=[url.strip() for url in nats_url.split(",") if url.strip()],
            user=args.nats_user,
            password=args.nats_password,
            token=args.nats_token,
            creds_file=args.nats_creds,
            nkeys_seed=args.nats_nkey_seed,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        ),
        subjects=Subjects(args.namespace, args.component, args.endpoint),
        queue_group=args.queue_group,
        max_n=args.max_n,
        max_tokens_limit=args.max_tokens_limit,
        max_request_bytes=args.max_request_bytes,
        liveness_interval_s=args.liveness_interval,
        client_gone_grace_s=args.client_gone_grace,
        outage_wait_s=args.outage_wait,
        max_concurrency=args.max_concurrency or (64 if args.mode == "jetstream" else None),
        drain_timeout_s=args.drain_timeout,
        health_interval_s=args.health_interval,
    )
    if args.instance_id:
        config.instance_id = args.instance_id
    return config


def engine_args(args: argparse.Namespace):  # -> AsyncEngineArgs
    from vllm.engine.arg_utils import AsyncEngineArgs

    if args.model is None:
        from worker.tiny_model import ensure_tiny_model

        args.model = str(ensure_tiny_model())
        log.info("no --model: serving the tiny demo model %s", args.model)
        if args.dtype == "auto":
            args.dtype = "float32"
        if args.max_model_len is None:
            args.max_model_len = 512
        args.enforce_eager = True
    return AsyncEngineArgs.from_cli_args(args)


@dataclass(frozen=True)
class Ready:
    """What a caller of `serve` learns once the worker takes requests."""

    nats_url: str
    subjects: Subjects
    instance_id: str
    metrics_port: int | None


async def serve(
    args: argparse.Namespace,
    *,
    on_ready: Callable[[Ready], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Runs the worker until SIGTERM/SIGINT (exit 0 after draining) or a dead engine (exit 1)."""
    from vllm.platforms import current_platform

    from worker import vllm_fast_merge
    from worker.vllm_engine import VllmEngine

    # Under load vLLM merges each request's pending DELTA outputs; the worker makes that cheap.
    vllm_fast_merge.install()
    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; see README
    stop = stop or asyncio.Event()
    embedded = None
    nats_url = args.nats_url
    if not nats_url:
        embedded = NatsServer().start()
        nats_url = embedded.url
        print(f"embedded nats-server on {nats_url} (connect with NATS_URL={nats_url})", flush=True)
    try:
        config = worker_config(args, nats_url)
        engine = await VllmEngine.start(engine_args(args))
        try:
            return await _run(args, config, engine, on_ready, stop)
        finally:
            engine.shutdown()
    finally:
        if embedded is not None:
            embedded.stop()


async def _run(
    args: argparse.Namespace,
    config: WorkerConfig,
    engine,  # VllmEngine
    on_ready: Callable[[Ready], Awaitable[None]] | None,
    stop: asyncio.Event,
) -> int:
    metrics = WorkerMetrics(REGISTRY)
    metrics_port = None
    if args.metrics_port is not None:
        server, _ = start_http_server(args.metrics_port, args.metrics_host, registry=REGISTRY)
        metrics_port = server.server_port
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, metrics_port)
    nc = await connect(config.nats)
    worker = Worker(engine, nc, config, metrics)
    await worker.start(core_endpoints=args.mode == "core")
    intake = None
    if args.mode == "jetstream":
        from worker.jetstream import JetStreamConfigError, JetStreamIntake, JetStreamSettings

        settings = JetStreamSettings(
            stream=args.js_stream,
            durable=args.js_durable,
            ack_wait_s=args.js_ack_wait,
            max_deliver=args.js_max_deliver,
            max_ack_pending=args.js_max_ack_pending,
            max_age_s=args.js_max_age,
        )
        intake = JetStreamIntake(worker, nc, settings, capacity=config.max_concurrency or 64)
        try:
            await intake.start()
        except JetStreamConfigError as error:
            print(f"vllm-nats-worker: refusing to start: {error}", file=sys.stderr, flush=True)
            await worker.stop()
            await nc.drain()
            return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    health = asyncio.create_task(worker.watch_engine())
    ready = Ready(config.nats.servers[0], config.subjects, config.instance_id, metrics_port)
    serving = config.subjects.queue + " (jetstream)" if intake else config.subjects.generate
    print(
        f"vllm-nats-worker ready: model {engine.limits.model} on {serving} "
        f"(instance {config.instance_id}) via {ready.nats_url}"
        + (f", metrics http://{args.metrics_host}:{metrics_port}/metrics" if metrics_port else ""),
        flush=True,
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
        health.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await nc.drain()


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("worker").setLevel(level.upper())


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.worker_log_level)
    sys.exit(asyncio.run(serve(args)))
