"""The NATS connection: servers, auth, TLS, reconnect policy and its log lines."""

from __future__ import annotations

import logging
import ssl
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from worker.config import NatsConfig

log = logging.getLogger(__name__)


def _tls_context(config: NatsConfig) -> ssl.SSLContext | None:
    if not (config.tls_ca or config.tls_cert):
        return None
    context = ssl.create_default_context(cafile=config.tls_ca)
    if config.tls_cert:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    return context


class ConnectFailed(RuntimeError):
    """No server of the list could be connected to within the attempts given."""


async def connect(config: NatsConfig, *, attempts: int | None = None) -> NATS:
    """A connection by `config`. `attempts`: connection attempts per server before giving up
    with ConnectFailed (naming the last error); it also bounds the connection's reconnects, so
    it is for a start-up check, not for serving (default: `config.max_reconnect_attempts`)."""
    errors: list[Exception] = []

    async def on_error(error: Exception) -> None:
        errors.append(error)
        # In a start-up check, ConnectFailed names the last error: one line, not one per try.
        log.log(logging.WARNING if attempts is None else logging.DEBUG, "nats: %s", error)

    async def on_disconnected() -> None:
        if not nc.is_closed:
            log.warning("nats: disconnected")

    async def on_reconnected() -> None:
        log.info("nats: reconnected to %s", nc.connected_url.netloc if nc.connected_url else "?")

    options: dict[str, Any] = dict(
        servers=config.servers,
        name=config.name,
        max_reconnect_attempts=config.max_reconnect_attempts if attempts is None else attempts,
        reconnect_time_wait=config.reconnect_wait_s,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
    )
    if config.user is not None:
        options.update(user=config.user, password=config.password)
    if config.token is not None:
        options["token"] = config.token
    if config.creds_file is not None:
        options["user_credentials"] = config.creds_file
    if config.nkeys_seed is not None:
        options["nkeys_seed"] = config.nkeys_seed
    if (tls := _tls_context(config)) is not None:
        options["tls"] = tls
    try:
        nc = await nats.connect(**options)
    except Exception as error:
        # What the server said (e.g. -ERR 'Authorization Violation') names the cause; the
        # connection reset that may follow it, or beat it to the socket, does not.
        said = [e for e in errors if isinstance(e, nats.errors.Error)]
        cause = said[-1] if said else errors[-1] if errors else error
        servers = ", ".join(config.servers)
        raise ConnectFailed(f"cannot connect to NATS at {servers}: {cause}") from error
    where = nc.connected_url.netloc if nc.connected_url else "?"
    log.info("nats: connected to %s (max_payload %d)", where, nc.max_payload)
    return nc


async def unsubscribe_all(subscriptions: list[Subscription]) -> None:
    """Unsubscribes each; one that fails (the connection is closing anyway) does not stop the
    rest."""
    for subscription in subscriptions:
        try:
            await subscription.unsubscribe()
        except Exception as error:
            log.debug("unsubscribe of %s failed: %r", subscription.subject, error)
