"""worker.nats.compat on the real nats-server: what `flush` promises the rest of the worker."""

from __future__ import annotations

import nats

from worker.nats.compat import flush_ordered as flush


async def test_flush_puts_its_ping_behind_buffered_subscriptions(nats_server) -> None:
    """Worker.start relies on this: once flushed, the server holds the new subscriptions, so a
    request published right after by anyone reaches the worker. nats-py's own flush() writes
    its PING ahead of still-buffered SUBs, so its PONG alone does not promise that."""
    subscriber = await nats.connect(nats_server.url)
    publisher = await nats.connect(nats_server.url)
    wire: list[bytes] = []
    transport = subscriber._transport
    write, writelines = transport.write, transport.writelines
    transport.write = lambda data: (wire.append(bytes(data)), write(data))[1]
    transport.writelines = lambda lines: (wire.extend(map(bytes, lines)), writelines(lines))[1]
    try:
        subscription = await subscriber.subscribe("flush.order", queue="q")
        await flush(subscriber)
        sent = b"".join(wire)
        assert b"SUB flush.order q" in sent and b"PING\r\n" in sent
        assert sent.index(b"SUB flush.order q") < sent.index(b"PING\r\n"), sent
        await publisher.publish("flush.order", b"right after")
        assert (await subscription.next_msg(timeout=5)).data == b"right after"
    finally:
        transport.write, transport.writelines = write, writelines
        await publisher.close()
        await subscriber.close()
