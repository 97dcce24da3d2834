"""vLLM's KV cache events, read from the engine's own publisher (`kv_events_config`, ZMQ).

With prefix caching on, vLLM's scheduler emits `BlockStored` (block hashes, parent hash, token
ids), `BlockRemoved` and `AllBlocksCleared` every step and its `ZmqEventPublisher` sends each
batch as (topic, seq, msgpack `[ts, events, dp_rank]`) on a PUB socket, keeping the last
`buffer_steps` batches for replay on a ROUTER socket. `configure` points both at ipc sockets in a
private directory (unless the user gave a `--kv-events-config` of their own, which is then read
as given); `VllmKvEvents` subscribes and first asks the replay socket for everything it still
holds, so a subscriber that starts after the engine (a worker process of `--worker-processes`,
a second worker on one engine) still sees the blocks cached before it. A batch lost between the
engine and here (a seq gap the replay cannot fill) is answered by `AllCleared`: the mirror
starts over rather than keep a picture with holes.

Decoding tolerates the forms vLLM has used: events as tagged maps (`{"type": "BlockStored",
...}`, 0.24 and 0.32) or tagged arrays (older). Only full-attention, device-tier events count
(another medium, e.g. a CPU offload tier, is not what a prompt hits first).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from messages.kv import AllCleared, BlocksRemoved, BlocksStored, KvEvent

log = logging.getLogger(__name__)

END_SEQ = -1
_DEVICE_MEDIA = (None, "GPU")
_ATTENTION_KINDS = (None, "full_attention")
# Positional fields of the array form, after the tag (vLLM 0.32's order; older vLLM's events end
# earlier: lora_name came after lora_id and medium).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_REMOVED_FIELDS = ("block_hashes", "medium")
REPLAY_TIMEOUT_S = 2.0


def configure(engine_args: Any) -> None:
    """Turns vLLM's KV event publisher on in `engine_args` (AsyncEngineArgs), on ipc sockets in
    a new private directory, unless the user configured one or turned prefix caching off."""
    from vllm.config import KVEventsConfig

    if engine_args.enable_prefix_caching is False:
        log.info("prefix caching is off: no KV events for routing")
        return
    if (engine_args.data_parallel_size or 1) > 1:
        # vLLM offsets each DP rank's endpoint by port, which ipc endpoints cannot take.
        log.info("--data-parallel-size > 1: no KV events for routing (one cache per rank)")
        return
    config = engine_args.kv_events_config
    if config is not None and config.enable_kv_cache_events:
        return  # the user's own publisher settings; subscribe() reads them
    remove_stale_directories(tempfile.gettempdir())
    directory = tempfile.mkdtemp(prefix=f"{_DIRECTORY_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, directory, True)
    engine_args.kv_events_config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"ipc://{os.path.join(directory, 'events')}",
        replay_endpoint=f"ipc://{os.path.join(directory, 'replay')}",
        topic="kv",
    )


_DIRECTORY_PREFIX = "vllm-nats-kv-"


def remove_stale_directories(parent: str) -> list[str]:
    """Removes the socket directories in `parent` of workers that no longer run (named for
    their pid by `configure`): `atexit` never runs in a worker killed by SIGKILL or the OOM
    killer, so each start clears what such workers left. A directory whose pid is alive, or was
    reused by another process, stays. Returns the paths removed."""
    removed = []
    for entry in os.scandir(parent):
        name = entry.name
        if not name.startswith(_DIRECTORY_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        pid = name[len(_DIRECTORY_PREFIX) :].partition("-")[0]
        if not pid.isdigit() or _alive(int(pid)) or entry.stat().st_uid != os.getuid():
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        log.info("removed %d KV event socket directories of ended workers", len(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _connectable(endpoint: str) -> str:
    """The address to connect to for an endpoint vLLM binds (`tcp://*:5557` → loopback)."""
    return endpoint.replace("*", "127.0.0.1", 1) if endpoint.startswith("tcp://*") else endpoint


class VllmKvEvents:
    """Our events from one vLLM engine's publisher; `block_size` is the engine's."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, block_size: int):
        self.block_size = block_size
        self._endpoint = _connectable(endpoint)
        self._replay_endpoint = _connectable(replay_endpoint) if replay_endpoint else None
        self._topic = topic.encode()
        self._context = zmq.asyncio.Context.instance()
        self._seq = -1

    @classmethod
    def of(cls, vllm_config: Any) -> VllmKvEvents | None:
        """The source for an engine's config, or None when it publishes no events over ZMQ."""
        config = getattr(vllm_config, "kv_events_config", None)
        cache = vllm_config.cache_config
        if config is None or not config.enable_kv_cache_events or config.publisher != "zmq":
            return None
        if not cache.enable_prefix_caching:
            return None
        return cls(config.endpoint, config.replay_endpoint, config.topic, cache.block_size)

    async def batches(self) -> AsyncIterator[list[KvEvent]]:
        """Every batch vLLM still holds and then each new one, until cancelled. Each call reads
        from the replay's start again (a reader after a failure rebuilds the whole picture)."""
        self._seq = -1
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self._endpoint)
        try:
            # Subscribed first, so nothing falls between the replay and the live stream.
            await asyncio.sleep(0.05)
            for seq, payload in await self._replay(0):
                events = self._take(seq, payload)
                if events:
                    yield events
            while True:
                _, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq > self._seq + 1 and self._replay_endpoint is not None:
                    for old_seq, old_payload in await self._replay(self._seq + 1):
                        if old_seq < seq and (events := self._take(old_seq, old_payload)):
                            yield events
                events = self._take(seq, payload)
                if events:
                    yield events
        finally:
            sub.close(linger=0)

    def _take(self, seq: int, payload: bytes) -> list[KvEvent]:
        if seq <= self._seq:
            return []  # seen (replay and live overlap)
        gap = seq != self._seq + 1
        if gap:
            log.warning("KV events %d..%d lost: the cache picture starts over", self._seq + 1, seq)
        self._seq = seq
        try:
            events = decode_batch(payload)
        except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError) as error:
            # A batch this code cannot read (a vLLM version's new shape): the picture it would
            # have changed is unknown, so it starts over rather than go on with holes.
            log.warning(
                "KV event batch %d unreadable (%r): the cache picture starts over", seq, error
            )
            return [AllCleared()]
        return [AllCleared(), *events] if gap else events

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """The batches from `start` on that vLLM's replay buffer still holds."""
        if self._replay_endpoint is None:
            return []
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self._replay_endpoint)
        found: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                # (b"", seq, payload) on 0.24, (b"", topic, seq, payload) on 0.32: the last two
                # frames are the batch in both.
                if len(frames) < 3:
                    raise ValueError(f"replay frame of {len(frames)} parts")
                seq_bytes, payload = frames[-2:]
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return found
                found.append((seq, payload))
        except (TimeoutError, ValueError) as error:
            log.warning("KV event replay from %d failed (%r); going on without it", start, error)
            return found
        finally:
            dealer.close(linger=0)


