"""KV-cache-aware routing for a publisher: send each request to the worker that already holds the
longest prefix of its prompt, weighed against how busy each worker is.

The router listens to every worker's KV events and load reports (messages/kv.py) and keeps, per
live worker instance, a `PrefixIndex` of the blocks it holds. Per request it scores each worker
that is neither draining nor full: `overlap_blocks - load_weight * busy`, and picks the best
(ties at random, so routers that do not coordinate do not herd). `busy` is exact for this
router's own requests (counted from `route` until the caller's `release`) plus the worker's other
requests as of its last load report; a report's count alone is a second stale, which made the
router herd (bench/RESULTS.md, P10). The answer is the worker's instance subject, or None for the
queue group when it knows no worker that may take the request.

It stays right without coordination: a worker is learned from discovery at start and from its
reports after; a new `epoch` (a restart) or an `AllCleared` voids its index; a batch whose `seq`
is not the next one, or a batch that two load reports in a row name and that has not come (the
last batch was lost), means something was lost and the index is rebuilt from a snapshot
(events arriving meanwhile are kept and applied after it); a worker silent for `stale_s` is
forgotten. When every known worker is a process of one engine core (their load reports name
one `engine_id`: `--worker-processes`), they share one cache and the router leaves them to the
queue group. Modes: "kv" (the above), "least-busy" (the load part alone), "queue" (always the
queue group), for comparison (bench/p10_kv_routing.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from messages.kv import (
    BATCH_DECODER,
    LOAD_DECODER,
    SNAPSHOT_DECODER,
    KvEventBatch,
    LoadReport,
)
from messages.subjects import Subjects
from worker.client.prefix_index import PrefixIndex, prefix_keys

if TYPE_CHECKING:
    from worker.client.library import WorkerInstance

log = logging.getLogger(__name__)

RoutingMode = Literal["kv", "least-busy", "queue"]
MAX_SNAPSHOT_BACKOFF_S = 8.0
ROUTING_MODES: tuple[RoutingMode, ...] = ("kv", "least-busy", "queue")


@dataclass
class WorkerView:
    """What the router knows of one worker instance."""

    instance_id: str
    epoch: str
    last_heard: float
    load: LoadReport | None = None
    index: PrefixIndex | None = None
    seq: int = -1
    """The last event batch applied to `index`."""
    syncing: bool = False
    buffered: list[KvEventBatch] = field(default_factory=list)
    behind: int = -1
    """A batch a load report named that was not applied then: resync if the next report finds
    it still missing (a report can be handled before the batch, which came first on the wire)."""
    retry_at: float = 0.0
    backoff: float = 1.0
    """After a failed snapshot, none is asked before `retry_at`; the wait doubles per failure."""
    mine: int = 0
    """This router's requests on it that have not ended (`route` to `release`)."""
    others: int = 0
    """The rest of its in-flight requests as of its last load report (other publishers')."""

    @property
    def busy(self) -> int:
        return self.mine + self.others

    def may_take(self) -> bool:
        load = self.load
        if load is None or load.draining:
            return False
        return load.max_concurrency is None or self.busy < load.max_concurrency


@dataclass(frozen=True)
class Route:
    subject: str | None
    """The chosen worker's instance subject; None: the queue group."""
    instance_id: str | None = None
    overlap_blocks: int = 0
    busy: int = 0
    """The chosen worker's in-flight requests as this router counted them, this one excluded."""


