"""A router's picture of one worker's prefix cache, built from its KV events (messages/kv.py).

Keys are the router's own chained block hashes: `chain(parent, tokens)` over the block's token
ids and its parent's key, so one key stands for the whole prefix up to and including its block.
That makes an overlap a walk from the first block until the first key the worker lacks, and it
makes the index independent of how the engine hashes (engine hashes only map events to keys).
Python's hash of a tuple of ints is the same in every process (no hash randomisation for ints),
and the keys never leave the process anyway. A LoRA adapter's blocks chain from a root of their
own (`root_of(name)`), as vLLM hashes the adapter into its blocks: an adapter's request overlaps
only that adapter's cached blocks, a base request only the base model's.

Invariant: `keys` holds exactly the keys of blocks the worker reported stored and not removed
since its last clear, whose parent chain the index knows. A stored block whose parent it does not
know (a lost event) is left out: the router under-estimates, it never routes to a cache that is
not there.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from messages.kv import AllCleared, BlockHash, BlocksRemoved, BlocksStored, KvEvent

ROOT = 0


def chain(parent: int, tokens: Sequence[int]) -> int:
    return hash((parent, tuple(tokens)))


def root_of(adapter: str | None) -> int:
    """Where a sequence's chain starts: ROOT for the base model, its own root per adapter."""
    return ROOT if adapter is None else hash(("lora", adapter))


def prefix_keys(token_ids: Sequence[int], block_size: int, adapter: str | None = None) -> list[int]:
    """The chained keys of the prompt's full blocks (a partial last block is never cached), for
    the base model or a LoRA adapter."""
    keys: list[int] = []
    parent = root_of(adapter)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


class PrefixIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._key_of: dict[BlockHash, int] = {}
        self.keys: set[int] = set()

    def __len__(self) -> int:
        return len(self.keys)

    def clear(self) -> None:
        self._key_of.clear()
        self.keys.clear()

    def apply(self, events: Iterable[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlocksStored):
                self._store(event)
            elif isinstance(event, BlocksRemoved):
                for block_hash in event.block_hashes:
                    key = self._key_of.pop(block_hash, None)
                    if key is not None:
                        self.keys.discard(key)
            elif isinstance(event, AllCleared):
                self.clear()

    def _store(self, event: BlocksStored) -> None:
        if event.parent_block_hash is None:
            parent = root_of(event.lora_name)
        elif (known := self._key_of.get(event.parent_block_hash)) is not None:
            parent = known
        else:
            return  # the parent's chain is unknown here: see the module's invariant
        size = self.block_size
        tokens = event.token_ids
        for i, block_hash in enumerate(event.block_hashes):
            block = tokens[i * size : (i + 1) * size]
            if len(block) < size:
                return  # not a full block: engines store full blocks only
            parent = chain(parent, block)
            self._key_of[block_hash] = parent
            self.keys.add(parent)

    def overlap(self, keys: Sequence[int]) -> int:
        """How many of the prompt's leading blocks (`prefix_keys`) this worker holds."""
        held = 0
        for key in keys:
            if key not in self.keys:
                break
            held += 1
        return held