def decode_batch(payload: bytes) -> list[KvEvent]:
    """vLLM's `[ts, events, dp_rank]` (or `{"ts":…, "events":…}`) as our events."""
    batch = msgspec.msgpack.decode(payload)
    raw = batch.get("events", []) if isinstance(batch, dict) else batch[1]
    events: list[KvEvent] = []
    for item in raw:
        event = _event(item)
        if event is not None:
            events.append(event)
    return events


def _fields(item: Any, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    if isinstance(item, dict):
        return str(item.get("type", "")), item
    return str(item[0]), dict(zip(names, item[1:], strict=False))


def _event(item: Any) -> KvEvent | None:
    kind = item.get("type") if isinstance(item, dict) else item[0]
    if kind == "BlockStored":
        _, f = _fields(item, _STORED_FIELDS)
        if f.get("medium") not in _DEVICE_MEDIA:
            return None
        if f.get("kv_cache_spec_kind") not in _ATTENTION_KINDS:
            return None
        lora_name = f.get("lora_name")
        return BlocksStored(
            list(f["block_hashes"]),
            f["parent_block_hash"],
            list(f["token_ids"]),
            lora_name if isinstance(lora_name, str) else None,
        )
    if kind == "BlockRemoved":
        _, f = _fields(item, _REMOVED_FIELDS)
        if f.get("medium") not in _DEVICE_MEDIA:
            return None
        return BlocksRemoved(list(f["block_hashes"]))
    if kind == "AllBlocksCleared":
        return AllCleared()
    return None
