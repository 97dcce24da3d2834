"""vLLM's own engine arguments, as `vllm serve` takes them, and the engine arguments the worker
derives from them. The CLI's only door to vLLM (no other module outside worker/engine imports
vllm).
"""

from __future__ import annotations

import argparse
import logging
import textwrap
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


ENGINE_HELP = (
    "Every engine argument of `vllm serve`, in vLLM's groups: {groups}. --help=all shows them "
    "all, --help=<group> one group (e.g. --help=ModelConfig), --help=<word> the flags whose "
    "name contains <word>."
)


def parser(
    prog: str, description: str, usage: str, own_groups: tuple[str, ...]
) -> argparse.ArgumentParser:
    """vLLM's FlexibleArgumentParser (what `vllm serve` parses with), before vLLM's engine
    arguments are added (`add_engine_args`). `own_groups`: the titles of the caller's argument
    groups, which --help shows first and in full; vLLM's ~250 engine flags are behind vLLM's
    own `--help=<group>` / `--help=all` (where this vLLM has them: 0.32 does; otherwise --help
    prints everything, the caller's groups first). `usage`: a short usage line in place of
    argparse's list of every flag."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser

    searchable = hasattr(FlexibleArgumentParser, "_search_keyword")

    class WorkerArgumentParser(FlexibleArgumentParser):  # type: ignore[misc]  # vLLM: untyped
        def format_help(self) -> str:
            if not searchable or getattr(self, "_search_keyword", None) is not None:
                return str(super().format_help())
            formatter = self._get_formatter()
            formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
            formatter.add_text(self.description)
            engine_groups = []
            for group in self._action_groups:
                if group.title in own_groups:
                    formatter.start_section(group.title)
                    formatter.add_text(group.description)
                    formatter.add_arguments(group._group_actions)
                    formatter.end_section()
                elif group._group_actions and group.title:
                    engine_groups.append(group.title)
            formatter.start_section("vLLM engine arguments")
            # vLLM's formatter prints text as given (RawDescriptionHelpFormatter): wrap it here.
            text = ENGINE_HELP.format(groups=", ".join(engine_groups))
            formatter.add_text(textwrap.fill(text, 78, initial_indent="", subsequent_indent=""))
            formatter.end_section()
            return str(formatter.format_help())

    result = WorkerArgumentParser(prog=prog, description=description, usage=usage)
    result.formatter_class = explicit_defaults(result.formatter_class)
    return result


def explicit_defaults(base: type[argparse.HelpFormatter]) -> type[argparse.HelpFormatter]:
    """`base` (vLLM's formatter appends "(default: …)" to every flag's help), except that a help
    text stating its default itself ("(default: …)": the worker's, which show a config's
    default in its own words) is left as it is: each default shown once."""

    class ExplicitDefaults(base):  # type: ignore[valid-type, misc]
        def _get_help_string(self, action: argparse.Action) -> str | None:
            if action.help and "(default:" in action.help:
                return action.help
            help_string: str | None = super()._get_help_string(action)
            return help_string

    return ExplicitDefaults


def add_engine_args(parser: argparse.ArgumentParser, own_groups: tuple[str, ...]) -> None:
    """vLLM's engine arguments; then the `own_groups` are put first again (vLLM adds its
    ungrouped flags, e.g. --disable-log-stats, to argparse's first group, "options"), so that
    --help=all lists them first too."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    AsyncEngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)  # required by the worker's CLI, not vLLM's hub default
    # `vllm serve`'s --lora-modules is a front-end flag, not an engine argument: taken here with
    # vLLM's own parser action (name=path, or JSON with base_model_name).
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action=_lora_parser_action(),
        default=None,
        help="LoRA adapters loaded at start, as in `vllm serve`: name=path or JSON "
        '{"name": ..., "path": ...}; a request names one in its `model` (needs --enable-lora)',
    )
    # argparse prints groups in this list's order (a stable sort keeps vLLM's own order).
    parser._action_groups.sort(key=lambda group: group.title not in own_groups)


def _lora_parser_action() -> type[argparse.Action]:
    """vLLM's LoRAParserAction, which moved between the releases this worker runs on."""
    try:
        from vllm.entrypoints.launchers.cli_args import LoRAParserAction  # vLLM 0.32+
    except ImportError:
        from vllm.entrypoints.openai.cli_args import LoRAParserAction  # type: ignore[no-redef,import-not-found,unused-ignore]
    return LoRAParserAction  # type: ignore[no-any-return]


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


def usage_context() -> Any:
    """The usage context every engine of the worker is configured under (one process or a shared
    engine core): `vllm serve`'s, whose batch defaults by device (`max_num_seqs`,
    `max_num_batched_tokens`: 1024 and 8192 on an H100) a vLLM user expects. AsyncLLM's own
    default context has none, so an engine started under it falls back to 128 sequences and
    2048 batched tokens on any GPU: at 256 streams half the requests waited a whole request
    for a slot."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER


def on_gpu() -> bool:
    """Whether vLLM runs on a GPU here (its detected platform: CUDA or ROCm)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def vllm_version() -> str:
    from vllm import __version__

    return str(__version__)
