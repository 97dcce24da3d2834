"""`python -m worker.frontend --nats-url URL [--model PATH [--subject S]] [--port P]
[--processes N] [--api-key KEY]`: the options (defaults from worker/frontend/settings.py) and
one process's server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
import tempfile

from worker.client.router import ROUTING_MODES
from worker.config import (
    AUTO,
    auto_frontend_processes,
    cores,
    default,
    env_flag,
    environment,
    process_count,
    share_metrics_with_children,
)
from worker.frontend.settings import FrontendSettings
from worker.shared.nats_options import LOCAL_URL, add_nats_arguments, nats_config


def _default(name: str) -> object:
    return default(FrontendSettings, name)


def _add_migration_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--migration-limit",
        type=int,
        default=_default("migration_limit"),
        help="times one request may continue on another worker when the one serving it dies "
        "or drains; 0 turns migration off (default: %(default)s)",
    )
    parser.add_argument(
        "--silence-timeout",
        type=float,
        default=_default("silence_timeout_s"),
        help="seconds without a frame or heartbeat before the worker serving a request is "
        "taken for dead (default: %(default)s)",
    )


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model started with (optional) and where its workers are."""
    parser.add_argument(
        "--model",
        help="a model served on --subject, its tokenizer loaded from this directory at start "
        "(default: none; every model the workers announce is served either way, its tokenizer "
        "found where its workers say: README, Several models behind one frontend)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        help="the names clients may send as `model`, each accepted and listed by /v1/models; a "
        "request without `model` gets the first (default: --model)",
    )
    parser.add_argument(
        "--subject", default=_default("subject"), help="the generate subject (default: %(default)s)"
    )
    parser.add_argument(
        "--jetstream",
        action="store_true",
        help="publish requests to the JetStream work queue of --subject's workers (workers in "
        "--mode jetstream) instead of the core subject",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m worker.frontend",
        description="OpenAI-compatible HTTP frontend for vLLM NATS workers.",
    )
    add_nats_arguments(parser, url_default=LOCAL_URL)
    _add_model_arguments(parser)
    parser.add_argument(
        "--host",
        default=_default("host"),
        help="bind address (default: %(default)s, all interfaces, as vllm serve; 127.0.0.1: "
        "this host only)",
    )
    parser.add_argument("--port", type=int, default=_default("port"), help="(default: %(default)s)")
    parser.add_argument(
        "--api-key",
        default=environment().get("api_key"),
        help="require `Authorization: Bearer KEY` on /v1/* (401 without) [env VLLM_API_KEY]",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=_default("timeout_s"),
        help="seconds to wait per frame (default: %(default)s)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=_default("retries"),
        help="retries of a refused request on other workers (default: %(default)s)",
    )
    _add_migration_arguments(parser)
    parser.add_argument(
        "--router",
        choices=ROUTING_MODES,
        default=_default("router"),
        help="kv: to the worker holding the longest cached prefix of the prompt, weighed "
        "against load (workers' --kv-events); least-busy; queue: the queue group "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--router-load-weight",
        type=float,
        default=_default("load_weight"),
        help="kv routing: cached blocks one more in-flight request on a worker is worth "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--processes",
        type=process_count,
        default=_default("processes"),
        help="frontend processes on the port, each with its own event loop, tokenizers and NATS "
        "connection (worker/frontend/processes.py); auto: one per 4 cores, at most 4 "
        "(default: %(default)s)",
    )
    _add_parser_arguments(parser)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.served_model_name and not args.model:
        parser.error("--served-model-name names --model's model: give --model too")
    return args


def _add_parser_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's output parser flags, as `vllm serve` names them."""
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool_choice auto (the default with tools): tool calls parsed from the "
        "answer by --tool-call-parser, as vllm serve (needs vllm installed)",
    )
    parser.add_argument(
        "--tool-call-parser",
        help="vLLM's tool-call parser by name (e.g. hermes): required and named tool choices, "
        "and auto with --enable-auto-tool-choice",
    )
    parser.add_argument(
        "--reasoning-parser",
        help="vLLM's reasoning parser by name: the answer's reasoning in `reasoning`",
    )


def settings_of(args: argparse.Namespace) -> FrontendSettings:
    return FrontendSettings(
        model_names=tuple(args.served_model_name or ([args.model] if args.model else [])),
        model_path=args.model or "",
        subject=args.subject,
        timeout_s=args.timeout,
        retries=args.retries,
        migration_limit=args.migration_limit,
        silence_timeout_s=args.silence_timeout,
        jetstream=args.jetstream,
        router=args.router,
        load_weight=args.router_load_weight,
        api_key=args.api_key or None,
        host=args.host,
        port=args.port,
        processes=args.processes,
        metrics_dir=getattr(args, "metrics_dir", None),
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        reasoning_parser=args.reasoning_parser,
        allow_runtime_lora_updating=env_flag(environment().get("allow_runtime_lora_updating")),
        server_dev_mode=env_flag(environment().get("server_dev_mode")),
    )


def serve(args: argparse.Namespace, sock: socket.socket | None = None) -> None:
    """One frontend process: the app on uvicorn, on `sock` (a listening socket) or host:port."""
    import uvicorn
    from nats.aio.client import Client as NATS

    from worker.frontend.app import create_app
    from worker.frontend.tokenizer import ModelTokenizer
    from worker.shared.gc_heap import freeze_startup_heap
    from worker.shared.nats_connection import connect as nats_connect

    settings = settings_of(args)

    async def connect() -> NATS:
        return await nats_connect(nats_config(args, name="vllm-nats-frontend"))

    tokenizer = ModelTokenizer.load(args.model) if args.model else None
    app = create_app(settings, tokenizer, connect=connect)
    freeze_startup_heap()  # the imports, the tokenizer and the app: all of start-up but a socket
    if sock is None:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        return
    # log_config=None: uvicorn's records go through the process's own format (which names it).
    config = uvicorn.Config(app, log_level=args.log_level, log_config=None)
    uvicorn.Server(config).run(sockets=[sock])


async def _check_nats(args: argparse.Namespace) -> str | None:
    """A wrong URL or credentials: one line before serving, not endless reconnects behind 503s."""
    from worker.shared.nats_connection import ConnectFailed, connect

    try:
        config = nats_config(args)
        nc = await connect(config, attempts=config.start_attempts)
    except ConnectFailed as error:
        return str(error)
    await nc.close()
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if refusal := asyncio.run(_check_nats(args)):
        print(f"frontend: {refusal}", file=sys.stderr, flush=True)
        sys.exit(2)
    if args.processes == AUTO:
        args.processes = auto_frontend_processes(cores())
        logging.info("--processes auto: %d", args.processes)
    if args.processes == 1:
        serve(args)
        return
    from worker.frontend import processes

    # The processes' metrics are summed through files in one directory (prometheus-client's
    # multiprocess mode); each process is spawned after this, so each writes there.
    with tempfile.TemporaryDirectory(prefix="vllm-nats-frontend-metrics-") as metrics_dir:
        share_metrics_with_children(metrics_dir)
        args.metrics_dir = metrics_dir
        code = processes.run(args, args.processes, serve)
    sys.exit(code)
