"""worker.client retries a retryable refusal (`overloaded`, `worker_shutdown`) on another worker,
found through NATS micro discovery, only while nothing was yielded; bounded; RequestError when
no worker is left. Real nats-server, several workers on paced fake engines (a request of 450
tokens runs 4.5 s: a worker it occupies is full meanwhile)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NATS

from messages.subjects import Subjects
from tests.helpers import complete_all
from worker.client import RequestError, complete, discover_workers, generate
from worker.client.requests import make_request
from worker.nats.runtime import WorkerRuntime

PROMPT = [1, 300, 301, 302]


@contextlib.asynccontextmanager
async def occupied(nc: NATS, subject: str, name: str) -> AsyncIterator[None]:
    """One long request running on `subject` (a worker at max_concurrency 1 is then full);
    cancelled on exit."""
    started = asyncio.Event()

    async def run() -> None:
        async for _frame in generate(
            nc, make_request(name, PROMPT, max_tokens=450), subject=subject
        ):
            started.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(started.wait(), 30)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def settled(worker: WorkerRuntime) -> WorkerRuntime:
    """The worker once nothing runs on it any more (a cancel ends a request asynchronously)."""
    for _ in range(200):
        if worker.service.in_flight == 0:
            return worker
        await asyncio.sleep(0.01)
    raise AssertionError(f"worker still has {worker.service.in_flight} requests in flight")


async def test_discovery_lists_the_workers_of_a_subject(fake_worker, client) -> None:
    subjects = Subjects("disco", "vllm", "generate")
    await fake_worker(subjects, instance_id="full", max_concurrency=1)
    await fake_worker(subjects, instance_id="free")
    await fake_worker(Subjects("elsewhere", "vllm", "generate"), instance_id="other")
    async with occupied(client, subjects.instance("full"), "disco-busy"):
        found = {w.instance_id: w for w in await discover_workers(client, subjects.generate)}
    assert sorted(found) == ["free", "full"]
    assert found["full"].subject == "disco.vllm.generate.full"
    assert found["full"].max_concurrency == 1 and found["full"].in_flight == 1
    assert not found["full"].has_capacity
    assert found["free"].max_concurrency is None and found["free"].has_capacity


async def test_refusal_on_an_instance_is_retried_on_another_worker(fake_worker, client) -> None:
    subjects = Subjects("retry", "vllm", "generate")
    full = await fake_worker(subjects, instance_id="full", max_concurrency=1)
    free = await fake_worker(subjects, instance_id="free")
    async with occupied(client, subjects.instance("full"), "retry-busy"):
        frames = [
            frame
            async for frame in generate(
                client,
                make_request("retry-1", PROMPT, max_tokens=6, logprobs=2),
                subject=subjects.instance("full"),
            )
        ]
    # The caller sees only the answer of the worker that served it: no error frame, seq from 0.
    assert [f.seq for f in frames] == list(range(len(frames)))
    assert not any(f.error for f in frames)
    assert frames[-1].finish_reason == "length"
    assert sum(len(f.token_ids) for f in frames) == 6
    # The full worker served only the request that occupied it.
    assert free.service.served == 1 and (await settled(full)).service.served == 1


async def test_refusals_through_the_queue_group_are_retried(fake_worker, client) -> None:
    subjects = Subjects("retryq", "vllm", "generate")
    full = await fake_worker(subjects, instance_id="full", max_concurrency=0)
    free = await fake_worker(subjects, instance_id="free")
    sent = 0
    # Batches of 8 over 2 queue members until the full one was reached (each batch misses it
    # with probability 2**-8, too often for one batch alone).
    while sum(stats.num_errors for stats in full.service.stats.values()) == 0 and sent < 64:
        results = await complete_all(
            client,
            subjects.generate,
            [make_request(f"rq-{sent + i}", PROMPT, max_tokens=3) for i in range(8)],
        )
        sent += 8
        assert [r.choices[0].finish_reason for r in results] == ["length"] * 8
        assert all(r.error is None for r in results)
    assert (full.service.served, free.service.served) == (0, sent)
    # The full worker was reached, refused, and every request it refused was served by the free.
    assert sum(stats.num_errors for stats in full.service.stats.values()) >= 1


async def test_exhausted_retries_raise_a_clear_request_error(fake_worker, client) -> None:
    subjects = Subjects("retryx", "vllm", "generate")
    await fake_worker(subjects, instance_id="only", max_concurrency=1)
    async with occupied(client, subjects.instance("only"), "rx-busy"):
        with pytest.raises(RequestError) as refused:
            await complete(client, make_request("rx-1", PROMPT), subject=subjects.generate)
        with pytest.raises(RequestError) as direct:
            await complete(
                client, make_request("rx-2", PROMPT), subject=subjects.instance("only"), retries=0
            )
    assert refused.value.code == "overloaded"
    assert refused.value.message.startswith("refused after 1 attempt(s): queue group retryx.")
    assert "max_concurrency 1" in refused.value.message
    assert refused.value.message.endswith("; no other worker with free capacity")
    assert direct.value.code == "overloaded"
    assert direct.value.message.startswith("refused after 1 attempt(s): only: worker at ")


async def test_no_retry_once_output_began(fake_worker, client) -> None:
    """With migration off (`migration_limit=0`); with it on, the stream continues on the other
    worker instead (tests/integration/test_migration.py)."""
    subjects = Subjects("retrylate", "vllm", "generate")
    busy = await fake_worker(subjects, instance_id="busy")
    other = await fake_worker(subjects, instance_id="other")
    frames = []
    async for frame in generate(
        client,
        make_request("late-1", PROMPT, max_tokens=450),
        subject=subjects.instance("busy"),
        migration_limit=0,
    ):
        frames.append(frame)
        if len(frames) == 3:
            # Ends the running request with a retryable worker_shutdown frame, mid-stream.
            asyncio.create_task(busy.drain(timeout_s=0.0))
    final = frames[-1]
    assert final.finish_reason == "error" and final.error.code == "worker_shutdown"
    assert sum(len(f.token_ids) for f in frames) >= 3
    assert (
        other.service.served == 0
    )  # tokens had reached the caller: not silently restarted elsewhere
