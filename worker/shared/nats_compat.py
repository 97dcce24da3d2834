"""The one place the worker touches nats-py's private state, version-gated.

`flush_ordered(nc)`: nats-py's `flush()` writes its PING to the socket at once, ahead of commands
still in its write buffer (the SUBs of subscriptions just made), so its PONG can come back before
the server saw them, and a request published right after goes to nobody: a worker that has just
started would lose the requests a client sends as soon as it is discovered. Writing the buffer
first (`_flush_pending`, whose future resolves after the write) puts the PING behind it. Checked on
nats-py 2.7-2.16 (tests/integration/test_transport.py pins the order on the wire); on another
version the private call is not made and a short pause after the flush stands in for it, with a
warning. Upstream: nats.py2 fixed the same ordering in 2017 (PR #24); not yet reported for nats.py
(no network here).
"""

from __future__ import annotations

import asyncio
import logging
from importlib.metadata import PackageNotFoundError, version

from nats.aio.client import Client as NATS

log = logging.getLogger(__name__)

# [lowest, highest) nats-py release whose Client has `_flush_pending(force_flush=...)`.
SUPPORTED = ((2, 7), (2, 17))


def _release() -> tuple[int, int] | None:
    try:
        parts = version("nats-py").split(".")
        return int(parts[0]), int(parts[1])
    except (PackageNotFoundError, ValueError, IndexError):
        return None


_RELEASE = _release()
_PRIVATE_FLUSH = _RELEASE is not None and SUPPORTED[0] <= _RELEASE < SUPPORTED[1]


async def flush_ordered(nc: NATS, timeout: int = 10) -> None:
    """Returns once the server has processed everything sent on `nc` so far."""
    if _PRIVATE_FLUSH:
        await nc._flush_pending(force_flush=True)
        await nc.flush(timeout)
        return
    log.warning("nats-py %s is not one flush_ordered was checked on: flushing twice", _RELEASE)
    await nc.flush(timeout)
    await asyncio.sleep(0.01)
    await nc.flush(timeout)
