"""The worker's side of KV-aware routing: its cache events, snapshots and load on NATS.

`KvPublisher` reads the engine's cache events (`Engine.kv_events()`), keeps a mirror of the blocks
the engine holds, republishes every batch on `Subjects.kv("events", instance_id)` with a gapless
`seq`, answers `Subjects.kv("snapshot", instance_id)` with the mirror, and publishes a
`LoadReport` every `interval_s` (and at once when draining begins) on `Subjects.kv("load", ...)`.
Wire contract: messages/kv.py.

Invariants: the mirror is applied before a batch is published, and batches, snapshot answers and
load reports leave on one connection in order, so a snapshot answered after batch `seq` includes
it, and a load report's `kv_seq` never names a batch not yet sent. A snapshot larger than the
server's max_payload keeps the most recently stored chains that fit (the router then knows less,
never more, than the engine holds).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from messages.kv import (
    KV_ENCODER,
    AllCleared,
    BlockHash,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    KvEventBatch,
    KvSnapshot,
    LoadReport,
)
from messages.subjects import Subjects
from worker.engine.contract import Engine, KvEventSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Block:
    parent: BlockHash | None
    tokens: list[int]
    lora_name: str | None = None


class CacheMirror:
    """The blocks an engine holds, from its events, in the order they were stored."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[BlockHash, _Block] = {}

    def apply(self, events: list[KvEvent]) -> None:
        size = self.block_size
        for event in events:
            if isinstance(event, BlocksStored):
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * size : (i + 1) * size]
                    self.blocks.pop(block_hash, None)  # re-stored: it moves to the end
                    self.blocks[block_hash] = _Block(parent, tokens, event.lora_name)
                    parent = block_hash
            elif isinstance(event, BlocksRemoved):
                for block_hash in event.block_hashes:
                    self.blocks.pop(block_hash, None)
            elif isinstance(event, AllCleared):
                self.blocks.clear()

    def chains(self, newest: int | None = None) -> list[BlocksStored]:
        """Every block reachable from a first block, parents first, one event per block; with
        `newest`, only about that many of the most recently stored blocks and their parents."""
        blocks = self.blocks
        if newest is not None:
            keep: set[BlockHash] = set()
            for start in reversed(blocks):
                if len(keep) >= newest:
                    break
                walk: BlockHash | None = start
                while walk is not None and walk not in keep and walk in blocks:
                    keep.add(walk)
                    walk = blocks[walk].parent
            blocks = {h: b for h, b in blocks.items() if h in keep}
        children: dict[BlockHash | None, list[BlockHash]] = {}
        for block_hash, block in blocks.items():
            children.setdefault(block.parent, []).append(block_hash)
        ordered: list[BlocksStored] = []
        frontier = list(children.get(None, ()))
        while frontier:
            block_hash = frontier.pop()
            block = blocks[block_hash]
            ordered.append(BlocksStored([block_hash], block.parent, block.tokens, block.lora_name))
            frontier.extend(children.get(block_hash, ()))
        return ordered


class KvPublisher:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        instance_id: str,
        engine: Engine,
        source: KvEventSource | None,
        load: Callable[[], tuple[int, int | None, bool]],
        *,
        interval_s: float = 1.0,
        engine_id: str | None = None,
    ) -> None:
        """`load()`: (in_flight, max_concurrency, draining) of the worker process; `engine_id`:
        the engine core it shares with other processes (WorkerConfig.engine_id)."""
        self.nc = nc
        self.subjects = subjects
        self.instance_id = instance_id
        self.epoch = uuid.uuid4().hex[:12]
        self.engine = engine
        self.source = source
        self.mirror = CacheMirror(source.block_size) if source is not None else None
        self._load = load
        self.interval_s = interval_s
        self.engine_id = engine_id
        self.seq = -1
        self._tasks: list[asyncio.Task[None]] = []
        self._snapshot_subscription: Subscription | None = None

    async def start(self) -> None:
        if self.source is not None:
            subject = self.subjects.kv("snapshot", self.instance_id)
            self._snapshot_subscription = await self.nc.subscribe(subject, cb=self._on_snapshot)
            self._tasks.append(asyncio.create_task(self._forward(self.source)))
        self._tasks.append(asyncio.create_task(self._report_every()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._snapshot_subscription is not None:
            try:
                await self._snapshot_subscription.unsubscribe()
            except Exception as error:  # the connection is closed already
                log.debug("snapshot unsubscribe: %r", error)
            self._snapshot_subscription = None

    async def _forward(self, source: KvEventSource) -> None:
        """Until cancelled; a failing source is read again after a pause, its picture cleared
        (routers resync), so one bad moment does not end KV routing for the worker's life."""
        while True:
            try:
                await self._forward_once(source)
            except Exception:
                log.exception("KV events: reading the engine's events failed; again in 1 s")
                await asyncio.sleep(1.0)
                await self._publish([AllCleared()], source.block_size)

    async def _forward_once(self, source: KvEventSource) -> None:
        async for events in source.batches():
            await self._publish(events, source.block_size)

    async def _publish(self, events: list[KvEvent], block_size: int) -> None:
        assert self.mirror is not None
        subject = self.subjects.kv("events", self.instance_id)
        self.mirror.apply(events)
        self.seq += 1
        batch = KvEventBatch(self.instance_id, self.epoch, self.seq, block_size, events)
        try:
            await self.nc.publish(subject, KV_ENCODER.encode(batch))
        except Exception as error:  # disconnected: routers see the gap and resync
            log.info("KV event batch %d not published: %r", self.seq, error)

    async def _on_snapshot(self, msg: Msg) -> None:
        if not msg.reply or self.mirror is None:
            return
        mirror = self.mirror
        chains = mirror.chains()
        data = KV_ENCODER.encode(self._snapshot(chains))
        limit = max(self.nc.max_payload - 1024, 1024)
        while len(data) > limit and chains:
            newest = len(chains) * limit // len(data) * 9 // 10
            smaller = mirror.chains(newest) if newest > 0 else []
            if len(smaller) >= len(chains):
                # The newest block's own chain is too long alone: keep the start of the
                # parents-first order (still whole chains), so every pass shrinks.
                smaller = chains[:newest]
            chains = smaller
            data = KV_ENCODER.encode(self._snapshot(chains))
        if len(chains) < len(mirror.blocks):
            log.info("KV snapshot: %d of %d blocks fit", len(chains), len(mirror.blocks))
        await self.nc.publish(msg.reply, data)

    def _snapshot(self, chains: list[BlocksStored]) -> KvSnapshot:
        assert self.mirror is not None
        return KvSnapshot(self.instance_id, self.epoch, self.seq, self.mirror.block_size, chains)

    def report(self) -> LoadReport:
        in_flight, limit, draining = self._load()
        engine = self.engine.load()
        return LoadReport(
            self.instance_id,
            self.epoch,
            in_flight,
            limit,
            draining,
            self.seq,
            engine.running if engine else None,
            engine.waiting if engine else None,
            engine.kv_usage if engine else None,
            self.engine_id,
            sorted(admin.adapters()) if (admin := self.engine.admin) is not None else None,
        )

    async def publish_load(self) -> None:
        try:
            await self.nc.publish(
                self.subjects.kv("load", self.instance_id), KV_ENCODER.encode(self.report())
            )
        except Exception as error:  # disconnected: the next report goes after the reconnect
            log.debug("load report not published: %r", error)

    async def _report_every(self) -> None:
        while True:
            await self.publish_load()
            await asyncio.sleep(self.interval_s)
