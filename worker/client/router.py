"""KV-cache-aware routing for a publisher: send each request to the engine that already holds the
longest prefix of its prompt, weighed against how busy each engine is.

The router listens to every worker's KV events and load reports (messages/kv.py) and keeps, per
live worker instance, a `PrefixIndex` of the blocks it holds. It routes to engines, not to
processes: the instances whose reports name one `engine_id` (the processes of a worker started
with `--worker-processes`) share one engine core and one KV cache, so no choice among them can hit
more of it, while a choice among them by a load picture up to a report old can pile the in-flight
requests onto one of them; their own queue group spreads them. Per request it scores each
engine that may take it: `overlap_blocks - load_weight * busy`, and picks the best (ties at random,
so routers that do not coordinate do not herd). `busy` is exact for this router's own requests
(counted from `route` until the caller's `release`) plus the engine's other requests as of its
processes' last load reports; a report's count alone is up to a second stale, enough for
routers to herd onto one engine. The answer is the engine's subject: a one-process worker's
instance subject, or the subject every process of a multi-process worker shares in a queue group
of its own (the engine id's instance subject), or one of its processes' when some of them are
full; None, the queue group, when it knows no engine that may take the request.

It stays right without coordination: a worker is learned from discovery at start and from its
reports after; a new `epoch` (a restart) or an `AllCleared` voids its index; a batch whose `seq`
is not the next one, or a batch that two load reports in a row name and that has not come (the
last batch was lost), means something was lost and the index is rebuilt from a snapshot
(events arriving meanwhile are kept and applied after it); a worker silent for `stale_s` is
forgotten. Modes: "kv" (the above), "least-busy" (the load part alone), "queue" (always the queue
group), for comparison (bench/kv_routing.py).
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

    @property
    def engine_id(self) -> str:
        """The engine core it runs on: the one its processes share, or its own."""
        engine_id = self.load.engine_id if self.load is not None else None
        return engine_id or self.instance_id

    @property
    def serving(self) -> bool:
        return self.load is not None and not self.load.draining

    @property
    def full(self) -> bool:
        """At its own limit as of its last report."""
        load = self.load
        if load is None or load.max_concurrency is None:
            return False
        return load.in_flight >= load.max_concurrency


@dataclass
class EngineView:
    """One engine core's load as this router counts it, over all its processes."""

    engine_id: str
    mine: int = 0
    """This router's requests on it that have not ended (`route` to `release`)."""
    others: int = 0
    """The rest of its in-flight requests as of its processes' last load reports (other
    publishers')."""

    @property
    def busy(self) -> int:
        return self.mine + self.others


