"""The compose file's worker command, parsed by the worker's real parser (vLLM's engine
arguments and the worker's): every flag exists and every value converts, as the container's
`vllm-nats-worker` entrypoint will parse it. (tests/unit/test_compose.py checks the rest of the
deployment without vllm.)"""

from __future__ import annotations

from tests.unit.test_compose import interpolate, services
from worker.cli import build_parser, missing_for_production, worker_config


def test_the_compose_worker_command_parses_with_the_worker_parser(monkeypatch) -> None:
    worker = services()["worker"]
    env = {"NATS_USER": "vllm", "NATS_PASSWORD": "s3cret", **worker["environment"]}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args([interpolate(arg, {}) for arg in worker["command"]])
    assert missing_for_production(args) == []
    assert (args.model, args.served_model_name, args.dtype) == ("/model", ["model"], "auto")
    assert (args.max_logprobs, args.metrics_port) == (20, 9100)
    config = worker_config(args)
    assert config.drain_timeout_s == 30.0
    assert config.nats.servers == ["nats://nats:4222"]
    assert (config.nats.user, config.nats.password) == ("vllm", "s3cret")
