"""A cheaper merge of vLLM's FlatLogprobs, for the DELTA outputs vLLM coalesces under load.

When a request's consumer is still busy with one output as the engine produces the next, vLLM's
output collector merges the two (`RequestOutput.add` → `FlatLogprobs.extend`). vLLM's `extend`
walks the other container position by position, builds a dict of `Logprob` objects for each one
and flattens it again. Under load that happens for nearly every request at every step, at a cost
on the order of all of the worker's own row building (bench.worker_overhead shows it). Only a
consumer that does work per output falls behind (one that does nothing is never behind), so the
cost lands on the worker, not on a bare AsyncLLM baseline.

`install()` replaces `FlatLogprobs.extend`, for a FlatLogprobs argument whose positions are laid
out contiguously from 0 (what vLLM's DELTA slices are), by list concatenation with shifted
indices; anything else goes to vLLM's own method. The result is the same container, field by field
(tests/e2e/test_vllm_fast_merge.py).

It changes a vLLM class for the whole process, so it is explicit and bounded: only the worker's
composition root (`worker.process.serve`) and the test session install it, never the engine adapter
as a side effect; it installs only on the vLLM versions whose FlatLogprobs it was written and
tested against (`SUPPORTED`), and otherwise logs a warning and leaves vLLM as it is; `uninstall()`
puts vLLM's method back (a benchmark's stock-vLLM baseline runs without it).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

# [lowest, highest) vLLM release the replacement is written for: FlatLogprobs with the fields
# below and an `extend` that appends position by position (0.24.0 on the GPU, 0.32.0 on CPU).
SUPPORTED = ((0, 24), (0, 33))
_FIELDS = ("start_indices", "end_indices", "token_ids", "logprobs", "ranks", "decoded_tokens")

_original: Any = None


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def install() -> bool:
    """Installs the fast merge; False (with a warning) where this vLLM is not one it was
    written for, or has no FlatLogprobs.extend to replace."""
    global _original
    if _original is not None:
        return True
    try:
        from vllm import __version__ as vllm_version
        from vllm.logprobs import FlatLogprobs
    except ImportError:
        log.warning("fast logprob merge not installed: this vLLM has no FlatLogprobs")
        return False
    release = _release(vllm_version)
    original = getattr(FlatLogprobs, "extend", None)
    fields = getattr(FlatLogprobs, "__dataclass_fields__", {})
    if (
        release is None
        or not SUPPORTED[0] <= release < SUPPORTED[1]
        or original is None
        or not all(name in fields for name in _FIELDS)
    ):
        log.warning(
            "fast logprob merge not installed: written for vLLM %s.%s to before %s.%s, this is %s",
            *SUPPORTED[0],
            *SUPPORTED[1],
            vllm_version,
        )
        return False

    def extend(self: Any, other: Any) -> None:
        if not isinstance(other, FlatLogprobs) or not _contiguous(other):
            original(self, other)
            return
        offset = len(self.logprobs)
        self.start_indices.extend([start + offset for start in other.start_indices])
        self.end_indices.extend([end + offset for end in other.end_indices])
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)
        self.decoded_tokens.extend(other.decoded_tokens)

    extend.__doc__ = original.__doc__
    FlatLogprobs.extend = extend
    _original = original
    return True


def uninstall() -> None:
    """Puts vLLM's own FlatLogprobs.extend back (no-op when not installed)."""
    global _original
    if _original is None:
        return
    from vllm.logprobs import FlatLogprobs

    FlatLogprobs.extend = _original
    _original = None


def installed() -> bool:
    return _original is not None


def _contiguous(flat: Any) -> bool:
    """Positions cover the data lists exactly, in order, from index 0."""
    starts, ends = flat.start_indices, flat.end_indices
    if not starts:
        return not flat.logprobs
    return (
        starts[0] == 0
        and ends[-1] == len(flat.logprobs) == len(flat.token_ids) == len(flat.ranks)
        and len(flat.decoded_tokens) == len(flat.logprobs)
        and starts[1:] == ends[:-1]
    )
