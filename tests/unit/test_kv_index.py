"""KV routing without a server: the router's prefix index, the worker's cache mirror and
snapshot, the decoding of vLLM's event batches, and the subjects."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from messages.kv import AllCleared, BlocksRemoved, BlocksStored
from messages.subjects import Subjects
from worker.client.prefix_index import PrefixIndex, prefix_keys
from worker.engine.kv_events import decode_batch
from worker.nats.kv_publisher import CacheMirror

A = [1, 2, 3, 4, 5, 6, 7, 8]
B = [1, 2, 3, 4, 9, 9, 9, 9]


def test_prefix_keys_chain_whole_prefixes_and_skip_the_partial_block():
    assert len(prefix_keys(A + [10, 11], 4)) == 2
    a, b = prefix_keys(A, 4), prefix_keys(B, 4)
    assert a[0] == b[0] and a[1] != b[1]  # same first block, different second
    # The same second block after a different first one is a different key.
    assert prefix_keys([0, 0, 0, 0] + A[4:], 4)[1] != a[1]


def test_the_index_follows_stored_removed_and_cleared_by_engine_hashes():
    index = PrefixIndex(4)
    # vLLM sends a sequence's blocks in two events, the second naming the first's hash.
    index.apply([BlocksStored([11], None, A[:4]), BlocksStored([12], 11, A[4:])])
    index.apply([BlocksStored([13], 11, B[4:])])
    assert index.overlap(prefix_keys(A, 4)) == 2
    assert index.overlap(prefix_keys(B + [1, 1, 1, 1], 4)) == 2
    index.apply([BlocksRemoved([12, 999])])  # an unknown hash is ignored
    assert index.overlap(prefix_keys(A, 4)) == 1
    assert len(index) == 2
    index.apply([AllCleared()])
    assert len(index) == 0 and index.overlap(prefix_keys(B, 4)) == 0


def test_a_block_whose_parent_is_unknown_is_left_out():
    """After a lost event the index under-estimates: it never claims a cache that is not there."""
    index = PrefixIndex(4)
    index.apply([BlocksStored([12], 11, A[4:])])
    assert len(index) == 0 and index.overlap(prefix_keys(A, 4)) == 0


def test_bytes_hashes_work_as_int_hashes():
    index = PrefixIndex(4)
    index.apply([BlocksStored([b"\x01" * 32, b"\x02" * 32], None, A)])
    index.apply([BlocksRemoved([b"\x02" * 32])])
    assert index.overlap(prefix_keys(A, 4)) == 1


def test_the_mirror_snapshot_lists_parents_first_and_the_newest_first_when_cut():
    mirror = CacheMirror(4)
    mirror.apply([BlocksStored([1, 2], None, A), BlocksStored([3], 1, B[4:])])
    mirror.apply([BlocksStored([4], None, [7, 7, 7, 7])])
    chains = mirror.chains()
    order = [event.block_hashes[0] for event in chains]
    assert sorted(order) == [1, 2, 3, 4] and order.index(1) < min(order.index(2), order.index(3))
    index = PrefixIndex(4)
    index.apply(chains)
    assert index.overlap(prefix_keys(A, 4)) == 2 and index.overlap(prefix_keys(B, 4)) == 2
    # Cut to about the newest block: it comes with its parents, nothing else.
    assert [event.block_hashes[0] for event in mirror.chains(newest=1)] == [4]
    newest_two = {event.block_hashes[0] for event in mirror.chains(newest=2)}
    assert newest_two == {4, 3, 1}  # 3's parent 1 comes with it
    mirror.apply([BlocksRemoved([1])])
    assert {event.block_hashes[0] for event in mirror.chains()} == {4}  # 2, 3 unreachable
    mirror.apply([AllCleared()])
    assert mirror.chains() == []


def test_vllm_batches_decode_in_the_map_and_the_array_forms():
    stored = {
        "type": "BlockStored",
        "block_hashes": [7],
        "parent_block_hash": None,
        "token_ids": A[:4],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "kv_cache_spec_kind": "full_attention",
    }
    offloaded = dict(stored, medium="CPU")
    removed = {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"}
    payload = msgspec.msgpack.encode(
        [1.0, [stored, offloaded, removed, {"type": "AllBlocksCleared"}], 0]
    )
    assert decode_batch(payload) == [
        BlocksStored([7], None, A[:4]),
        BlocksRemoved([7]),
        AllCleared(),
    ]
    array_form = ["BlockStored", [8], 7, A[4:], 4, None, "GPU"]
    assert decode_batch(msgspec.msgpack.encode([1.0, [array_form]])) == [
        BlocksStored([8], 7, A[4:])
    ]
    # vLLM 0.32's events name the adapter whose request stored the blocks (`lora_name`).
    lora_form = ["BlockStored", [9], None, A[:4], 4, 12345, None, "tiny-lora", [["tiny-lora"]]]
    offloaded_lora = ["BlockStored", [10], None, A[:4], 4, 12345, "CPU", "tiny-lora"]
    assert decode_batch(msgspec.msgpack.encode([1.0, [lora_form, offloaded_lora]])) == [
        BlocksStored([9], None, A[:4], "tiny-lora")
    ]
    assert decode_batch(msgspec.msgpack.encode([1.0, [dict(stored, lora_name="x")]])) == [
        BlocksStored([7], None, A[:4], "x")
    ]


def test_an_adapters_blocks_are_its_own_in_the_index():
    """vLLM hashes the adapter into its blocks: a request for an adapter overlaps only what that
    adapter's requests cached, a base request only the base model's."""
    index = PrefixIndex(4)
    index.apply([BlocksStored([1], None, A[:4], "lora-a"), BlocksStored([2], 1, A[4:], "lora-a")])
    index.apply([BlocksStored([3], None, B[:4])])
    assert index.overlap(prefix_keys(A, 4, "lora-a")) == 2
    assert index.overlap(prefix_keys(A, 4, "lora-b")) == 0
    assert index.overlap(prefix_keys(A, 4)) == 1  # the base model's first block (from B)
    assert index.overlap(prefix_keys(B, 4, "lora-a")) == 1  # lora-a's first block is A's = B's
    assert prefix_keys(A, 4, "lora-a")[0] != prefix_keys(A, 4)[0]
    # A router that joins later learns them from the worker's snapshot, adapter and all.
    mirror = CacheMirror(4)
    mirror.apply([BlocksStored([1], None, A[:4], "lora-a"), BlocksStored([2], 1, A[4:], "lora-a")])
    joined = PrefixIndex(4)
    joined.apply(mirror.chains())
    assert joined.overlap(prefix_keys(A, 4, "lora-a")) == 2
    assert joined.overlap(prefix_keys(A, 4)) == 0


def test_kv_subjects():
    subjects = Subjects("llm", "vllm", "generate")
    assert subjects.kv("events", "w1") == "llm.vllm.kv.generate.events.w1"
    assert subjects.kv("snapshot", "w1") == "llm.vllm.kv.generate.snapshot.w1"
    assert subjects.kv("load") == "llm.vllm.kv.generate.load.*"
    with pytest.raises(ValueError, match="kind"):
        subjects.kv("other", "w1")
    with pytest.raises(ValueError, match="instance_id"):
        subjects.kv("events", "a.b")


def test_an_unreadable_vllm_batch_clears_the_picture():
    """A batch this code cannot read (a vLLM version's new shape) is not skipped silently: the
    picture it would have changed is unknown, so it starts over."""
    from worker.engine.kv_events import VllmKvEvents

    source = VllmKvEvents("ipc:///nonexistent", None, "kv", 4)
    assert source._take(0, b"\xc1") == [AllCleared()]  # 0xc1: never valid msgpack
    good = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]])
    assert source._take(1, good) == [AllCleared()]
    assert source._take(1, good) == []  # seen already


async def test_a_snapshot_too_big_for_the_payload_is_cut_and_always_ends():
    """One chain longer than max_payload alone: the cut keeps the start of the parents-first
    order (whole chains) instead of asking for the same chain again forever."""
    from messages.kv import SNAPSHOT_DECODER
    from worker.nats.kv_publisher import KvPublisher

    class Connection:
        max_payload = 4096
        sent: list[bytes] = []

        async def publish(self, subject: str, data: bytes) -> None:
            self.sent.append(data)

    class Message:
        reply = "inbox"

    class Source:
        block_size = 4

    nc = Connection()
    publisher = KvPublisher(nc, Subjects(), "w1", None, Source(), lambda: (0, None, False))  # type: ignore[arg-type]
    assert publisher.mirror is not None
    tokens = list(range(4000))  # one chain of 1000 blocks, ~20 KB encoded
    publisher.mirror.apply([BlocksStored(list(range(1, 1001)), None, tokens)])
    await publisher._on_snapshot(Message())  # type: ignore[arg-type]
    (data,) = nc.sent
    assert len(data) <= nc.max_payload
    snapshot = SNAPSHOT_DECODER.decode(data)
    assert 0 < len(snapshot.blocks) < 1000
    index = PrefixIndex(4)
    index.apply(snapshot.blocks)
    assert index.overlap(prefix_keys(tokens, 4)) == len(snapshot.blocks)  # a whole prefix


@pytest.mark.parametrize(
    ("version", "topic_frame"), [("0.24", False), ("0.32", True)], ids=["vllm-0.24", "vllm-0.32"]
)
async def test_the_replay_reads_both_vllm_reply_shapes(
    tmp_path: Path, version: str, topic_frame: bool
) -> None:
    """vLLM's replay ROUTER answers (id, b"", seq, payload) on 0.24 and (id, b"", topic, seq,
    payload) on 0.32, each batch then an END_SEQ (-1) frame; both read as the same batches."""
    import zmq
    import zmq.asyncio

    from worker.engine.kv_events import VllmKvEvents

    endpoint = f"ipc://{tmp_path}/replay-{version}"
    router = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    router.bind(endpoint)
    batches = [(3, msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]])), (4, b"x")]

    async def serve() -> None:
        client, _, start = await router.recv_multipart()
        assert int.from_bytes(start, "big") == 3
        topic = (b"kv",) if topic_frame else ()
        for seq, payload in batches:
            await router.send_multipart((client, b"", *topic, seq.to_bytes(8, "big"), payload))
        end = (-1).to_bytes(8, "big", signed=True)
        await router.send_multipart((client, b"", *((b"",) if topic_frame else ()), end, b""))

    try:
        server = asyncio.ensure_future(serve())
        source = VllmKvEvents("ipc:///nonexistent", endpoint, "kv", 4)
        assert await source._replay(3) == batches
        await server
    finally:
        router.close(linger=0)


def test_socket_directories_of_workers_no_longer_running_are_removed(tmp_path: Path):
    """`configure` names its socket directory `vllm-nats-kv-<pid>-…`; a worker killed by SIGKILL
    never removes its own, so the next start removes those whose pid has no process."""
    import os
    import subprocess
    import sys

    from worker.engine.kv_events import remove_stale_directories

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    dead = tmp_path / f"vllm-nats-kv-{ended.pid}-abc123"
    alive = tmp_path / f"vllm-nats-kv-{os.getpid()}-def456"
    unnamed = tmp_path / "vllm-nats-kv-8wgfw69e"  # before the pid was in the name: left alone
    other = tmp_path / f"something-else-{ended.pid}-x"
    for directory in (dead, alive, unnamed, other):
        directory.mkdir()
        (directory / "events").touch()

    assert remove_stale_directories(str(tmp_path)) == [str(dead)]
    assert not dead.exists()
    assert alive.exists() and unnamed.exists() and other.exists()
