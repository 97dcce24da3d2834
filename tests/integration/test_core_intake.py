"""The core intake on a real nats-server, workers on the paced fake engine: the reply subject a
request needs, the instance subject that routes to one worker, the queue group that shares a
subject among workers, JSON in and JSON out, and the embedded server's default payload size."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from messages.codec import JSON, MSGPACK
from messages.subjects import Subjects
from tests.helpers import complete_all, exchange
from worker.client import complete, fold
from worker.client.requests import make_request
from worker.dev.embedded import NatsServer

PROMPT = [1, 300, 301, 302, 400, 401]


async def test_request_without_reply_subject_is_refused_not_run(
    fake_worker, client, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="worker.service")
    subjects = Subjects("noreply", "vllm", "generate")
    worker = await fake_worker(subjects)
    engine = worker.service.engine
    served = worker.service.served
    await client.publish(
        subjects.generate, MSGPACK.encode(make_request("no-reply", PROMPT, max_tokens=50))
    )
    await client.flush()
    for _ in range(100):
        if "without a reply subject" in caplog.text:
            break
        await asyncio.sleep(0.02)
    assert "without a reply subject" in caplog.text
    assert engine.num_unfinished_requests() == 0 and worker.service.served == served
    good = await complete(
        client, make_request("after-no-reply", PROMPT, max_tokens=2), subject=subjects.generate
    )
    assert good.choices[0].finish_reason == "length"


async def test_instance_subject_routes_to_this_worker(fake_worker, client) -> None:
    subjects = Subjects("direct", "vllm", "generate")
    worker = await fake_worker(subjects)
    other = await fake_worker(subjects)
    subject = subjects.instance(worker.config.instance_id)
    result = await complete(client, make_request("direct", PROMPT, max_tokens=3), subject=subject)
    assert result.choices[0].finish_reason == "length"
    # Only the named worker served it, though another shares the queue group.
    assert (worker.service.served, other.service.served) == (1, 0)


async def test_three_workers_share_sixty_requests(fake_worker, client) -> None:
    subjects = Subjects("scale", "vllm", "generate")
    workers = [await fake_worker(subjects) for _ in range(3)]
    results = await complete_all(
        client,
        subjects.generate,
        [make_request(f"scale-{i}", [1, 20 + i, 300], max_tokens=4) for i in range(60)],
    )
    assert all(
        r.choices[0].finish_reason == "length" and len(r.choices[0].token_ids) == 4 for r in results
    )
    served = [w.service.served for w in workers]
    assert sum(served) == 60 and all(count > 0 for count in served), served


async def test_json_request_answered_in_json(fake_worker, client) -> None:
    subjects = Subjects("json", "vllm", "generate")
    await fake_worker(subjects)
    request = make_request("json-1", PROMPT, max_tokens=6, logprobs=3)
    raw = await exchange(client, subjects.generate, JSON.encode(request), json=True)
    wires = [msgspec.json.decode(data) for data in raw]  # every frame is JSON text
    assert wires[-1]["finish_reason"] == "length"
    assert isinstance(wires[0]["top_logprobs"][0][0]["bytes"], str)  # base64 in JSON
    via_json = fold("json-1", [JSON.decode_frame(d) for d in raw], 1).choices[0]
    via_msgpack = (
        await complete(
            client,
            make_request("mp-1", PROMPT, max_tokens=6, logprobs=3),
            subject=subjects.generate,
        )
    ).choices[0]
    assert via_json.token_ids == via_msgpack.token_ids
    assert via_json.log_probs == via_msgpack.log_probs
    assert via_json.top_logprobs == via_msgpack.top_logprobs


def test_default_server_has_large_max_payload() -> None:
    # The tests' server is shrunk on purpose; a default embedded server is not.
    with NatsServer(jetstream=False) as server:
        assert server.url.startswith("nats://127.0.0.1:")
