"""Client-supplied strings in log lines: escaped, one line, cut (worker.shared.log_text), and
the worker's request path logs a hostile request_id that way."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest

from messages.codec import MSGPACK
from worker.client.requests import make_request
from worker.config import WorkerConfig
from worker.dev.fakes import PacedFakeEngine
from worker.service import Delivery, RequestService
from worker.shared.log_text import MAX_LOGGED, loggable

HOSTILE = "\r\nPUB x 1\r\n\x00evil\u202etxt.exe\u2028\x1b[31m"


def test_loggable_escapes_what_would_forge_or_hide_log_text() -> None:
    assert loggable(HOSTILE) == (
        "\\x0d\\x0aPUB x 1\\x0d\\x0a\\x00evil\\u202etxt.exe\\u2028\\x1b[31m"
    )
    assert loggable("a\\x0d") == "a\\\\x0d"  # a client's own backslash cannot fake an escape
    assert loggable("plain-id 42 é中 😀") == "plain-id 42 é中 😀"
    assert loggable("tag\U000e0001") == "tag\\U000e0001"
    assert loggable(ValueError("bad\nline")) == "bad\\x0aline"


def test_loggable_cuts_long_strings_and_says_how_much() -> None:
    text = "x" * (MAX_LOGGED + 44)
    assert loggable(text) == "x" * MAX_LOGGED + "…(+44 chars)"
    assert loggable("\n" * 3, limit=2) == "\\x0a\\x0a…(+1 chars)"


class _Reply:
    subject = "_INBOX.log-test"

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    async def publish(self, data: bytes) -> None:
        self.frames.append(data)

    def watch(self, on_gone: Callable[[], None]) -> None:
        pass

    def release(self) -> None:
        pass


async def _serve_one(request_id: str, max_tokens: int, config: WorkerConfig) -> None:
    service = RequestService(PacedFakeEngine(step_s=0.0), config, max_payload=1 << 20)
    payload = MSGPACK.encode(make_request(request_id, [1, 2, 3], max_tokens=max_tokens))
    delivery = Delivery(payload, None, _Reply(), "test.subject", time.monotonic_ns())
    admitted = await service.accept(delivery)
    if isinstance(admitted, asyncio.Task):
        await admitted
    else:
        assert admitted == "invalid_request"  # max_tokens 0 is refused


@pytest.mark.parametrize("max_tokens", [2, 0], ids=["served", "refused"])
async def test_a_hostile_request_id_reaches_the_log_as_one_escaped_line(
    caplog: pytest.LogCaptureFixture, max_tokens: int
) -> None:
    caplog.set_level(logging.INFO)
    await _serve_one(HOSTILE, max_tokens, WorkerConfig(log_requests=True))
    lines = [r.getMessage() for r in caplog.records if "PUB x 1" in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    for line in lines:
        assert "\r" not in line and "\n" not in line and "\x00" not in line
        assert "\u202e" not in line and "\x1b" not in line
        assert loggable(HOSTILE) in line


async def test_request_lines_follow_enable_log_requests_and_errors_are_always_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As `vllm serve`: no line per request unless --enable-log-requests (`log_requests`); a
    request that ended in an error is logged either way."""
    caplog.set_level(logging.INFO, logger="worker.service")
    await _serve_one("quiet-1", 2, WorkerConfig())
    await _serve_one("refused-1", 0, WorkerConfig())
    await _serve_one("loud-1", 2, WorkerConfig(log_requests=True))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "quiet-1" not in text
    assert "request refused-1 invalid_request" in text
    assert "request loud-1 length tokens=2 frames=" in text
