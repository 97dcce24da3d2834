"""Who still listens on a request's reply subject, and publishing that waits for them.

Core NATS drops a message published to a subject nobody is subscribed to, and a connection that
is down cannot publish at all. Both happen in a broker outage: the worker's connection is down,
then it is back while its clients (on their own reconnect timers) have not resubscribed yet.
This module keeps a request's frames from being lost or its request from being aborted in that
window, and finds clients that are really gone.

Invariants:
- a frame is published only while the connection is up and, since the connection's last
  reconnect, a probe showed the reply subject has a subscriber again (the request's arrival
  counts as such a showing). Otherwise the publisher waits (the engine keeps its tokens meanwhile),
  up to `outage_wait_s`; frames never pile up in nats-py's reconnect buffer, whose overflow
  would fail the request;
- a request is declared gone (and aborted as `client_gone`) only after probes of its own reply
  subject missed ("no responders") at least twice, `grace_s` or more apart, with no probe in
  between finding it. A client reconnecting within `grace_s` is never declared gone;
- steady-state probing costs one NATS request per client per interval, not one per request:
  requests are grouped by client (their reply subject's inbox prefix, see `client_key`), each
  round probes one request of each client, in turn, and only a miss makes every request of that
  client probed on its own until none misses. So a crashed client is found in one round plus the
  grace, and one abandoned stream of a live client (which the client library would have
  cancelled) within as many rounds as that client has requests.

Heartbeats: a request that was sent nothing (no frame, no heartbeat) for `heartbeat_s` / 2 gets
an empty message marked `PROBE_HEADER: heartbeat` at the next beat, every `heartbeat_s`. So a
client hears from a live worker at least every 1.5 × `heartbeat_s`, through a long prefill, a
queue wait or a slow engine step alike (the beat runs on the worker's event loop, not the
engine's), and takes a longer silence for a dead worker (worker.client: `silence_timeout`).

A probe is an empty-body NATS request to the reply subject, marked by the `PROBE_HEADER`
header, and a marker message the worker then sends to the probe's own inbox: "no responders"
means nobody is subscribed; a live client receives the marked message (readers skip it:
worker.client.reader.is_probe) and does not answer. The broker handles one connection's messages
in order and sends its "no responders" status for the probe before it delivers the marker, so a
marker with no such status before it is the positive answer. The answer rests on that order, not
on a timer: a worker whose event loop is late reading its socket cannot take a "no responders" it
has not read yet for a listener (it would then publish a client's frames to nobody). nats-py's
`flush()` cannot stand in for the marker: it writes its PING ahead of the commands still pending.

`NatsReply` is the service core's `Reply` (worker/service.py) over this.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
from nats.aio.client import NO_RESPONDERS_STATUS
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import Header

from messages.subjects import PROBE_HEADER
from worker.framing import Undeliverable
from worker.shared.log_text import loggable

log = logging.getLogger(__name__)

# NUIDs, which NATS clients (nats-py, nats.go, nats.java, nats.js) use for their inboxes: 22
# characters, the first 12 a per-connection prefix and the last 10 a sequence.
_NUID_LENGTH = 22
_NUID_PREFIX_LENGTH = 12
_PROBE_HEADERS = {PROBE_HEADER: "liveness"}
_HEARTBEAT_HEADERS = {PROBE_HEADER: "heartbeat"}


def client_key(reply: str) -> str:
    """The part of a reply subject that names the client connection it belongs to.

    `_INBOX.<nuid>` (a client's `new_inbox()`) → `_INBOX.<first 12 characters of the nuid>`;
    `<prefix>.<token>` with more tokens before it (a request mux, a custom inbox prefix) → the
    subject without its last token; anything else → the subject itself (one probe per request).
    """
    head, _, last = reply.rpartition(".")
    if not head:
        return reply
    if "." in head:
        return head
    if len(last) == _NUID_LENGTH:
        return f"{head}.{last[:_NUID_PREFIX_LENGTH]}"
    return reply


def _no_responders(msg: Msg) -> bool:
    """The broker's "no responders" status message, checked as nats-py's own `request` does."""
    return msg.headers is not None and msg.headers.get(Header.STATUS) == NO_RESPONDERS_STATUS


class ClientGone(Undeliverable):
    """The request's client was declared gone: its frames have nobody to go to."""


class OutageTooLong(Undeliverable):
    """The connection (or the request's client) stayed away longer than `outage_wait_s`."""


@dataclass(eq=False)
class Listener:
    """One request's reply subject and what the probes learned about it."""

    reply: str
    key: str
    epoch: int
    """The connection's reconnect count when a subscriber was last shown to be there."""
    on_gone: Callable[[], None] | None = None
    last_sent: float = field(default_factory=time.monotonic)
    """When a frame or heartbeat last went to it (time.monotonic)."""
    first_miss: float | None = None
    gone: bool = False
    _probe: asyncio.Task[bool | None] | None = field(default=None, repr=False)


@dataclass
class _Client:
    listeners: dict[int, Listener] = field(default_factory=dict)
    """By id(): O(1) release however many requests one client has in flight."""
    turn: itertools.count[int] = field(default_factory=itertools.count)
    suspect: bool = False
    """A probe of this client missed: probe each of its requests until none misses."""


class Liveness:
    """Probes the reply subjects of in-flight requests and gates publishing to them."""

    def __init__(
        self,
        nc: NATS,
        *,
        interval_s: float,
        probe_timeout_s: float,
        grace_s: float,
        outage_wait_s: float,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.nc = nc
        self.heartbeat_s = heartbeat_s
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.grace_s = grace_s
        self.outage_wait_s = outage_wait_s
        self._clients: dict[str, _Client] = {}
        self.probes_sent = 0
        """NATS requests sent as probes so far (what the probing costs the broker)."""

    def _epoch(self) -> int:
        return self.nc.stats["reconnects"]

    def listener(self, reply: str) -> Listener:
        """A listener for a reply subject that just showed a subscriber (a request came in)."""
        return Listener(reply, client_key(reply), self._epoch())

    def track(self, listener: Listener, on_gone: Callable[[], None]) -> None:
        """Probes `listener` until `untrack`; `on_gone` runs once if its client is declared gone."""
        listener.on_gone = on_gone
        self._clients.setdefault(listener.key, _Client()).listeners[id(listener)] = listener

    def untrack(self, listener: Listener) -> None:
        client = self._clients.get(listener.key)
        if client is None:
            return
        client.listeners.pop(id(listener), None)
        if not client.listeners:
            del self._clients[listener.key]
        if listener._probe is not None:
            listener._probe.cancel()

    @property
    def clients(self) -> int:
        return len(self._clients)

    async def publish(self, listener: Listener, data: bytes) -> None:
        """Publishes one frame to the listener's reply subject, waiting out an outage first."""
        nc = self.nc
        if not (nc.is_connected and listener.epoch == self._epoch()):
            await self._wait_until_listened(listener)
        try:
            await nc.publish(listener.reply, data)
        except nats.errors.OutboundBufferLimitError:
            # Disconnected between the check and the publish: wait for the reconnect instead of
            # failing the request (the frame was not buffered).
            await self._wait_until_listened(listener)
            await nc.publish(listener.reply, data)
        listener.last_sent = time.monotonic()

    async def beat(self) -> None:
        """Sends the heartbeats (see the module's docstring) while connected."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self.nc.is_connected:
                continue  # never into nats-py's reconnect buffer: the outage rules apply
            idle_since = time.monotonic() - self.heartbeat_s / 2
            for client in list(self._clients.values()):
                for listener in list(client.listeners.values()):
                    if listener.last_sent <= idle_since and not listener.gone:
                        listener.last_sent = time.monotonic()
                        try:
                            await self.nc.publish(listener.reply, b"", headers=_HEARTBEAT_HEADERS)
                        except Exception as error:  # the connection dropped: next beat
                            log.debug("heartbeat to %s: %r", loggable(listener.reply), error)

    async def _wait_until_listened(self, listener: Listener) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.outage_wait_s
        waited_since = time.monotonic()
        while True:
            if listener.gone:
                raise ClientGone(f"nobody listens on {listener.reply}")
            if self.nc.is_closed:
                raise Undeliverable("the NATS connection is closed")
            if self.nc.is_connected:
                if listener.epoch == self._epoch():
                    break
                if await self._probe_shared(listener) is not True:
                    await asyncio.sleep(min(0.25, self.grace_s / 4))
            else:
                await asyncio.sleep(0.05)
            if loop.time() > deadline:
                raise OutageTooLong(
                    f"no connection to the broker and the reply subject for {self.outage_wait_s}s"
                )
        waited = time.monotonic() - waited_since
        if waited > 0.05:
            log.info("frames to %s resume after %.2fs", loggable(listener.reply), waited)

    async def listened(self, reply: str) -> bool | None:
        """One probe of a reply subject no request holds yet: True, someone listens; False,
        nobody ("no responders"); None, no answer either way."""
        return await self._probe(Listener(reply, client_key(reply), self._epoch()))

    async def _probe_shared(self, listener: Listener) -> bool | None:
        """One probe of the listener at a time, however many publishers wait on it."""
        if listener._probe is None or listener._probe.done():
            listener._probe = asyncio.ensure_future(self._probe(listener))
        return await asyncio.shield(listener._probe)

    async def _probe(self, listener: Listener) -> bool | None:
        """True: a subscriber is there; False: "no responders"; None: no answer either way."""
        nc = self.nc
        epoch = self._epoch()
        self.probes_sent += 1
        answers = None
        try:
            inbox = nc.new_inbox()
            answers = await nc.subscribe(inbox)
            await nc.publish(listener.reply, b"", reply=inbox, headers=_PROBE_HEADERS)
            await nc.publish(inbox, b"")  # the marker
            nobody = _no_responders(await answers.next_msg(timeout=self.probe_timeout_s))
        except Exception as error:  # connection trouble or no marker in time: this says nothing
            log.debug("probe of %s failed: %r", loggable(listener.reply), error)
            return None
        finally:
            if answers is not None and not nc.is_closed:
                try:
                    await answers.unsubscribe()
                except Exception as error:  # dropped with the connection anyway
                    log.debug("probe subscription: %r", error)
        if nobody:
            self._missed(listener)
            return False
        if not nc.is_connected or self._epoch() != epoch:
            return None  # the connection dropped meanwhile: the subscriber may not be back
        listener.first_miss = None
        listener.epoch = epoch
        return True

    def _missed(self, listener: Listener) -> None:
        now = time.monotonic()
        client = self._clients.get(listener.key)
        if client is not None:
            client.suspect = True
        if listener.first_miss is None:
            listener.first_miss = now
            return
        if now - listener.first_miss < self.grace_s or listener.gone:
            return
        listener.gone = True
        log.info(
            "nobody has listened on %s for %.1fs: client gone",
            loggable(listener.reply),
            now - listener.first_miss,
        )
        if listener.on_gone is not None:
            listener.on_gone()

    async def run(self) -> None:
        """Probes every `interval_s` while connected (see the module's invariants)."""
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.nc.is_connected or not self._clients:
                continue
            await asyncio.gather(*(self._probe_shared(each) for each in self._round()))

    def _round(self) -> list[Listener]:
        chosen: list[Listener] = []
        for client in list(self._clients.values()):
            listeners = list(client.listeners.values())
            if client.suspect:
                client.suspect = False  # set again by any miss of this round
                chosen.extend(listeners)
            else:
                chosen.append(listeners[next(client.turn) % len(listeners)])
        return chosen


class NatsReply:
    """One request's reply subject as the service core sees it (worker/service.py `Reply`)."""

    def __init__(self, liveness: Liveness, subject: str) -> None:
        self.subject = subject
        self._liveness = liveness
        self._listener = liveness.listener(subject)

    async def publish(self, data: bytes) -> None:
        await self._liveness.publish(self._listener, data)

    def watch(self, on_gone: Callable[[], None]) -> None:
        self._liveness.track(self._listener, on_gone)

    def release(self) -> None:
        self._liveness.untrack(self._listener)
