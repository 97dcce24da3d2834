"""The options of `vllm-nats-worker` / `python -m worker` and the configuration they make (the
command itself is worker/process.py): vLLM's own engine arguments plus the NATS worker's.

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
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from messages.subjects import EMBED_ENDPOINT, Subjects
from worker.config import (
    AUTO,
    ENVIRONMENT,
    JetStreamSettings,
    WorkerConfig,
    auto_worker_processes,
    cores,
    default,
    environment,
    process_count,
)
from worker.engine import args as engine_cli
from worker.engine import placement
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
    Option(
        "--endpoint",
        None,
        "endpoint",
        "third subject token (default: generate; embed for a pooling model, started with "
        "--runner pooling or --convert embed)",
    ),
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
        "connection in the queue group (vLLM's front-end scale-out, vLLM 0.24 and 0.32+; "
        "as vllm serve's --api-server-count); auto: 4 per engine core on a GPU host (as many "
        "as half the cores allow), 1 without a GPU (README: Worker processes)",
        process_count,
    ),
    Option(
        "--engine-core-cpus",
        None,
        "engine_core_cpus",
        "CPUs for vLLM's engine core alone (a list: 0-3, 0,8), the worker's own processes on "
        "the rest of its CPUs; for a GPU host at high concurrency, where the engine core's one "
        "thread is the bound (default: no placement; README: Worker processes)",
        placement.cpu_list,
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
        "--heartbeat-interval",
        WorkerConfig,
        "heartbeat_interval_s",
        "a request sent nothing for half of this many seconds gets an empty heartbeat message, "
        "so its client can tell a dead worker from a slow one",
        float,
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
        subjects=Subjects(**_fields(args, Subjects), endpoint=endpoint_of(args)),
        **settings,
    )
    if args.instance_id:
        config.instance_id = args.instance_id
    config.engine_id = getattr(args, "engine_id", None)  # set in a --worker-processes child
    config.kv_event_source = getattr(args, "client_index", 0) == 0
    config.log_requests = bool(getattr(args, "enable_log_requests", False))  # vLLM's flag
    if args.mode == "jetstream":
        config.jetstream = jetstream_settings(args, config)
    return config


def resolve_worker_processes(args: argparse.Namespace) -> int:
    """`--worker-processes`, "auto" sized from the machine (worker.config.auto_worker_processes:
    the platform vLLM detects, the cores, the engine's data-parallel size)."""
    if args.worker_processes != AUTO:
        return int(args.worker_processes)
    gpu = engine_cli.on_gpu()
    return auto_worker_processes(gpu, cores(), getattr(args, "data_parallel_size", 1) or 1)


def pooling(args: argparse.Namespace) -> bool:
    """Whether vLLM's engine flags make the model a pooling model that embeds."""
    return getattr(args, "runner", None) == "pooling" or getattr(args, "convert", None) == "embed"


def endpoint_of(args: argparse.Namespace) -> str:
    """--endpoint, else the endpoint of what the model serves (generate, or embed)."""
    if args.endpoint:
        return str(args.endpoint)
    return EMBED_ENDPOINT if pooling(args) else str(default(Subjects, "endpoint"))


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
