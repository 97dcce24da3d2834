"""KV-aware routing on a real nats-server with fake engines whose fake prefix caches emit
engine-like events (worker.dev.fakes.FakePrefixCache): snapshots for a late router, restarts,
lost batches, draining and full workers. The real engine's events: tests/e2e/test_kv_routing.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS

from messages.kv import BATCH_DECODER, AllCleared, BlocksStored, KvEvent
from messages.subjects import Subjects
from tests.helpers import until
from worker.client import KvRouter, Route, generate
from worker.client.library import discovery_answers
from worker.client.requests import make_request
from worker.config import NatsConfig, WorkerConfig
from worker.dev.fakes import FakePrefixCache, PacedFakeEngine
from worker.nats.kv_publisher import KvPublisher
from worker.nats.runtime import WorkerRuntime, open_worker

BLOCK = 4
SYSTEM = list(range(100, 116))  # 4 blocks every conversation shares
CONVERSATION_A = SYSTEM + list(range(200, 224))  # + 6 blocks of its own
CONVERSATION_B = SYSTEM + list(range(300, 324))


@contextlib.asynccontextmanager
async def fleet(
    url: str, subjects: Subjects
) -> AsyncIterator[Callable[..., Awaitable[WorkerRuntime]]]:
    """Starts workers on fake engines with prefix caches; stops them all at the end."""
    made: list[WorkerRuntime] = []

    async def start(instance_id: str, **settings: object) -> WorkerRuntime:
        settings.setdefault("load_interval_s", 0.2)
        config = WorkerConfig(
            nats=NatsConfig(servers=[url]),
            subjects=subjects,
            instance_id=instance_id,
            **settings,  # type: ignore[arg-type]
        )
        engine = PacedFakeEngine(step_s=0.01, cache=FakePrefixCache(BLOCK))
        worker = await open_worker(engine, config)
        made.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in made:
            await worker.stop()


@contextlib.asynccontextmanager
async def a_router(
    url: str, subjects: Subjects, **settings: Any
) -> AsyncIterator[tuple[NATS, KvRouter]]:
    """A started KvRouter on a connection of its own; stopped and closed at the end."""
    nc = await nats.connect(url)
    router = KvRouter(nc, subjects, **settings)
    try:
        await router.start()
        yield nc, router
    finally:
        await router.stop()
        await nc.close()


async def serve(nc: NATS, subject: str, tokens: list[int], request_id: str) -> None:
    """One request to `subject`, read to its end: its prompt is then in that worker's cache."""
    async for frame in generate(
        nc, make_request(request_id, tokens, max_tokens=2), subject=subject
    ):
        assert not frame.error, frame.error


def cached_blocks(router: KvRouter, instance_id: str) -> int:
    view = router.workers.get(instance_id)
    return len(view.index) if view is not None and view.index is not None else -1


