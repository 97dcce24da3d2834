"""The one place the worker touches nats-py's private state, version-gated.

`take_buffered(subscription)`: the messages a JetStream pull subscription holds that no fetch
took, without asking the server for more (see its docstring). Read on nats-py 2.16, whose
`fetch` drains the same buffer the same way; on another version nothing is taken, with a
warning, and such messages wait for the next fetch as before. Not yet reported upstream (no
network here): nats-py's fetch always sends a pull request after draining its buffer, for
`batch` minus what it drained, which the server reads as one message more when that is 0 or less.

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
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

log = logging.getLogger(__name__)

# [lowest, highest) nats-py release this module's private reads were checked on: the Client's
# `_flush_pending(force_flush=...)` (2.7-2.16), a subscription's `_pending_queue` and
# `_pending_size` behind a pull subscription's `_sub` (read on 2.16; unchanged since 2.7).
SUPPORTED = ((2, 7), (2, 17))


def _release() -> tuple[int, int] | None:
    try:
        parts = version("nats-py").split(".")
        return int(parts[0]), int(parts[1])
    except (PackageNotFoundError, ValueError, IndexError):
        return None


_RELEASE = _release()
_CHECKED = _RELEASE is not None and SUPPORTED[0] <= _RELEASE < SUPPORTED[1]


async def flush_ordered(nc: NATS, timeout: int = 10) -> None:
    """Returns once the server has processed everything sent on `nc` so far."""
    if _CHECKED:
        await nc._flush_pending(force_flush=True)
        await nc.flush(timeout)
        return
    log.warning("nats-py %s is not one flush_ordered was checked on: flushing twice", _RELEASE)
    await nc.flush(timeout)
    await asyncio.sleep(0.01)
    await nc.flush(timeout)


_warned_buffer = False


def take_buffered(subscription: JetStreamContext.PullSubscription) -> list[Msg]:
    """What the server delivered to `subscription` beyond any fetch (a pull request that outlived
    its fetch), taken from nats-py's buffer without a pull request: `fetch` would take these
    first and then ask the server for one message more when they fill its batch. Status messages
    (a pull request's end) are dropped, as `fetch` drops them."""
    global _warned_buffer
    if not _CHECKED:
        if subscription.pending_msgs and not _warned_buffer:
            _warned_buffer = True
            log.warning("nats-py %s: buffered JetStream messages left to the next fetch", _RELEASE)
        return []
    sub = subscription._sub
    taken = []
    while not sub._pending_queue.empty():
        msg = sub._pending_queue.get_nowait()
        sub._pending_size -= len(msg.data)
        sub._pending_queue.task_done()
        if not JetStreamContext.is_status_msg(msg):
            taken.append(msg)
    return taken
