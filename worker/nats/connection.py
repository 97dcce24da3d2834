"""The NATS connection: servers, auth, TLS, reconnect policy and its log lines."""

from __future__ import annotations

import logging
import ssl
from typing import Any

import nats
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


async def connect(config: NatsConfig) -> NATS:
    async def on_error(error: Exception) -> None:
        log.warning("nats: %s", error)

    async def on_disconnected() -> None:
        if not nc.is_closed:
            log.warning("nats: disconnected")

    async def on_reconnected() -> None:
        log.info("nats: reconnected to %s", nc.connected_url.netloc if nc.connected_url else "?")

    options: dict[str, Any] = dict(
        servers=config.servers,
        name=config.name,
        max_reconnect_attempts=config.max_reconnect_attempts,
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
    nc = await nats.connect(**options)
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