@dataclass(frozen=True)
class Route:
    subject: str | None
    """The chosen engine's subject (see the module's text); None: the queue group."""
    instance_id: str | None = None
    """The chosen engine's id: a one-process worker's instance id, a multi-process worker's
    engine id (the id its processes' ids extend)."""
    overlap_blocks: int = 0
    busy: int = 0
    """The chosen engine's in-flight requests as this router counted them, this one excluded."""


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
        self.engines: dict[str, EngineView] = {}
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
            # A worker whose report came during discovery is known already: a snapshot is on
            # the way if its report named a batch, none if it named none (kv_seq -1: no batch
            # yet), and no later report or batch asks for one until the worker publishes a batch.
            # So each one that answers snapshots and holds no index is asked now, as the unknown
            # ones are: where the reports fall against the window does not decide what `start`
            # leaves.
            unknown: list[WorkerInstance] = []
            for worker in found:
                view = self.workers.get(worker.instance_id)
                if view is None:
                    if worker.kv_snapshots:
                        unknown.append(worker)
                    else:
                        self._discovered(worker)
                elif worker.kv_snapshots and view.index is None and self.mode == "kv":
                    self._resync(view)  # none if one runs or a failed one's back-off holds
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

    def route(self, token_ids: Sequence[int], adapter: str | None = None) -> Route:
        """The engine for a prompt; `adapter`: a LoRA adapter the request names, which only
        engines that report holding it may take (none does: the queue group, where a worker
        without it refuses `model_not_found` and the client retries on the others)."""
        if self.mode == "queue":
            return Route(None)
        now = time.monotonic()
        silent = [i for i, v in self.workers.items() if now - v.last_heard > self.stale_s]
        for instance_id in silent:
            log.info("router: worker %s went silent; forgotten", instance_id)
            del self.workers[instance_id]
        processes: dict[str, list[WorkerView]] = {}
        for view in self.workers.values():
            if view.load is not None:
                processes.setdefault(view.engine_id, []).append(view)
        for engine_id in self.engines.keys() - processes.keys():
            del self.engines[engine_id]
        keys_by_size: dict[int, list[int]] = {}  # the prompt's keys (for the adapter) per size
        best: list[tuple[EngineView, list[WorkerView], int]] = []
        best_score = float("-inf")
        for engine_id, views in processes.items():
            engine = self._engine(engine_id)
            if not self._may_take(engine, views):
                continue
            if adapter is not None and not any(
                adapter in (v.load.adapters or ()) for v in views if v.load
            ):
                continue
            overlap = 0
            if self.mode == "kv":
                for view in views:
                    if view.index is not None and not view.syncing:
                        size = view.index.block_size
                        if size not in keys_by_size:
                            keys_by_size[size] = prefix_keys(token_ids, size, adapter)
                        overlap = max(overlap, view.index.overlap(keys_by_size[size]))
            score = overlap - self.load_weight * engine.busy
            if score > best_score:
                best, best_score = [(engine, views, overlap)], score
            elif score == best_score:
                best.append((engine, views, overlap))
        if not best:
            return Route(None)
        engine, views, overlap = self._rng.choice(best)
        busy = engine.busy
        engine.mine += 1
        return Route(self._subject(engine.engine_id, views), engine.engine_id, overlap, busy)

    def _engine(self, engine_id: str) -> EngineView:
        engine = self.engines.get(engine_id)
        if engine is None:
            engine = self.engines[engine_id] = EngineView(engine_id)
        return engine

    @staticmethod
    def _may_take(engine: EngineView, views: list[WorkerView]) -> bool:
        """No process is draining (they drain together), and the engine is below the sum of its
        processes' limits (the worker's --max-concurrency, split over them) by this router's
        count, which its own releases keep exact between reports."""
        if not all(view.serving for view in views):
            return False
        limits = [view.load.max_concurrency if view.load else None for view in views]
        if any(limit is None for limit in limits):
            return True
        return engine.busy < sum(limit or 0 for limit in limits)

    def _subject(self, engine_id: str, views: list[WorkerView]) -> str:
        """The engine's own subject (its processes' queue group spreads requests as evenly as
        the general one), unless some of its processes reported being full and others did not:
        then the least loaded of those."""
        open_ = [view for view in views if not view.full]
        if len(views) == 1 or len(open_) in (0, len(views)):
            return self.subjects.instance(engine_id)
        chosen = min(open_, key=lambda view: view.load.in_flight if view.load else 0)
        return self.subjects.instance(chosen.instance_id)

    def release(self, route: Route) -> None:
        """The request `route` sent has ended (its last frame, an error, or abandoned): call it
        once per routed request, so the load this router counts is exact."""
        engine = self.engines.get(route.instance_id) if route.instance_id else None
        if engine is not None and engine.mine > 0:
            engine.mine -= 1

    # --- what the workers say ------------------------------------------------------------

    def _view(self, instance_id: str, epoch: str, *, resync: bool = True) -> WorkerView:
        view = self.workers.get(instance_id)
        if view is not None and not view.epoch:  # known from discovery alone until now
            view.epoch = epoch
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
        # A report naming no batch (kv_seq -1: a fresh worker, or a process that publishes no
        # events) leaves nothing to snapshot.
        view = self._view(report.instance_id, report.epoch, resync=report.kv_seq >= 0)
        view.load = report
        view.last_heard = time.monotonic()
        self._count_others(view.engine_id)
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
        elif view.index is None and report.kv_seq >= 0:
            # A failed snapshot left no index while the worker holds blocks: an idle worker
            # publishes no batch that would ask again, so its reports do, at the back-off's pace.
            self._resync(view)

    async def _on_events(self, msg: Msg) -> None:
        if self.mode != "kv":
            return
        try:
            batch = BATCH_DECODER.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("router: ignored a bad KV event batch on %s: %s", msg.subject, error)
            return
        view = self._view(batch.instance_id, batch.epoch, resync=batch.seq > 0)
        view.last_heard = time.monotonic()
        if view.syncing:
            view.buffered.append(batch)
        elif batch.seq <= view.seq:
            return  # already applied
        elif batch.seq != view.seq + 1 or (view.index is None and batch.seq > 0):
            log.info(
                "router: worker %s batch %d after %d: resync", view.instance_id, batch.seq, view.seq
            )
            if self._resync(view):
                view.buffered.append(batch)
        else:  # the next batch, or an epoch's first (batch 0), from which an index starts
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

    def _count_others(self, engine_id: str) -> None:
        """An engine's requests of other publishers: its processes' in-flight counts as last
        reported (or discovered), which include this router's requests that reached them."""
        engine = self._engine(engine_id)
        reported = sum(
            v.load.in_flight
            for v in self.workers.values()
            if v.load is not None and v.engine_id == engine.engine_id
        )
        engine.others = max(0, reported - engine.mine)

    def _discovered(self, found: WorkerInstance) -> WorkerView:
        """A worker known from discovery alone (one that answers no snapshot: a process that
        reports load only, or KV events off): routed by load, its epoch taken from its first
        report."""
        view = self._view(found.instance_id, "", resync=False)
        view.load = self._discovered_load(found, "", -1)
        self._count_others(view.engine_id)
        return view

    @staticmethod
    def _discovered_load(found: WorkerInstance, epoch: str, kv_seq: int) -> LoadReport:
        """A worker's load as discovery saw it, until its first report."""
        return LoadReport(
            found.instance_id,
            epoch,
            found.in_flight,
            found.max_concurrency,
            False,
            kv_seq,
            engine_id=found.engine_id,
        )

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
            if view is None and found is not None:
                view = self._discovered(found)
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
            view.load = self._discovered_load(found, snapshot.epoch, snapshot.seq)
            self._count_others(view.engine_id)
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