class KvRouter:
    def __init__(
        self,
        nc: NATS,
        subjects: Subjects | None = None,
        *,
        mode: RoutingMode = "kv",
        load_weight: float = 1.0,
        stale_s: float = 3.5,
        snapshot_timeout_s: float = 2.0,
    ) -> None:
        if mode not in ROUTING_MODES:
            raise ValueError(f"mode {mode!r} must be one of {ROUTING_MODES}")
        self.nc = nc
        self.subjects = subjects or Subjects()
        self.mode = mode
        self.load_weight = load_weight
        self.stale_s = stale_s
        self.snapshot_timeout_s = snapshot_timeout_s
        self.workers: dict[str, WorkerView] = {}
        self.resyncs = 0
        """Snapshots fetched after a restart, a gap or a late start (for tests and logs)."""
        self._subscriptions: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._rng = random.Random()

    async def start(self, *, discover_s: float = 0.25) -> None:
        """Subscribes to every worker's events and load reports, then learns the workers that
        answer discovery within `discover_s` and fetches their snapshots, so routing is right
        from the first request, even for a router started long after the workers."""
        from worker.client.library import discover_workers

        if self.mode == "queue":
            return
        self._subscriptions = [
            await self.nc.subscribe(self.subjects.kv("events"), cb=self._on_events),
            await self.nc.subscribe(self.subjects.kv("load"), cb=self._on_load),
        ]
        if discover_s > 0:
            found = await discover_workers(self.nc, self.subjects.generate, window=discover_s)
            # A worker whose report came during discovery has its snapshot on the way already.
            unknown = [w for w in found if w.instance_id not in self.workers]
            await asyncio.gather(*(self._snapshot(w.instance_id, w) for w in unknown))
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            try:
                await subscription.unsubscribe()
            except Exception as error:  # the connection is closed already
                log.debug("router unsubscribe: %r", error)
        self._subscriptions = []
        for task in list(self._tasks):
            task.cancel()

    # --- routing -------------------------------------------------------------------------

    def route(self, token_ids: Sequence[int]) -> Route:
        if self.mode == "queue":
            return Route(None)
        now = time.monotonic()
        silent = [i for i, v in self.workers.items() if now - v.last_heard > self.stale_s]
        for instance_id in silent:
            log.info("router: worker %s went silent; forgotten", instance_id)
            del self.workers[instance_id]
        candidates = [v for v in self.workers.values() if v.may_take()]
        if not candidates or self._one_engine():
            return Route(None)
        keys_by_size: dict[int, list[int]] = {}
        best: list[tuple[WorkerView, int]] = []
        best_score = float("-inf")
        for view in candidates:
            overlap = 0
            if self.mode == "kv" and view.index is not None and not view.syncing:
                size = view.index.block_size
                if size not in keys_by_size:
                    keys_by_size[size] = prefix_keys(token_ids, size)
                overlap = view.index.overlap(keys_by_size[size])
            score = overlap - self.load_weight * view.busy
            if score > best_score:
                best, best_score = [(view, overlap)], score
            elif score == best_score:
                best.append((view, overlap))
        view, overlap = self._rng.choice(best)
        busy = view.busy
        view.mine += 1
        return Route(self.subjects.instance(view.instance_id), view.instance_id, overlap, busy)

    def _one_engine(self) -> bool:
        """Every known worker is a process of one engine core (`--worker-processes`): they hold
        one KV cache, so no choice among them can hit more of it, and the queue group spreads
        them evenly, where this router's per-process load picture did not (bench/RESULTS.md,
        P8 sixth run: one of four processes got ~60% of the in-flight requests on the GPU)."""
        engines = {v.load.engine_id if v.load else None for v in self.workers.values()}
        return bool(self.workers) and len(engines) == 1 and None not in engines

    def release(self, route: Route) -> None:
        """The request `route` sent has ended (its last frame, an error, or abandoned): call it
        once per routed request, so the load this router counts is exact."""
        view = self.workers.get(route.instance_id) if route.instance_id else None
        if view is not None and view.mine > 0:
            view.mine -= 1

    # --- what the workers say ------------------------------------------------------------

    def _view(self, instance_id: str, epoch: str, *, resync: bool = True) -> WorkerView:
        view = self.workers.get(instance_id)
        if view is None or view.epoch != epoch:
            if view is not None:
                log.info("router: worker %s restarted; its index is rebuilt", instance_id)
            view = WorkerView(instance_id, epoch, time.monotonic())
            self.workers[instance_id] = view
            if resync and self.mode == "kv":
                self._resync(view)
        return view

    async def _on_load(self, msg: Msg) -> None:
        try:
            report = LOAD_DECODER.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("router: ignored a bad load report on %s: %s", msg.subject, error)
            return
        view = self._view(report.instance_id, report.epoch)
        view.load = report
        view.last_heard = time.monotonic()
        # Its in-flight count includes this router's requests that reached it.
        view.others = max(0, report.in_flight - view.mine)
        if self.mode != "kv" or view.syncing:
            return
        if view.seq < view.behind:
            log.info(
                "router: worker %s published batch %d, last seen %d: resync",
                view.instance_id,
                view.behind,
                view.seq,
            )
            view.behind = -1
            self._resync(view)
        elif report.kv_seq > view.seq:
            view.behind = report.kv_seq

    async def _on_events(self, msg: Msg) -> None:
        if self.mode != "kv":
            return
        try:
            batch = BATCH_DECODER.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("router: ignored a bad KV event batch on %s: %s", msg.subject, error)
            return
        view = self._view(batch.instance_id, batch.epoch)
        view.last_heard = time.monotonic()
        if view.syncing:
            view.buffered.append(batch)
        elif batch.seq <= view.seq:
            return  # already applied
        elif batch.seq != view.seq + 1 or view.index is None:
            log.info(
                "router: worker %s batch %d after %d: resync", view.instance_id, batch.seq, view.seq
            )
            if self._resync(view):
                view.buffered.append(batch)
        else:
            self._apply(view, batch)

    def _apply(self, view: WorkerView, batch: KvEventBatch) -> None:
        if view.index is None or view.index.block_size != batch.block_size:
            view.index = PrefixIndex(batch.block_size)
        view.index.apply(batch.events)
        view.seq = batch.seq

    def _resync(self, view: WorkerView) -> bool:
        """Starts a snapshot unless one runs, or a failed one's back-off has not passed (a worker
        too busy to answer is not asked again at its batch rate). True if one runs now."""
        if view.syncing:
            return True
        if time.monotonic() < view.retry_at:
            return False
        view.syncing = True
        task = asyncio.create_task(self._snapshot(view.instance_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _snapshot(self, instance_id: str, found: WorkerInstance | None = None) -> None:
        """Rebuilds one worker's index from its snapshot plus the batches that came after.
        `found`: the worker as discovery saw it (its load until its first report)."""
        view = self.workers.get(instance_id)
        if view is not None:
            view.syncing = True
        try:
            msg = await self.nc.request(
                self.subjects.kv("snapshot", instance_id), b"", timeout=self.snapshot_timeout_s
            )
            snapshot = SNAPSHOT_DECODER.decode(msg.data)
        except Exception as error:  # timeout, no responders (KV events off), a bad answer
            log.info(
                "router: no KV snapshot from %s (%r): routing it by load only", instance_id, error
            )
            if view is not None:
                view.syncing = False
                view.index = None
                view.buffered.clear()
                view.seq = max(view.seq, view.load.kv_seq if view.load else -1)
                view.retry_at = time.monotonic() + view.backoff
                view.backoff = min(view.backoff * 2, MAX_SNAPSHOT_BACKOFF_S)
            return
        self.resyncs += 1
        view = self._view(snapshot.instance_id, snapshot.epoch, resync=False)
        if view.load is None and found is not None:
            view.load = LoadReport(
                instance_id,
                snapshot.epoch,
                found.in_flight,
                found.max_concurrency,
                False,
                snapshot.seq,
                engine_id=found.engine_id,
            )
        index = PrefixIndex(snapshot.block_size)
        index.apply(snapshot.blocks)
        view.index, view.seq, view.backoff = index, snapshot.seq, 1.0
        pending, view.buffered = sorted(view.buffered, key=lambda b: b.seq), []
        view.syncing = False
        for batch in pending:
            if batch.epoch != view.epoch or batch.seq <= view.seq:
                continue
            if batch.seq != view.seq + 1:
                view.buffered = [b for b in pending if b.seq > view.seq]
                self._resync(view)
                return
            self._apply(view, batch)
