"""`python -m worker.frontend --nats-url URL --model PATH [--subject S] [--port P]
[--processes N]`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys

from messages.subjects import Subjects
from worker.config import at_least_one
from worker.nats.options import LOCAL_URL, add_nats_arguments, nats_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m worker.frontend",
        description="OpenAI-compatible HTTP frontend for vLLM NATS workers.",
    )
    add_nats_arguments(parser, url_default=LOCAL_URL)
    parser.add_argument(
        "--model", required=True, help="the model's directory (its tokenizer is loaded)"
    )
    parser.add_argument(
        "--served-model-name", help="the name clients send as `model` (default: --model)"
    )
    parser.add_argument("--subject", default=Subjects().generate, help="the generate subject")
    parser.add_argument(
        "--jetstream",
        action="store_true",
        help="publish requests to the JetStream work queue of --subject's workers (workers in "
        "--mode jetstream) instead of the core subject",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait per frame")
    parser.add_argument(
        "--retries", type=int, default=2, help="retries of a refused request on other workers"
    )
    parser.add_argument(
        "--processes",
        type=at_least_one,
        default=1,
        help="frontend processes on the port, each with its own event loop, tokenizer and NATS "
        "connection (worker/frontend/processes.py); default 1",
    )
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def serve(args: argparse.Namespace, sock: socket.socket | None = None) -> None:
    """One frontend process: the app on uvicorn, on `sock` (a listening socket) or host:port."""
    import uvicorn
    from nats.aio.client import Client as NATS

    from worker.frontend.app import FrontendSettings, create_app
    from worker.frontend.tokenizer import ModelTokenizer
    from worker.nats.connection import connect as nats_connect

    settings = FrontendSettings(
        model_name=args.served_model_name or args.model,
        subject=args.subject,
        timeout_s=args.timeout,
        retries=args.retries,
        jetstream=args.jetstream,
    )

    async def connect() -> NATS:
        return await nats_connect(nats_config(args, name="vllm-nats-frontend"))

    app = create_app(settings, ModelTokenizer.load(args.model), connect=connect)
    if sock is None:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        return
    # log_config=None: uvicorn's records go through the process's own format (which names it).
    config = uvicorn.Config(app, log_level=args.log_level, log_config=None)
    uvicorn.Server(config).run(sockets=[sock])


async def _check_nats(args: argparse.Namespace) -> str | None:
    """A wrong URL or credentials: one line before serving, not endless reconnects behind 503s."""
    from worker.nats.connection import ConnectFailed, connect

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
    if args.processes == 1:
        serve(args)
        return
    from worker.frontend import processes

    sys.exit(processes.run(args, args.processes, serve))
