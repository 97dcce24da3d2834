"""Worker configuration: typed, keyword-only dataclasses, the one source of every default.

The CLI (worker/cli.py) takes its defaults from these classes and from `environment()`, the one
place the process environment is read; library code never reads or writes it.
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Final, Literal

from messages.subjects import Subjects

# Environment variable → the CLI option (argparse dest) it gives a default to.
ENVIRONMENT: dict[str, str] = {
    "NATS_URL": "nats_url",
    "NATS_USER": "nats_user",
    "NATS_PASSWORD": "nats_password",
    "NATS_TOKEN": "nats_token",
    "NATS_CREDS": "nats_creds",
    "NATS_NKEY_SEED": "nats_nkey_seed",
    "NATS_TLS_CA": "tls_ca",
    "NATS_TLS_CERT": "tls_cert",
    "NATS_TLS_KEY": "tls_key",
    "WORKER_MAX_CONCURRENCY": "max_concurrency",
    "WORKER_METRICS_PORT": "metrics_port",
    # The frontend's (python -m worker.frontend), named as vLLM's server names them: the API
    # key, and the two switches that open vLLM's admin routes (README "Adapters and the fleet").
    "VLLM_API_KEY": "api_key",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "allow_runtime_lora_updating",
    "VLLM_SERVER_DEV_MODE": "server_dev_mode",
}


def env_flag(value: str | None) -> bool:
    """A switch as vLLM reads its own (`"1"` or `"true"`, any case)."""
    return (value or "").strip().lower() in ("1", "true")


# Read, not mapped to an option: vLLM's own CPU KV-cache size (GiB); when it is unset on a CPU,
# the worker sizes the cache by engine argument instead (worker/engine/args.py).
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


# Written, not read: prometheus-client's multiprocess directory. Processes started after it is
# set (the frontend's --processes N, spawned) write their metrics there, to be summed.
PROMETHEUS_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


# How long the engine core's processes get to exit after the SIGTERM of a shutdown, before vLLM
# kills them. vLLM's own default is 5 s; a busy 2-core host took longer, and a killed EngineCore
# leaves its shared-memory queues behind (a resource_tracker warning after the worker's last line).
ENGINE_EXIT_GRACE_S = 30.0


def share_metrics_with_children(directory: str) -> None:
    os.environ[PROMETHEUS_MULTIPROC_ENV] = directory


def environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's settings found in the environment, by CLI option dest."""
    environ = os.environ if environ is None else environ
    return {dest: environ[name] for name, dest in ENVIRONMENT.items() if environ.get(name)}


def cpu_kv_cache_set(environ: Mapping[str, str] | None = None) -> bool:
    return bool((os.environ if environ is None else environ).get(CPU_KV_CACHE_ENV))


def dev_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the dev tools keep the tiny model: $VLLM_NATS_WORKER_CACHE, else
    $XDG_CACHE_HOME/vllm-nats-worker, else ~/.cache/vllm-nats-worker."""
    environ = os.environ if environ is None else environ
    if environ.get("VLLM_NATS_WORKER_CACHE"):
        return Path(environ["VLLM_NATS_WORKER_CACHE"])
    cache = environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "vllm-nats-worker"


def at_least_one(text: str) -> int:
    """The command-line type of a count that must be >= 1 (worker and frontend processes)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


AUTO: Final = "auto"
ProcessCount = int | Literal["auto"]
"""A count of processes, or "auto": sized from the machine when the command starts."""


def process_count(text: str) -> ProcessCount:
    """The command-line type of `--worker-processes` and the frontend's `--processes`."""
    return AUTO if text == AUTO else at_least_one(text)


