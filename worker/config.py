"""Worker configuration: one typed, keyword-only dataclass; NATS settings default from env."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

from messages.subjects import Subjects


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


@dataclass(kw_only=True)
class NatsConfig:
    servers: list[str] = field(
        default_factory=lambda: (_env("NATS_URL") or "nats://127.0.0.1:4222").split(",")
    )
    """Server list (a cluster's nodes); nats-py fails over between them."""
    name: str = "vllm-nats-worker"
    user: str | None = field(default_factory=lambda: _env("NATS_USER"))
    password: str | None = field(default_factory=lambda: _env("NATS_PASSWORD"))
    token: str | None = field(default_factory=lambda: _env("NATS_TOKEN"))
    creds_file: str | None = field(default_factory=lambda: _env("NATS_CREDS"))
    nkeys_seed: str | None = field(default_factory=lambda: _env("NATS_NKEY_SEED"))
    tls_ca: str | None = field(default_factory=lambda: _env("NATS_TLS_CA"))
    tls_cert: str | None = field(default_factory=lambda: _env("NATS_TLS_CERT"))
    tls_key: str | None = field(default_factory=lambda: _env("NATS_TLS_KEY"))
    max_reconnect_attempts: int = -1
    """-1: keep reconnecting forever (a worker outlives broker restarts)."""
    reconnect_wait_s: float = 0.5


@dataclass(kw_only=True)
class WorkerConfig:
    nats: NatsConfig = field(default_factory=NatsConfig)
    subjects: Subjects = field(default_factory=Subjects)
    queue_group: str = "vllm-workers"
    """Workers of one group share `subjects.generate`: each message goes to one of them."""
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Also served on `<generate subject>.<instance_id>`, for routing to this worker."""
    max_n: int = 16
    max_concurrency: int | None = None
    """Requests served at once; above it a request gets an immediate retryable `overloaded`
    error frame (so the publisher can retry another worker). None: unlimited."""
    drain_timeout_s: float = 30.0
    """On SIGTERM/SIGINT: how long in-flight requests may still run before they are ended with
    a retryable `worker_shutdown` error frame."""
    liveness_interval_s: float = 2.0
    """How often in-flight requests' clients are probed (an empty NATS request to a reply
    subject, one per client and round; see worker/liveness.py). A "no responders" answer is a
    miss; misses over client_gone_grace_s declare the client gone and abort its requests."""
    liveness_timeout_s: float = 0.5
    """How long a probe waits for "no responders" before it counts the subscriber as there."""
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
