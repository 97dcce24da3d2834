"""A cheaper merge of vLLM's FlatLogprobs, for the DELTA outputs vLLM coalesces under load.

When a request's consumer is still busy with one output as the engine produces the next, vLLM's
output collector merges the two (`RequestOutput.add` → `FlatLogprobs.extend`). vLLM's `extend`
walks the other container position by position, builds a dict of `Logprob` objects for each one
and flattens it again. Under load that happens for nearly every request at every step, and on the
CPU profile of bench.p1_overhead it cost as much as all of the worker's own row building. Only the
worker side pays it (a consumer that does nothing per output is never behind), so it showed up as
worker overhead.

`install()` replaces `FlatLogprobs.extend`, for a FlatLogprobs argument whose positions are laid
out contiguously from 0 (what vLLM's DELTA slices are), by list concatenation with shifted
indices; anything else goes to vLLM's own method. The result is the same container, field by field
(tests/test_vllm_fast_merge.py). It patches the class once per process, which the worker owns.
"""

from __future__ import annotations

from typing import Any

_installed = False


def install() -> bool:
    """Installs the fast merge; False where this vLLM has no FlatLogprobs.extend to replace."""
    global _installed
    if _installed:
        return True
    try:
        from vllm.logprobs import FlatLogprobs
    except ImportError:  # pragma: no cover - a vLLM without flat logprobs
        return False
    original = getattr(FlatLogprobs, "extend", None)
    if original is None:  # pragma: no cover
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
    _installed = True
    return True


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
