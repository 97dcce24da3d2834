"""The frontend's settings: every default of `python -m worker.frontend` is decided here (its
command line shows and uses these; the API key's environment variable is read where the
project reads the environment, worker.config.environment)."""

from __future__ import annotations

from dataclasses import dataclass

from messages.subjects import Subjects
from worker.client.migration import MIGRATION_LIMIT, SILENCE_TIMEOUT_S
from worker.client.router import RoutingMode
from worker.config import AUTO, ProcessCount


@dataclass(frozen=True, kw_only=True)
class FrontendSettings:
    model_names: tuple[str, ...] = ()
    """The names clients may send as `model` for the configured model (`--served-model-name`,
    several allowed; default the `--model` path, as vLLM's). Each is accepted and echoed in the
    response; a request without `model` is served as the first (vLLM's rule). Empty (no
    `--model`): only the models the workers announce are served (worker/frontend/catalog.py)."""
    model_path: str = ""
    """The tokenizer's directory (`--model`): `/v1/models`' `root`."""
    subject: str = Subjects().generate
    timeout_s: float = 60.0
    """Longest wait for the next frame."""
    retries: int = 2
    """Further attempts on other workers after a retryable refusal (overloaded, shutdown)."""
    migration_limit: int = MIGRATION_LIMIT
    """Continuations of one request on another worker when the one serving it is lost or
    drained (worker/client/migration.py); 0: none."""
    silence_timeout_s: float = SILENCE_TIMEOUT_S
    """Seconds without any message from the worker serving a request (frames and its
    heartbeats) before that worker is taken for lost."""
    jetstream: bool = False
    """Publish to the subject's JetStream work queue (workers in `--mode jetstream`)."""
    router: RoutingMode = "kv"
    """How a request picks its worker (worker/client/router.py): "kv", the worker holding the
    longest cached prefix of its prompt weighed against load; "least-busy"; "queue", the queue
    group. With nothing known of the workers (none reports yet, or all draining or full) every
    mode sends to the queue group. JetStream mode always queues."""
    load_weight: float = 1.0
    """"kv" routing: cached blocks one more in-flight request is worth."""
    api_key: str | None = None
    """When set, every `/v1/*` request needs `Authorization: Bearer <api_key>` (else 401); the
    other routes (`/health`, `/metrics`, `/version`, `/tokenize`, `/detokenize`) stay open, as in
    vLLM's server."""
    host: str = "0.0.0.0"
    """All interfaces, as `vllm serve`: the frontend is a network service (a container's port);
    use `--host 127.0.0.1` (or `--api-key`) where the network is not trusted."""
    port: int = 8000
    processes: ProcessCount = AUTO
    """Frontend processes on the port (worker/frontend/processes.py); "auto":
    `worker.config.auto_frontend_processes` when the command starts."""
    metrics_dir: str | None = None
    """prometheus-client's multiprocess directory when several processes serve (set by the
    command line); `/metrics` then sums every process's metrics. None: this process's own."""
    health_timeout_s: float = 1.0
    """`/health`: how long to wait for a worker of the subject to answer discovery."""
    discovery_window_s: float = 0.25
    """How long one discovery round waits for the workers' answers."""
    discovery_refresh_s: float = 2.0
    """How often the models the workers serve are learnt again (worker/frontend/catalog.py)."""
    tool_call_parser: str | None = None
    """vLLM's tool-call parser by name (`--tool-call-parser`, e.g. `hermes`): tool calls are
    parsed from the answers of requests with tools; `required` and named tool choices need it
    (as in vLLM). Needs vllm installed (worker/frontend/vllm_parsers.py)."""
    enable_auto_tool_choice: bool = False
    """`--enable-auto-tool-choice`: `tool_choice: auto` (the default with tools) is served."""
    allow_runtime_lora_updating: bool = False
    """VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM's server: `/v1/load_lora_adapter` and
    `/v1/unload_lora_adapter` exist only when it is set (else 404)."""
    server_dev_mode: bool = False
    """VLLM_SERVER_DEV_MODE, as in vLLM's server: `/reset_prefix_cache`, `/sleep`, `/wake_up`
    and `/is_sleeping` exist only when it is set (else 404)."""
    reasoning_parser: str | None = None
    """vLLM's reasoning parser by name (`--reasoning-parser`): the answer's reasoning is split
    into the message's `reasoning` field. Needs vllm installed."""