async def test_a_router_started_after_the_workers_routes_from_their_snapshots(nats_server):
    subjects = Subjects("kvlate", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        await start("w1")
        await start("w2")
        nc = await nats.connect(nats_server.url)
        try:
            await serve(nc, subjects.instance("w1"), CONVERSATION_A, "a-1")
            await serve(nc, subjects.instance("w2"), CONVERSATION_B, "b-1")
            router = KvRouter(nc, subjects)
            await router.start()
            try:
                # Learned from snapshots by the time start() returns: no event has come since.
                assert router.resyncs >= 2
                assert cached_blocks(router, "w1") == 10
                assert cached_blocks(router, "w2") == 10
                next_turn_a = CONVERSATION_A + list(range(400, 408))
                next_turn_b = CONVERSATION_B + list(range(500, 508))
                route_a, route_b = router.route(next_turn_a), router.route(next_turn_b)
                assert (route_a.instance_id, route_a.overlap_blocks) == ("w1", 10)
                assert (route_b.instance_id, route_b.overlap_blocks) == ("w2", 10)
                assert route_a.subject == "kvlate.fake.generate.w1"
                # The route is a subject generate() serves: the new turn lands on w1 and its
                # new blocks reach the index as events.
                await serve(nc, route_a.subject, next_turn_a, "a-2")
                await until(lambda: cached_blocks(router, "w1") == 12)
                # A prompt nobody holds (beyond the shared system prompt) goes by load.
                fresh = router.route(SYSTEM + list(range(600, 620)))
                assert fresh.overlap_blocks == 4 and fresh.instance_id in {"w1", "w2"}
                # A second router (another frontend) learns the same without coordinating.
                async with a_router(nats_server.url, subjects) as (_, second):
                    assert second.route(next_turn_a).instance_id == "w1"
                    assert second.route(next_turn_b).instance_id == "w2"
            finally:
                await router.stop()
        finally:
            await nc.close()


async def test_a_restarted_worker_is_dropped_and_rebuilt(nats_server):
    subjects = Subjects("kvrestart", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        first = await start("w1")
        await start("w2")
        async with a_router(nats_server.url, subjects, stale_s=0.6) as (nc, router):
            await serve(nc, subjects.instance("w1"), CONVERSATION_A, "a-1")
            await until(lambda: cached_blocks(router, "w1") == 10)
            old_epoch = router.workers["w1"].epoch
            await first.stop()  # its last load report says draining: never routed to again
            await until(lambda: router.workers["w1"].load.draining)  # type: ignore[union-attr]
            assert router.route(CONVERSATION_A).instance_id == "w2"
            # Restarted under the same instance id: a new epoch, an empty cache. The old index
            # is gone, and the new one starts from the new epoch's first batch: no snapshot.
            snapshots = router.resyncs
            await start("w1")
            await until(lambda: router.workers["w1"].epoch != old_epoch)
            assert cached_blocks(router, "w1") == -1
            await serve(nc, subjects.instance("w1"), CONVERSATION_B, "b-1")
            await until(lambda: cached_blocks(router, "w1") == 10)
            assert router.resyncs == snapshots
            assert router.route(CONVERSATION_B).instance_id == "w1"
            assert router.route(CONVERSATION_A).overlap_blocks == 4  # only what w1 holds now


async def test_the_processes_of_one_engine_are_routed_to_as_one(nats_server):
    """Instances whose load reports name one engine core (`--worker-processes`) hold one KV
    cache: the router scores the engine (its busy summed over the processes) and sends to the
    engine's subject, which the processes share in a queue group of their own; a worker with an
    engine of its own is a second choice weighed against it; a process of the engine that
    reported itself full leaves the engine's subject for its open process."""
    subjects = Subjects("kvengine", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        await start("e1-0", engine_id="e1", max_concurrency=1)
        # As in a real worker, only process 0 republishes the engine's events.
        await start("e1-1", engine_id="e1", max_concurrency=1, kv_event_source=False)
        async with a_router(nats_server.url, subjects) as (nc, router):
            await serve(nc, subjects.instance("e1-0"), CONVERSATION_A, "one-engine-a")
            await until(lambda: cached_blocks(router, "e1-0") >= 10)
            await until(lambda: all(v.load is not None for v in router.workers.values()))
            assert cached_blocks(router, "e1-1") == -1
            assert {v.load.engine_id for v in router.workers.values()} == {"e1"}  # type: ignore[union-attr]
            await until(lambda: router.engines["e1"].others == 0)
            route = router.route(CONVERSATION_A)
            assert route == Route(subjects.instance("e1"), "e1", 10, 0)
            # The engine's subject reaches one of its processes: both serve it.
            frames = [
                f
                async for f in generate(
                    nc, make_request("to-e1", CONVERSATION_A), subject=route.subject
                )
            ]
            assert frames[-1].finish_reason == "length" and not frames[-1].error
            router.release(route)
            await until(lambda: router.engines["e1"].others == 0)
            await start("w2")
            await until(lambda: "w2" in router.workers and router.workers["w2"].load is not None)
            # Two requests on e1 (its limit, 1 + 1): the next goes to w2, cache or not.
            first, second = router.route(CONVERSATION_A), router.route(CONVERSATION_A)
            assert (first.instance_id, first.overlap_blocks, second.busy) == ("e1", 10, 1)
            assert second.instance_id == "e1" and router.engines["e1"].busy == 2
            assert router.route(CONVERSATION_A).instance_id == "w2"
            for route in (first, second):
                router.release(route)
            # e1-0 busy with a long request and reporting itself full: e1 still has room, at
            # e1-1 only.
            long = make_request("long-e1", CONVERSATION_B, max_tokens=200)
            running = asyncio.create_task(serve_request(nc, subjects.instance("e1-0"), long))
            await until(lambda: router.workers["e1-0"].full)
            route = router.route(CONVERSATION_A)
            assert (route.subject, route.instance_id) == (subjects.instance("e1-1"), "e1")
            await running


async def test_a_router_learns_from_discovery_which_process_answers_snapshots(nats_server, caplog):
    """Of one engine's processes only process 0 publishes its events (metadata `kv_events`
    `published`); the others `load-only`. A router started after them (no load report since
    their first: a 30 s interval) takes process 0's snapshot and knows process 1 by its
    discovered load, without asking it for a snapshot it cannot give."""
    caplog.set_level(logging.INFO, logger="worker.client.router")
    subjects = Subjects("kvdiscover", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        slow = {"engine_id": "e1", "max_concurrency": 3, "load_interval_s": 30.0}
        await start("e1-0", **slow)
        await start("e1-1", kv_event_source=False, **slow)
        async with a_router(nats_server.url, subjects) as (nc, router):
            metadata = [
                json.loads(answer)["metadata"]
                async for answer in discovery_answers(nc, "$SRV.STATS.vllm-nats-worker", 0.5)
            ]
            # (other tests' workers on the session's server answer too)
            ours = [m for m in metadata if m["instance_id"] in ("e1-0", "e1-1")]
            kv_events = {m["instance_id"]: m["kv_events"] for m in ours}
            assert kv_events == {"e1-0": "published", "e1-1": "load-only"}
            assert router.resyncs == 1 and cached_blocks(router, "e1-0") == 0
            process_1 = router.workers["e1-1"]
            assert process_1.index is None
            assert process_1.load is not None and process_1.load.engine_id == "e1"
            assert process_1.load.max_concurrency == 3
            assert "no KV snapshot from e1-1" not in caplog.text
            assert router.route(CONVERSATION_A).instance_id == "e1"


async def test_a_silent_worker_is_forgotten(nats_server):
    subjects = Subjects("kvsilent", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        worker = await start("w1")
        async with a_router(nats_server.url, subjects, stale_s=0.6) as (nc, router):
            await until(lambda: "w1" in router.workers and router.workers["w1"].load is not None)
            assert router.route(CONVERSATION_A).instance_id == "w1"
            await worker.kv.stop()  # type: ignore[union-attr]  # as a killed worker: no reports
            await asyncio.sleep(0.8)
            route = router.route(CONVERSATION_A)
            assert route.subject is None  # nothing known: the queue group
            assert "w1" not in router.workers


async def test_a_lost_batch_triggers_a_resync(nats_server):
    subjects = Subjects("kvgap", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        worker = await start("w1")
        async with a_router(nats_server.url, subjects) as (nc, router):
            await serve(nc, subjects.instance("w1"), CONVERSATION_A, "a-1")
            await until(lambda: cached_blocks(router, "w1") == 10)
            before = router.resyncs
            # A batch lost in the middle: the next one's seq jumps.
            assert worker.kv is not None
            worker.kv.seq += 1
            await serve(nc, subjects.instance("w1"), CONVERSATION_B, "b-1")
            await until(lambda: router.resyncs == before + 1)
            await until(lambda: cached_blocks(router, "w1") == 16)
            # The last batch lost: no later batch shows the gap, the load report's kv_seq does.
            publish = worker.kv.nc.publish
            dropped: list[str] = []

            async def lossy(subject: str, payload: bytes = b"", **kw: object) -> None:
                if ".kv.generate.events." in subject and not dropped:
                    dropped.append(subject)
                    return
                await publish(subject, payload, **kw)  # type: ignore[arg-type]

            worker.kv.nc.publish = lossy  # type: ignore[method-assign]
            await serve(nc, subjects.instance("w1"), SYSTEM + list(range(700, 708)), "c-1")
            assert dropped
            await until(lambda: router.resyncs == before + 2)
            await until(lambda: cached_blocks(router, "w1") == 18)
            assert router.route(SYSTEM + list(range(700, 708))).overlap_blocks == 6


async def test_never_routes_to_a_full_or_draining_worker(nats_server):
    subjects = Subjects("kvfull", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        holder = await start("w1", max_concurrency=1)
        await start("w2")
        async with a_router(nats_server.url, subjects) as (nc, router):
            await serve(nc, subjects.instance("w1"), CONVERSATION_A, "a-1")
            await until(lambda: cached_blocks(router, "w1") == 10)
            assert router.route(CONVERSATION_A).instance_id == "w1"
            # w1 at its limit (one long request): the prefix is there, the worker is full.
            long = make_request("long", CONVERSATION_B, max_tokens=200)
            running = asyncio.create_task(serve_request(nc, subjects.instance("w1"), long))
            await until(lambda: router.workers["w1"].load.in_flight == 1)  # type: ignore[union-attr]
            assert [router.route(CONVERSATION_A).instance_id for _ in range(5)] == ["w2"] * 5
            # Draining: never again, even once its requests are done.
            drain = asyncio.create_task(holder.drain(5.0))
            await until(lambda: router.workers["w1"].load.draining)  # type: ignore[union-attr]
            await running
            await drain
            await until(lambda: router.workers["w1"].load.in_flight == 0)  # type: ignore[union-attr]
            assert [router.route(CONVERSATION_A).instance_id for _ in range(5)] == ["w2"] * 5


async def serve_request(nc: NATS, subject: str, request: object) -> None:
    async for frame in generate(nc, request, subject=subject):  # type: ignore[arg-type]
        assert not frame.error, frame.error


async def test_events_on_the_wire_spell_the_contract(nats_server):
    """The field names and subjects a router in another language reads."""
    subjects = Subjects("kvwire", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        await start("w1")
        nc = await nats.connect(nats_server.url)
        try:
            events = await nc.subscribe("kvwire.fake.kv.generate.events.w1")
            load = await nc.subscribe("kvwire.fake.kv.generate.load.w1")
            await serve(nc, subjects.instance("w1"), CONVERSATION_A, "a-1")
            raw = (await events.next_msg(timeout=2)).data
            batch = msgspec.msgpack.decode(raw)
            assert BATCH_DECODER.decode(raw).events[0] == BlocksStored(  # the router's decoder
                stored_hashes := msgspec.msgpack.decode(raw)["events"][0]["block_hashes"],
                None,
                CONVERSATION_A,
            )
            assert len(stored_hashes) == 10
            assert set(batch) == {"instance_id", "epoch", "seq", "block_size", "events"}
            assert (batch["instance_id"], batch["seq"], batch["block_size"]) == ("w1", 0, 4)
            (stored,) = batch["events"]
            assert stored["type"] == "stored"
            assert stored["parent_block_hash"] is None
            assert stored["token_ids"] == CONVERSATION_A and len(stored["block_hashes"]) == 10
            report = msgspec.msgpack.decode((await load.next_msg(timeout=2)).data)
            assert {
                "instance_id",
                "epoch",
                "in_flight",
                "max_concurrency",
                "draining",
                "kv_seq",
                "running",
                "waiting",
                "kv_usage",
                "engine_id",
            } <= set(report)
            assert report["engine_id"] is None  # a worker with an engine of its own
            answer = await nc.request("kvwire.fake.kv.generate.snapshot.w1", b"", timeout=2)
            snapshot = msgspec.msgpack.decode(answer.data)
            assert snapshot["seq"] == 0 and snapshot["epoch"] == batch["epoch"]
            assert len(snapshot["blocks"]) == 10 and snapshot["blocks"][0]["type"] == "stored"
        finally:
            await nc.close()


@pytest.mark.parametrize("mode", ["queue", "least-busy"])
async def test_the_comparison_modes(nats_server, mode):
    subjects = Subjects("kvmodes", "fake", mode.replace("-", ""))
    async with fleet(nats_server.url, subjects) as start:
        await start("w1")
        await start("w2")
        async with a_router(nats_server.url, subjects, mode=mode) as (nc, router):
            await serve(nc, subjects.instance("w1"), CONVERSATION_A, "a-1")
            await asyncio.sleep(0.3)
            routes = {router.route(CONVERSATION_A).instance_id for _ in range(40)}
            if mode == "queue":
                assert routes == {None}
            else:  # by load alone: both workers, whatever they hold
                assert routes == {"w1", "w2"}


async def test_busy_counts_this_routers_requests_until_released(nats_server):
    """The load term: this router's own requests exactly (route → release), plus the worker's
    others as of its last report; a report does not forget requests still running."""
    subjects = Subjects("kvbusy", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        await start("w1")
        other = await nats.connect(nats_server.url)
        async with a_router(nats_server.url, subjects) as (nc, router):
            await until(lambda: "w1" in router.workers and router.workers["w1"].load is not None)
            view = router.engines["w1"]
            routes = [router.route(CONVERSATION_A) for _ in range(3)]
            assert view.busy == 3 and view.mine == 3
            assert [r.busy for r in routes] == [0, 1, 2]  # as counted when each was chosen
            sent = [
                asyncio.create_task(
                    serve_request(
                        nc, r.subject, make_request(f"mine-{i}", CONVERSATION_A, max_tokens=60)
                    )
                )
                for i, r in enumerate(routes)
            ]
            await asyncio.sleep(0.5)  # reports come and go: the three are counted once
            report = router.workers["w1"].load
            assert report is not None and report.in_flight == 3
            assert (view.mine, view.others, view.busy) == (3, 0, 3)
            # Another publisher's request shows up as the worker's others.
            long = make_request("other-long", CONVERSATION_B, max_tokens=60)
            running = asyncio.create_task(serve_request(other, subjects.instance("w1"), long))
            await until(lambda: view.others == 1)
            assert view.busy == 4
            await asyncio.gather(running, *sent)
            for route in routes:
                router.release(route)
            router.release(routes[0])  # one release too many changes nothing
            await until(lambda: view.others == 0)
            assert (view.mine, view.busy) == (0, 0)
        await other.close()


class FlakySource:
    """An engine event source whose first reading fails after one batch."""

    block_size = BLOCK

    def __init__(self) -> None:
        self.readings = 0

    async def batches(self) -> AsyncIterator[list[KvEvent]]:
        self.readings += 1
        yield [BlocksStored([self.readings], None, SYSTEM[:BLOCK])]
        if self.readings == 1:
            raise RuntimeError("the engine's event socket broke")
        await asyncio.Event().wait()


async def test_a_failing_event_source_is_read_again_and_the_picture_cleared(nats_server):
    subjects = Subjects("kvflaky", "fake", "generate")
    nc = await nats.connect(nats_server.url)
    events = await nc.subscribe(subjects.kv("events", "w1"))
    engine = PacedFakeEngine(step_s=0.01)
    publisher = KvPublisher(nc, subjects, "w1", engine, FlakySource(), lambda: (0, None, False))
    await publisher.start()
    try:
        seen = [BATCH_DECODER.decode((await events.next_msg(timeout=5)).data) for _ in range(3)]
        assert [b.seq for b in seen] == [0, 1, 2]
        assert seen[0].events == [BlocksStored([1], None, SYSTEM[:BLOCK])]
        assert seen[1].events == [AllCleared()]  # what the broken reading changed is unknown
        assert seen[2].events == [BlocksStored([2], None, SYSTEM[:BLOCK])]
    finally:
        await publisher.stop()
        await nc.close()


async def test_a_route_to_a_worker_gone_meanwhile_falls_back_to_the_queue_group(nats_server):
    """A router's picture is up to a report old: a request sent to an instance nobody serves
    any more (NATS: no responders) goes to the queue group instead of failing."""
    subjects = Subjects("kvgone", "fake", "generate")
    async with fleet(nats_server.url, subjects) as start:
        await start("w1")
        nc = await nats.connect(nats_server.url)
        try:
            frames = [
                frame
                async for frame in generate(
                    nc, make_request("to-gone", CONVERSATION_A), subject=subjects.instance("gone")
                )
            ]
            assert frames[-1].finish_reason == "length" and not frames[-1].error
        finally:
            await nc.close()
