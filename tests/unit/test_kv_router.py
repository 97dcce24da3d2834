"""The KV router (worker/client/router.py) without a server: load reports and event batches
(messages/kv.py) handed to its subscription callbacks as a connection would, snapshots answered
by a stand-in for the one connection call it makes outside `start` (`request`).

Scoring (overlap against busy), its own count of requests, draining and full workers, the
processes of one engine routed as one, silent workers forgotten, and the resync rules: a gap, a
late start, a report naming a batch that never came, a restart (new epoch), a failed snapshot's
back-off. What the real server and fake engines show end to end: tests/integration/
test_kv_routing.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import nats.errors
import pytest

from messages.kv import (
    KV_ENCODER,
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
    LoadReport,
)
from messages.subjects import Subjects
from worker.client.library import WorkerInstance
from worker.client.router import EngineView, KvRouter, Route, WorkerView

SUBJECTS = Subjects("unit", "vllm", "generate")
BLOCK = 4
SYSTEM = list(range(100, 116))  # 4 blocks
CHAT_A = SYSTEM + list(range(200, 208))  # 6 blocks
CHAT_B = SYSTEM + list(range(300, 308))


@dataclass
class Msg:
    """What a subscription callback is handed: the subject and the payload."""

    subject: str
    data: bytes


class Connection:
    """The router's connection as `route` and the callbacks use it: `request` for snapshots,
    answered from `snapshots` (each instance's list is answered in turn, the last one again),
    or like NATS with nobody answering. While `gate` is set and not open, answers wait."""

    def __init__(self) -> None:
        self.snapshots: dict[str, list[KvSnapshot]] = {}
        self.asked: list[str] = []
        self.gate: asyncio.Event | None = None

    async def request(self, subject: str, payload: bytes, timeout: float) -> Msg:
        self.asked.append(subject)
        if self.gate is not None:
            await self.gate.wait()
        answers = self.snapshots.get(subject.rsplit(".", 1)[1])
        if not answers:
            raise nats.errors.NoRespondersError
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        return Msg(subject, KV_ENCODER.encode(answer))


def router_on(connection: Connection | None = None, **settings: Any) -> KvRouter:
    router = KvRouter(connection or Connection(), SUBJECTS, **settings)  # type: ignore[arg-type]
    router._rng.seed(1)
    return router


async def report(
    router: KvRouter,
    instance_id: str,
    *,
    epoch: str = "e1",
    in_flight: int = 0,
    max_concurrency: int | None = None,
    draining: bool = False,
    kv_seq: int = -1,
    engine_id: str | None = None,
    adapters: list[str] | None = None,
) -> None:
    load = LoadReport(
        instance_id,
        epoch,
        in_flight,
        max_concurrency,
        draining,
        kv_seq,
        engine_id=engine_id,
        adapters=adapters,
    )
    await router._on_load(Msg(SUBJECTS.kv("load", instance_id), KV_ENCODER.encode(load)))


async def batch(
    router: KvRouter,
    instance_id: str,
    seq: int,
    *events: KvEvent,
    epoch: str = "e1",
    block_size: int = BLOCK,
) -> None:
    sent = KvEventBatch(instance_id, epoch, seq, block_size, list(events))
    await router._on_events(Msg(SUBJECTS.kv("events", instance_id), KV_ENCODER.encode(sent)))


def stored(tokens: list[int], first_hash: int, parent: int | None = None) -> BlocksStored:
    """The full blocks of `tokens` as one event, hashed first_hash, first_hash + 1, …"""
    count = len(tokens) // BLOCK
    return BlocksStored(list(range(first_hash, first_hash + count)), parent, tokens)


async def settled(router: KvRouter) -> None:
    """Waits for the snapshots the router started."""
    await asyncio.wait_for(asyncio.gather(*router._tasks), 5)


def overlap(router: KvRouter, tokens: list[int]) -> Route:
    """A route, released at once (so routes do not count against each other)."""
    route = router.route(tokens)
    router.release(route)
    return route


# --- settings and the views --------------------------------------------------------------


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode 'round-robin' must be one of"):
        router_on(mode="round-robin")


async def test_the_queue_mode_always_answers_the_queue_group() -> None:
    router = router_on(mode="queue")
    await router.start()  # subscribes to nothing: the stand-in connection has no subscribe
    await report(router, "w1")
    assert router.route(CHAT_A) == Route(None)


def test_a_worker_views_engine_serving_and_full_come_from_its_last_report() -> None:
    view = WorkerView("p0", "e1", 0.0)
    assert (view.engine_id, view.serving, view.full) == ("p0", False, False)
    view.load = LoadReport("p0", "e1", 2, 2, False, -1, engine_id="eng")
    assert (view.engine_id, view.serving, view.full) == ("eng", True, True)
    view.load = LoadReport("p0", "e1", 5, None, True, -1)
    assert (view.engine_id, view.serving, view.full) == ("p0", False, False)
    assert EngineView("eng", mine=2, others=3).busy == 5


async def test_no_reported_engine_means_the_queue_group() -> None:
    router = router_on()
    assert router.route(CHAT_A) == Route(None)
    await batch(router, "w1", 0, stored(CHAT_A, 1))  # known by its events, not by a report
    assert router.route(CHAT_A) == Route(None)


async def test_bad_reports_and_batches_are_ignored() -> None:
    router = router_on()
    await router._on_load(Msg(SUBJECTS.kv("load", "w1"), b"\xc1"))
    await router._on_events(Msg(SUBJECTS.kv("events", "w1"), KV_ENCODER.encode({"seq": "x"})))
    assert router.workers == {} and router.route(CHAT_A) == Route(None)


# --- scoring -----------------------------------------------------------------------------


async def test_least_busy_routes_to_the_engine_with_fewest_requests() -> None:
    router = router_on(mode="least-busy")
    await report(router, "w1", in_flight=3)
    await report(router, "w2", in_flight=1)
    route = router.route(CHAT_A)
    assert route == Route("unit.vllm.generate.w2", "w2", 0, 1)


async def test_this_routers_own_requests_count_until_released() -> None:
    router = router_on(mode="least-busy")
    await report(router, "w1")
    await report(router, "w2")
    first = router.route(CHAT_A)
    second = router.route(CHAT_A)
    assert {first.instance_id, second.instance_id} == {"w1", "w2"}
    assert second.busy == 0
    router.release(first)
    third = router.route(CHAT_A)
    assert third.instance_id == first.instance_id  # 0 against the other's 1
    router.release(third)
    router.release(third)  # twice: the count does not go below zero
    assert router.engines[first.instance_id].mine == 0
    assert router.engines[second.instance_id].mine == 1


async def test_a_report_counts_the_requests_of_other_publishers() -> None:
    router = router_on(mode="least-busy")
    await report(router, "w1")
    router.route(CHAT_A)  # one of this router's, on its way
    await report(router, "w1", in_flight=3)  # that one and two of others
    engine = router.engines["w1"]
    assert (engine.mine, engine.others, engine.busy) == (1, 2, 3)
    await report(router, "w1", in_flight=0)  # the report came before ours arrived
    assert (engine.mine, engine.others) == (1, 0)


async def test_kv_routing_prefers_the_cached_prefix_weighed_against_load() -> None:
    router = router_on()
    await report(router, "w1", in_flight=2)
    await report(router, "w2")
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    route = overlap(router, CHAT_A)
    assert (route.instance_id, route.overlap_blocks, route.busy) == ("w1", 6, 2)  # 6 - 2 > 0
    assert overlap(router, CHAT_B).overlap_blocks == 4  # the shared system prompt
    heavy = router_on(load_weight=4.0)
    await report(heavy, "w1", in_flight=2)
    await report(heavy, "w2")
    await batch(heavy, "w1", 0, stored(CHAT_A, 1))
    assert overlap(heavy, CHAT_A).instance_id == "w2"  # 6 - 8 < 0


async def test_only_the_leading_blocks_held_count() -> None:
    router = router_on()
    await report(router, "w1")
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    diverged = CHAT_A[:8] + [999] + CHAT_A[9:]  # block 2 differs, blocks 3.. are the same
    assert overlap(router, diverged).overlap_blocks == 2
    assert overlap(router, CHAT_A[:7]).overlap_blocks == 1  # a partial block is never cached


async def test_the_least_busy_mode_ignores_events() -> None:
    router = router_on(mode="least-busy")
    await report(router, "w1", in_flight=1)
    await report(router, "w2")
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    assert router.workers["w1"].index is None
    assert overlap(router, CHAT_A) == Route("unit.vllm.generate.w2", "w2", 0, 0)


async def test_ties_are_broken_at_random() -> None:
    """Routers that do not coordinate must not all pick the same engine."""
    router = router_on(mode="least-busy")
    for name in ("w1", "w2", "w3"):
        await report(router, name)
    chosen = {overlap(router, CHAT_A).instance_id for _ in range(60)}
    assert chosen == {"w1", "w2", "w3"}


# --- who may take a request ---------------------------------------------------------------


async def test_a_draining_or_full_worker_is_never_chosen() -> None:
    router = router_on()
    await report(router, "w1", draining=True)
    await report(router, "w2", in_flight=2, max_concurrency=2)
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    await batch(router, "w2", 0, stored(CHAT_A, 1))
    assert router.route(CHAT_A) == Route(None)
    await report(router, "w2", in_flight=1, max_concurrency=2)
    assert overlap(router, CHAT_A).instance_id == "w2"


async def test_this_routers_count_keeps_an_engine_under_its_limit_between_reports() -> None:
    router = router_on()
    await report(router, "w1", max_concurrency=2)
    routes = [router.route(CHAT_A), router.route(CHAT_A)]
    assert [r.instance_id for r in routes] == ["w1", "w1"]
    assert router.route(CHAT_A) == Route(None)
    router.release(routes[0])
    assert router.route(CHAT_A).instance_id == "w1"


async def test_the_processes_of_one_engine_are_routed_to_as_one() -> None:
    router = router_on()
    await report(router, "p0", in_flight=1, max_concurrency=2, engine_id="eng")
    await report(router, "p1", in_flight=1, max_concurrency=2, engine_id="eng")
    assert set(router.engines) == {"eng"}
    route = overlap(router, CHAT_A)
    assert route == Route("unit.vllm.generate.eng", "eng", 0, 2)  # their shared subject
    # One process full, the other not: that one's own subject.
    await report(router, "p0", in_flight=2, max_concurrency=2, engine_id="eng")
    await report(router, "p1", in_flight=0, max_concurrency=2, engine_id="eng")
    route = overlap(router, CHAT_A)
    assert (route.subject, route.instance_id) == ("unit.vllm.generate.p1", "eng")
    # One draining keeps the whole engine out (its processes drain together).
    await report(router, "p1", draining=True, max_concurrency=2, engine_id="eng")
    assert router.route(CHAT_A) == Route(None)


async def test_the_processes_overlap_is_the_best_any_of_them_holds() -> None:
    router = router_on()
    await report(router, "p0", engine_id="eng")
    await report(router, "p1", engine_id="eng")
    await report(router, "w2")
    await batch(router, "p0", 0, stored(CHAT_A, 1))
    route = overlap(router, CHAT_A)
    assert (route.instance_id, route.overlap_blocks) == ("eng", 6)


async def test_a_silent_worker_is_forgotten_with_its_engine() -> None:
    router = router_on(stale_s=0.05)
    await report(router, "w1")
    assert router.route(CHAT_A).instance_id == "w1"
    await asyncio.sleep(0.1)
    assert router.route(CHAT_A) == Route(None)
    assert router.workers == {} and router.engines == {}


# --- the index and its resync rules ------------------------------------------------------


async def test_batches_apply_in_order_and_a_replayed_batch_is_ignored() -> None:
    router = router_on()
    await report(router, "w1")
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    await batch(router, "w1", 1, BlocksRemoved([5]))  # CHAT_A's block 4
    assert overlap(router, CHAT_A).overlap_blocks == 4
    await batch(router, "w1", 0, stored(CHAT_A, 1))  # seen already
    assert overlap(router, CHAT_A).overlap_blocks == 4
    await batch(router, "w1", 2, AllCleared())
    assert overlap(router, CHAT_A).overlap_blocks == 0
    assert router.workers["w1"].seq == 2 and router.resyncs == 0


async def test_a_block_size_change_starts_the_index_over() -> None:
    router = router_on()
    await report(router, "w1")
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    await batch(router, "w1", 1, BlocksStored([50], None, CHAT_B[:8]), block_size=8)
    index = router.workers["w1"].index
    assert index is not None and index.block_size == 8 and len(index) == 1


async def test_a_restart_voids_the_index() -> None:
    router = router_on()
    await report(router, "w1")
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    await batch(router, "w1", 0, stored(CHAT_B, 1), epoch="e2")  # a new epoch's first batch
    view = router.workers["w1"]
    assert view.epoch == "e2" and view.load is None  # not routed to until it reports
    assert router.route(CHAT_A) == Route(None)
    await report(router, "w1", epoch="e2", kv_seq=0)
    assert overlap(router, CHAT_A).overlap_blocks == 4  # CHAT_B's system prompt only
    assert overlap(router, CHAT_B).overlap_blocks == 6


async def test_a_gap_resyncs_from_a_snapshot_and_applies_what_came_meanwhile() -> None:
    connection = Connection()
    connection.gate = asyncio.Event()
    connection.snapshots["w1"] = [KvSnapshot("w1", "e1", 5, BLOCK, [stored(SYSTEM, 1)])]
    router = router_on(connection)
    await report(router, "w1")
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    await batch(router, "w1", 6, stored(CHAT_B[16:], 30, parent=4))  # 1..5 were lost
    await batch(router, "w1", 7, BlocksRemoved([31]))
    await batch(router, "w1", 8, stored(CHAT_A[16:], 40, parent=4))
    await asyncio.sleep(0)  # the snapshot's task starts
    assert connection.asked == [SUBJECTS.kv("snapshot", "w1")]  # one snapshot, not one a batch
    assert router.workers["w1"].syncing
    assert overlap(router, CHAT_A).overlap_blocks == 0  # an index being rebuilt is not used
    connection.gate.set()
    await settled(router)
    view = router.workers["w1"]
    assert (view.seq, view.syncing, view.buffered, router.resyncs) == (8, False, [], 1)
    # The snapshot's 4 system blocks (hashes 1-4); batch 6 stored CHAT_B's 2 blocks after them
    # (30, 31), 7 removed the last (31), 8 stored CHAT_A's 2 after them (40, 41).
    assert overlap(router, CHAT_B).overlap_blocks == 5
    assert overlap(router, CHAT_A).overlap_blocks == 6


async def test_a_worker_first_heard_after_its_first_batch_is_snapshotted() -> None:
    connection = Connection()
    connection.snapshots["w1"] = [KvSnapshot("w1", "e1", 3, BLOCK, [stored(CHAT_A, 1)])]
    router = router_on(connection)
    await batch(router, "w1", 4, BlocksRemoved([6]))  # a router started late
    await report(router, "w1", kv_seq=4)
    await settled(router)
    assert connection.asked == [SUBJECTS.kv("snapshot", "w1")]
    assert router.workers["w1"].seq == 4
    assert overlap(router, CHAT_A).overlap_blocks == 5


async def test_a_report_naming_a_batch_still_missing_at_the_next_report_resyncs() -> None:
    connection = Connection()
    connection.snapshots["w1"] = [KvSnapshot("w1", "e1", 2, BLOCK, [stored(CHAT_B, 1)])]
    router = router_on(connection)
    await report(router, "w1", kv_seq=0)
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    await report(router, "w1", kv_seq=1)  # batch 1 may still be on its way
    await batch(router, "w1", 1, AllCleared())
    await report(router, "w1", kv_seq=2)  # it came; now 2 is named
    assert connection.asked == []
    await report(router, "w1", kv_seq=2)  # 2 never came: it was lost
    await settled(router)
    assert connection.asked == [SUBJECTS.kv("snapshot", "w1")]
    assert router.workers["w1"].seq == 2 and overlap(router, CHAT_B).overlap_blocks == 6


async def test_a_snapshot_older_than_a_buffered_batch_is_asked_again() -> None:
    connection = Connection()
    connection.gate = asyncio.Event()
    connection.snapshots["w1"] = [
        KvSnapshot("w1", "e1", 5, BLOCK, [stored(SYSTEM, 1)]),
        KvSnapshot("w1", "e1", 9, BLOCK, [stored(CHAT_A, 1)]),
    ]
    router = router_on(connection)
    await report(router, "w1")
    await batch(router, "w1", 0, stored(SYSTEM, 1))
    await batch(router, "w1", 9, BlocksRemoved([99]))  # 1..8 lost; the first answer has 1..5
    connection.gate.set()
    for _ in range(3):
        await settled(router)
    assert len(connection.asked) == 2 and router.resyncs == 2
    view = router.workers["w1"]
    assert (view.seq, view.syncing) == (9, False)
    assert overlap(router, CHAT_A).overlap_blocks == 6


async def test_a_failed_snapshot_routes_by_load_and_backs_off() -> None:
    connection = Connection()  # nobody answers snapshots
    router = router_on(connection)
    await report(router, "w1", kv_seq=3)
    await batch(router, "w1", 0, stored(CHAT_A, 1))
    await batch(router, "w1", 5, AllCleared())  # a gap: snapshot, which fails
    await settled(router)
    view = router.workers["w1"]
    assert connection.asked == [SUBJECTS.kv("snapshot", "w1")]
    assert (view.index, view.syncing, view.backoff) == (None, False, 2.0)
    assert view.seq == 3  # what its report named: older batches are not asked for again
    await batch(router, "w1", 9, AllCleared())  # another gap, inside the back-off
    await settled(router)
    assert len(connection.asked) == 1
    route = overlap(router, CHAT_A)
    assert (route.instance_id, route.overlap_blocks) == ("w1", 0)


async def test_an_idle_worker_whose_snapshot_failed_is_asked_again_by_its_reports() -> None:
    connection = Connection()  # nobody answers snapshots, at first
    router = router_on(connection)
    await report(router, "w1", kv_seq=3)  # batches 0..3 came before this router
    await settled(router)
    view = router.workers["w1"]
    assert connection.asked == [SUBJECTS.kv("snapshot", "w1")] and view.index is None
    await report(router, "w1", kv_seq=3)  # idle: no batch more; inside the back-off
    await settled(router)
    assert len(connection.asked) == 1
    connection.snapshots["w1"] = [KvSnapshot("w1", "e1", 3, BLOCK, [stored(CHAT_A, 1)])]
    view.retry_at = 0.0  # the back-off passed
    await report(router, "w1", kv_seq=3)
    await settled(router)
    assert len(connection.asked) == 2 and view.seq == 3
    assert overlap(router, CHAT_A).overlap_blocks == 6
    await report(router, "w1", kv_seq=3)  # with an index, a report naming no new batch asks nothing
    await settled(router)
    assert len(connection.asked) == 2


async def test_a_discovered_worker_without_snapshots_is_routed_by_load() -> None:
    router = router_on()
    found = WorkerInstance("w1", SUBJECTS.instance("w1"), 1, 4, engine_id=None)
    await router._snapshot("w1", found)  # what start() does for a worker found by discovery
    view = router.workers["w1"]
    assert view.load is not None and (view.load.in_flight, view.load.max_concurrency) == (1, 4)
    assert view.index is None and view.retry_at > 0
    route = overlap(router, CHAT_A)
    assert (route.subject, route.instance_id, route.overlap_blocks) == (
        "unit.vllm.generate.w1",
        "w1",
        0,
    )
    await report(router, "w1", epoch="e3", in_flight=2, max_concurrency=4)
    assert router.workers["w1"].epoch == "e3"  # its first report gives it its epoch
    assert overlap(router, CHAT_A).busy == 2


async def test_a_discovered_workers_in_flight_counts_until_its_first_report() -> None:
    router = router_on()
    found = WorkerInstance("w1", SUBJECTS.instance("w1"), 4, 4, engine_id=None)
    await router._snapshot("w1", found)
    assert router.workers["w1"].full
    assert router.route(CHAT_A) == Route(None)


async def test_a_discovered_workers_snapshot_seeds_its_index() -> None:
    connection = Connection()
    connection.snapshots["w1"] = [KvSnapshot("w1", "e7", 4, BLOCK, [stored(CHAT_A, 1)])]
    router = router_on(connection)
    await router._snapshot("w1", WorkerInstance("w1", SUBJECTS.instance("w1"), 0, None))
    view = router.workers["w1"]
    assert (view.epoch, view.seq, router.resyncs) == ("e7", 4, 1)
    assert view.load is not None and view.load.kv_seq == 4
    assert overlap(router, CHAT_A).overlap_blocks == 6
    await batch(router, "w1", 5, BlocksRemoved([1]), epoch="e7")  # the next batch applies
    assert overlap(router, CHAT_A).overlap_blocks == 0


async def test_start_snapshots_a_process_whose_report_named_no_batch_during_discovery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A report of kv_seq -1 (no batch yet) that lands in the discovery window makes the process
    known without a snapshot; until it publishes a batch nothing else would ask for one."""
    import worker.client.library as library

    class Subscribing(Connection):
        async def subscribe(self, subject: str, cb: Any) -> None:
            return None

    connection = Subscribing()
    connection.snapshots["p0"] = [KvSnapshot("p0", "e1", -1, BLOCK, [])]
    router = router_on(connection)

    async def discover(nc: Any, subject: str, *, window: float) -> list[WorkerInstance]:
        await report(router, "p0", kv_seq=-1, engine_id="eng")  # inside the window
        await report(router, "p1", kv_seq=-1, engine_id="eng")
        return [
            WorkerInstance("p0", SUBJECTS.instance("p0"), 0, None, "eng"),
            WorkerInstance("p1", SUBJECTS.instance("p1"), 0, None, "eng", kv_snapshots=False),
        ]

    monkeypatch.setattr(library, "discover_workers", discover)
    await router.start()
    assert connection.asked == [SUBJECTS.kv("snapshot", "p0")]  # not p1: it reports load only
    view = router.workers["p0"]
    assert view.index is not None and (view.seq, view.syncing) == (-1, False)
    assert router.workers["p1"].index is None


async def test_an_adapters_requests_go_only_to_workers_that_report_holding_it() -> None:
    """LoadReport `adapters`: a request naming a LoRA adapter goes to a worker that holds it,
    busier or not; one nobody holds goes to the queue group (a worker without it refuses
    `model_not_found`, retried elsewhere); the base model's may go anywhere."""
    router = router_on()
    await report(router, "w-lora", in_flight=5, adapters=["tiny-lora"])
    await report(router, "w-base", in_flight=0, adapters=[])
    assert overlap(router, CHAT_A).instance_id == "w-base"  # the least busy, for the base model
    held = router.route(CHAT_A, "tiny-lora")
    assert (held.subject, held.instance_id) == (SUBJECTS.instance("w-lora"), "w-lora")
    router.release(held)
    assert router.route(CHAT_A, "nobody-has-it") == Route(None)
    await report(router, "w-base", in_flight=0, adapters=["tiny-lora"])  # loaded there too
    assert overlap_for(router, CHAT_A, "tiny-lora").instance_id == "w-base"


def overlap_for(router: KvRouter, tokens: list[int], adapter: str) -> Route:
    route = router.route(tokens, adapter)
    router.release(route)
    return route
