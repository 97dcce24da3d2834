"""The engine's logs as the worker shows them: one line format for the worker's and vLLM's lines,
and vLLM's periodic engine stats line (`vllm serve`'s "Engine 000: Avg prompt throughput …").

Log format: the worker's records (and other libraries' warnings, through the root logger) are
formatted by the formatter vLLM's own "vllm" handler has at the time of each record, so both
look alike whatever vLLM was configured with (its text format, colour, JSON, a
VLLM_LOGGING_CONFIG_PATH file). vLLM configures that handler lazily (when the engine starts, in
recent versions), so the formatter is looked up per record; until there is one, or with
VLLM_CONFIGURE_LOGGING=0, `FALLBACK_FORMAT` (vLLM's text format without its process field) is
used. The worker's own level is `--worker-log-level`; vLLM's stays its own (VLLM_LOGGING_LEVEL).

Stats: every VLLM_LOG_STATS_INTERVAL seconds (vLLM's variable, read by vLLM, default 10) the
worker asks the engine to log its stats (`AsyncLLM.do_log_stats`, as vLLM's API server does),
unless `--disable-log-stats` (vLLM's engine argument, which also stops the engine collecting
them). vLLM logs the line at INFO, or at DEBUG while the engine is idle; with more than one
client of an engine core (`--worker-processes N`) vLLM itself disables the line (it warns so).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import IO, TYPE_CHECKING, Any

FALLBACK_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
"""vLLM's date format."""


def _vllm_formatter() -> logging.Formatter | None:
    for handler in logging.getLogger("vllm").handlers:
        if handler.formatter is not None:
            return handler.formatter
    return None


if TYPE_CHECKING:
    _StreamHandler = logging.StreamHandler[IO[str]]
else:  # subscriptable at run time only from Python 3.11 on
    _StreamHandler = logging.StreamHandler


class VllmFormatHandler(_StreamHandler):
    """A stream handler that formats as vLLM's handler does now (see the module's doc). Each
    line is one write (StreamHandler writes message and terminator together), so lines of
    processes sharing a pipe stay whole."""

    def __init__(self, stream: IO[str]) -> None:
        super().__init__(stream)
        self.fallback = logging.Formatter(FALLBACK_FORMAT, DATE_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        formatter = _vllm_formatter()
        if formatter is not None:
            try:
                return formatter.format(record)
            except (KeyError, ValueError, AttributeError):
                # A record made before vLLM installed the record factory its format needs.
                pass
        return self.fallback.format(record)


def _vllm_stream() -> IO[str]:
    """Where vLLM writes its lines (VLLM_LOGGING_STREAM, stdout by default)."""
    from vllm import envs

    return (
        sys.stderr if getattr(envs, "VLLM_LOGGING_STREAM", "") == "ext://sys.stderr" else sys.stdout
    )


def configure(worker_level: str) -> None:
    """The process's logging: the root logger (the worker's records and other libraries'
    warnings) through a VllmFormatHandler on vLLM's stream; the "worker" logger at
    `worker_level`."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(VllmFormatHandler(_vllm_stream()))
    root.setLevel(logging.WARNING)
    logging.getLogger("worker").setLevel(worker_level.upper())


def stats_interval_s() -> float:
    """VLLM_LOG_STATS_INTERVAL, as vLLM reads it."""
    from vllm import envs

    return float(envs.VLLM_LOG_STATS_INTERVAL)


async def log_stats_every(engine: Any, interval_s: float) -> None:
    """Asks `engine` (a VllmEngine) to log its stats line every `interval_s`, until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await engine.log_stats()
