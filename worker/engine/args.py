"""vLLM's own engine arguments, as `vllm serve` takes them, and the engine arguments the worker
derives from them. The CLI's only door to vLLM (no other module outside worker/engine imports
vllm).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from worker.config import cpu_kv_cache_set

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30
"""On a CPU, the KV cache vLLM gets unless VLLM_CPU_KVCACHE_SPACE or --kv-cache-memory-bytes
says otherwise: vLLM's CPU default refuses to start on machines whose NUMA node 0 reports
little free memory."""

# The tiny model's settings in --dev mode (fp32 for exact logprob comparisons, eager: fast start).
DEV_MODEL_ARGS: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True}


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """vLLM's FlexibleArgumentParser (what `vllm serve` parses with), before vLLM's engine
    arguments are added (`add_engine_args`), so the worker's own groups come first in --help."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser
    return FlexibleArgumentParser(prog=prog, description=description)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    AsyncEngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)  # required by the worker's CLI, not vLLM's hub default


def engine_args(args: argparse.Namespace, *, dev_model: Path | None = None) -> Any:
    """AsyncEngineArgs from the parsed CLI; `dev_model` (--dev) fills in the tiny model and its
    settings where the command line gave none."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    if dev_model is not None and args.model is None:
        args.model = str(dev_model)
        if args.dtype == "auto":
            args.dtype = DEV_MODEL_ARGS["dtype"]
        if args.max_model_len is None:
            args.max_model_len = DEV_MODEL_ARGS["max_model_len"]
        args.enforce_eager = DEV_MODEL_ARGS["enforce_eager"]
    engine = AsyncEngineArgs.from_cli_args(args)
    if current_platform.is_cpu() and engine.kv_cache_memory_bytes is None:
        if not cpu_kv_cache_set():
            engine.kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
    return engine


def tiny_engine_args(model: Path, **overrides: object) -> Any:
    """Engine arguments for the tiny dev model (tests, benchmarks): the --dev settings, seeded."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    settings: dict[str, object] = dict(
        model=str(model),
        max_logprobs=20,
        seed=0,
        kv_cache_memory_bytes=CPU_KV_CACHE_BYTES,
        **DEV_MODEL_ARGS,
    )
    settings.update(overrides)
    return AsyncEngineArgs(**settings)


def vllm_version() -> str:
    from vllm import __version__

    return str(__version__)