def auto_worker_processes(gpu: bool, cores: int, data_parallel: int = 1) -> int:
    """`--worker-processes auto`. On a GPU host, 4 per engine core (data-parallel rank), as
    many as half the cores allow: at 256 streams one process's event loop is the bottleneck
    (vLLM's client-side output path and the worker's frames), four reached the engine's ceiling
    and eight gave no more (README: Worker processes). Without a GPU, 1: the engine's forward
    pass takes the cores, and a process more only competes with it."""
    if not gpu:
        return 1
    return max(1, min(4 * max(1, data_parallel), cores // 2))


def auto_frontend_processes(cores: int) -> int:
    """The frontend's `--processes auto`: one per four cores, at most 4 (tokenizing and SSE
    encoding are one core's work per process; the GPU runs measured 4 at the engine's
    ceiling), and 1 on a small host such as a 2-core CI machine."""
    return max(1, min(4, cores // 4))


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default(cls: type, name: str) -> Any:
    """A config dataclass field's default (what the CLI shows and uses)."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
    raise KeyError(f"{cls.__name__} has no default for {name}")


@dataclass(kw_only=True)
class NatsConfig:
    servers: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    """Server list (a cluster's nodes); nats-py fails over between them."""
    name: str = "vllm-nats-worker"
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    nkeys_seed: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_reconnect_attempts: int = -1
    """-1: keep reconnecting forever (a worker outlives broker restarts)."""
    start_attempts: int = 3
    """Connection attempts per server in the start-up check, before the model loads: a wrong
    URL or credentials end the worker at once with one line (exit 2), not after minutes of
    loading and then in endless reconnects."""
    reconnect_wait_s: float = 0.5


@dataclass(kw_only=True)
class JetStreamSettings:
    """`--mode jetstream` (worker/nats/intake/jetstream.py)."""

    stream: str | None = None
    """Stream name; default `<NAMESPACE>_<COMPONENT>_<ENDPOINT>`."""
    durable: str = "vllm-workers"
    ack_wait_s: float = 30.0
    """Seconds without an ack (or in-progress ack) before redelivery."""
    max_deliver: int = 3
    """Delivery attempts before a request is terminated with an error frame."""
    max_ack_pending: int = 1024
    max_age_s: float = 3600.0
    """Seconds a queued request may wait before the stream drops it."""
    fetch_timeout_s: float = 1.0
    """How long one pull waits for messages; also the delay before a message delivered past a
    busy worker's free slots comes back (a pull request outlives its fetch by at most this)."""
    capacity: int = 64
    """Requests pulled at once (the worker's max_concurrency when set)."""


@dataclass(kw_only=True)
class WorkerConfig:
    nats: NatsConfig = field(default_factory=NatsConfig)
    subjects: Subjects = field(default_factory=Subjects)
    queue_group: str = "vllm-workers"
    """Workers of one group share `subjects.generate`: each message goes to one of them."""
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Also served on `<generate subject>.<instance_id>`, for routing to this worker."""
    engine_id: str | None = None
    """The engine core this process shares with the worker's other `--worker-processes` (the
    worker's own instance id); None: an engine of its own. Load reports carry it, so a router
    knows which instances share one KV cache."""
    max_n: int = 16
    max_concurrency: int | None = None
    """Requests served at once; above it a request gets an immediate retryable `overloaded`
    error frame (so the publisher can retry another worker). None: unlimited."""
    drain_timeout_s: float = 30.0
    """On SIGTERM/SIGINT: how long in-flight requests may still run before they are ended with
    a retryable `worker_shutdown` error frame."""
    heartbeat_interval_s: float = 1.0
    """A request sent nothing for half of this gets a heartbeat at the next beat, so its client
    hears from the worker at least every 1.5 × this (worker/nats/liveness.py) and can take a
    silence of `silence_timeout` (worker.client, 5 s) for a dead worker."""
    liveness_interval_s: float = 2.0
    """How often in-flight requests' clients are probed (an empty NATS request to a reply
    subject, one per client and round; see worker/nats/liveness.py). A "no responders" answer is a
    miss; misses over client_gone_grace_s declare the client gone and abort its requests."""
    liveness_timeout_s: float = 2.0
    """How long a probe waits for its marker to come back from the broker; past it the probe says
    nothing either way (worker/nats/liveness.py: the answer rests on the broker's order, not on
    this timer). A marker comes back whenever the connection is up, so this only bounds a
    worker's event-loop lag: after a reconnect, frames resume once a probe's marker is read
    within it."""
    client_gone_grace_s: float = 6.0
    """A client is declared gone only after its probes missed for this long: it covers a
    client's reconnect after a broker outage (nats-py and nats.go retry every 2 s)."""
    outage_wait_s: float = 60.0
    """How long a request's frames may wait for the broker connection, and after a reconnect for
    the client's resubscription, before the request is aborted (its deadline also ends it)."""
    max_request_bytes: int = 1024 * 1024
    """Larger payloads are refused with invalid_request (the server's max_payload also caps)."""
    max_tokens_limit: int | None = None
    """Operator cap on stop_conditions.max_tokens (None: the model's context length)."""
    health_interval_s: float = 5.0
    """How often the engine's health is checked; a dead engine ends the worker non-zero."""
    log_requests: bool = False
    """One INFO line per finished request (id, finish, tokens, frames, TTFT, total). Set by vLLM's
    own `--enable-log-requests` (off by default, as in `vllm serve`); a request that ended in an
    error is logged either way."""
    kv_events: bool = True
    """KV-aware routing (messages/kv.py): vLLM publishes its prefix-cache events, the worker
    republishes them on NATS, answers snapshots and reports its load every load_interval_s
    (core mode; a JetStream work queue is not routed to an instance)."""
    kv_event_source: bool = True
    """Whether this process republishes its engine's KV events and answers snapshots: of the
    processes of one engine core (`--worker-processes`) only process 0 does, since all would
    read the same events; the others report their load only."""
    load_interval_s: float = 1.0
    jetstream: JetStreamSettings | None = None
    """`--mode jetstream`: requests come from this work queue instead of the core subjects
    (worker/nats/intake/); None: core mode."""
    processes: ProcessCount = AUTO
    """Worker processes over one engine core (worker/engine/scaleout.py), each with its own NATS
    connection in the same queue group; max_concurrency is the whole worker's, split evenly.
    "auto": `auto_worker_processes` when the command starts."""
