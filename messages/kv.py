"""KV-cache routing messages: what a worker says about its prefix cache and its load.

Subjects (messages/subjects.py, `Subjects.kv_*`), per worker instance:
- `<ns>.<component>.kv.<endpoint>.events.<instance_id>`: `KvEventBatch`, the engine's cache
  events (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`) as they happen, with a
  per-publisher sequence number that has no gaps (`seq` = previous + 1);
- `<ns>.<component>.kv.<endpoint>.snapshot.<instance_id>`: a request (empty body) answered by a
  `KvSnapshot`, the blocks the worker holds now and the `seq` of the last batch they include;
- `<ns>.<component>.kv.<endpoint>.load.<instance_id>`: `LoadReport`, about once a second, and at
  once when the worker starts draining.

Block hashes are the engine's (opaque: an int or bytes); a router keys its index by hashes of
its own, chained over the token ids (worker/client/router.py), so it does not depend on how the
engine hashes. `epoch` is random per worker start: a new epoch under a known instance id is a
restarted worker, whose old index is void. All are msgpack maps (the JSON codec reads them too).
"""

from __future__ import annotations

import msgspec

BlockHash = int | bytes


class BlocksStored(msgspec.Struct, tag="stored", frozen=True):
    """Full blocks now cached, in chain order: block i holds
    `token_ids[i * block_size:(i + 1) * block_size]` and follows block i - 1 (block 0 follows
    `parent_block_hash`, None for the first block of a sequence)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    # The LoRA adapter whose request filled them (vLLM's `lora_name`); None: the base model's.
    # An adapter's blocks are its own (vLLM hashes the adapter in), so a router keeps them apart.
    lora_name: str | None = None


class BlocksRemoved(msgspec.Struct, tag="removed", frozen=True):
    block_hashes: list[BlockHash]


class AllCleared(msgspec.Struct, tag="cleared", frozen=True):
    pass


KvEvent = BlocksStored | BlocksRemoved | AllCleared


class KvEventBatch(msgspec.Struct, frozen=True):
    instance_id: str
    epoch: str
    seq: int
    """0 for a publisher's first batch, then +1 per batch: a jump is a lost batch."""
    block_size: int
    events: list[KvEvent]


class KvSnapshot(msgspec.Struct, frozen=True):
    instance_id: str
    epoch: str
    seq: int
    """The last batch whose events the blocks include (-1: none yet)."""
    block_size: int
    blocks: list[BlocksStored]
    """Every block held, each chain's parents before their children."""


class LoadReport(msgspec.Struct, frozen=True):
    instance_id: str
    epoch: str
    in_flight: int
    """Requests this worker process serves now (running or waiting in the engine)."""
    max_concurrency: int | None
    """Its limit; at it, a request is refused as `overloaded` (None: no limit)."""
    draining: bool
    kv_seq: int
    """The last event batch published (-1: none): a router that has an older one lost some."""
    running: int | None = None
    """The engine's running and waiting requests and KV-cache use (0..1), from vLLM's scheduler
    stats; None where the engine does not report them (stats disabled)."""
    waiting: int | None = None
    kv_usage: float | None = None
    engine_id: str | None = None
    """The engine core this instance shares with others (`--worker-processes`); None: its own."""
    adapters: list[str] | None = None
    """The LoRA adapters it holds now (a router sends an adapter's requests only where it is);
    None where the engine has no adapters to report."""

    @property
    def full(self) -> bool:
        return self.max_concurrency is not None and self.in_flight >= self.max_concurrency


KV_ENCODER = msgspec.msgpack.Encoder()
BATCH_DECODER = msgspec.msgpack.Decoder(KvEventBatch)
SNAPSHOT_DECODER = msgspec.msgpack.Decoder(KvSnapshot)
LOAD_DECODER = msgspec.msgpack.Decoder(LoadReport)
