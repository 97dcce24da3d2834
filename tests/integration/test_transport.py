"""worker.shared.nats_compat on the real nats-server: what `flush` promises the worker."""

from __future__ import annotations

import nats

from worker.shared.nats_compat import flush_ordered as flush


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


async def test_a_request_nobody_serves_ends_at_once_as_no_workers(nats_server) -> None:
    """NATS answers a request on a subject without subscribers with "no responders" (a status
    503, empty body): the client library raises no_workers naming the subject, at once, instead
    of waiting out its frame timeout."""
    import asyncio
    import time

    import pytest

    from messages.errors import is_refusal, is_retryable, kind
    from tests.helpers import run_client_cli
    from worker.client import RequestError, complete
    from worker.client.requests import make_request

    nc = await nats.connect(nats_server.url)
    try:
        started = time.monotonic()
        with pytest.raises(RequestError) as info:
            await complete(
                nc, make_request("nobody-1", [1, 2, 3]), subject="nobody.vllm.generate", timeout=30
            )
        assert time.monotonic() - started < 5
        assert info.value.code == "no_workers"
        assert info.value.message == (
            "no worker listens on nobody.vllm.generate (NATS: no responders)"
        )
        assert is_retryable("no_workers") and is_refusal("no_workers")
        assert kind("no_workers").http_status == 503
    finally:
        await nc.close()

    # The client CLI: one line, exit 1, no traceback.
    done = await asyncio.to_thread(
        run_client_cli, nats_server.url, "--subject", "nobody.vllm.generate",
        "--token-ids", "1,2,3", timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done
    output = (done.stdout + done.stderr).strip().splitlines()
    assert output == [
        "error no_workers: no worker listens on nobody.vllm.generate (NATS: no responders)"
    ], output


async def test_an_inbox_reads_in_order_waits_and_times_out(nats_server) -> None:
    """worker.client.Inbox (the frame reader's subscription): messages in publish order whether
    they were queued before the read or arrive during it, and nats' TimeoutError when none
    comes in time, after which it still reads."""
    import asyncio
    import time

    import nats.errors
    import pytest

    from worker.client import Inbox

    sub_nc, pub_nc = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
    try:
        inbox = await Inbox.open(sub_nc, "inbox.test")
        # The messages come from another connection: nats-py's own flush() can send its PING
        # ahead of the buffered SUB, and a message published before the server has the SUB is
        # dropped (the test would then time out).
        await flush(sub_nc)
        for i in range(50):
            await pub_nc.publish("inbox.test", str(i).encode())
        await pub_nc.flush()
        assert [(await inbox.next_msg(timeout=5)).data for _ in range(50)] == [
            str(i).encode() for i in range(50)
        ]

        async def later() -> None:
            await asyncio.sleep(0.2)
            await pub_nc.publish("inbox.test", b"late", headers={"Vllm-Test": "1"})

        task = asyncio.create_task(later())
        msg = await inbox.next_msg(timeout=5)
        await task
        assert (msg.data, msg.headers) == (b"late", {"Vllm-Test": "1"})

        started = time.monotonic()
        with pytest.raises(nats.errors.TimeoutError):
            await inbox.next_msg(timeout=0.3)
        assert 0.25 < time.monotonic() - started < 2
        await pub_nc.publish("inbox.test", b"after")
        assert (await inbox.next_msg(timeout=5)).data == b"after"
        await inbox.unsubscribe()
    finally:
        await sub_nc.close()
        await pub_nc.close()
