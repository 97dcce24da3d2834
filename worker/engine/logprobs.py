"""vLLM logprob outputs → the frame's aligned `log_probs` / `top_logprobs` rows.

The alignment invariants live here and nowhere else:
- one `log_probs` entry and one `top_logprobs` row per position, in position order (consumers zip
  by position with `token_ids`), never fewer, never more;
- each row holds the top-k candidates by rank, then the sampled (or prompt) token itself when its
  rank is above k, so the chosen token is always in its row with its real rank;
- the `log_probs` entry is that token's logprob, the same float as in its row.

vLLM gives one of two shapes: `FlatLogprobs` (with `flat_logprobs=True`, which the worker asks for:
per position, entry 0 is the chosen token and entries 1..k the top-k in rank order, duplicates
kept) or a list of `{token_id: Logprob}` dicts (chosen token first, duplicates merged).
Both are handled, so the values do not depend on which shape an engine version returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from messages.frames import TopLogprob
from worker.errors import WorkerError
from worker.shared.tokens import TokenTable


class AlignmentError(WorkerError, RuntimeError):
    """The engine's logprobs do not line up with its tokens: a bug, never sent as data."""

    code = "engine_error"


Rows = tuple[list[float | None], list[list[TopLogprob] | None]]


def _flat_rows(
    token_ids: Sequence[int], flat: Any, k: int, table: TokenTable, nullable: bool
) -> Rows:
    starts: list[int] = flat.start_indices
    ends: list[int] = flat.end_indices
    ids: list[int] = flat.token_ids
    values: list[float] = flat.logprobs
    ranks: list[int | None] = flat.ranks
    texts = table.texts
    raw = table.byte_values
    log_probs: list[float | None] = []
    rows: list[list[TopLogprob] | None] = []
    for position, token_id in enumerate(token_ids):
        start = starts[position]
        end = ends[position]
        if start == end:
            if not nullable:
                raise AlignmentError(f"no logprobs for generated position {position}")
            log_probs.append(None)
            rows.append(None)
            continue
        if ids[start] != token_id:
            raise AlignmentError(
                f"position {position}: logprobs are for token {ids[start]}, output has {token_id}"
            )
        top_ids = ids[start + 1 : end]
        # Entries 1..k are vLLM's top-k, whose ranks are always set (1..k). Built by map (no
        # bytecode per entry): this is the per-token hot path (bench.logprob_rows). The slices
        # share start and end, so they are equally long.
        row = list(
            map(
                TopLogprob,
                cast("list[int]", ranks[start + 1 : end]),
                top_ids,
                map(texts.__getitem__, top_ids),
                values[start + 1 : end],
                map(raw.__getitem__, top_ids),
            )
        )
        chosen_rank = ranks[start]
        # Rank ties can leave the chosen token out of the top-k slice even when its rank <= k.
        if chosen_rank is None or chosen_rank > k or token_id not in top_ids:
            row.append(
                TopLogprob(
                    chosen_rank or 0, token_id, texts[token_id], values[start], raw[token_id]
                )
            )
        log_probs.append(values[start])
        rows.append(row)
    return log_probs, rows


def _dict_rows(
    token_ids: Sequence[int], positions: Sequence[Any], table: TokenTable, nullable: bool
) -> Rows:
    texts = table.texts
    raw = table.byte_values
    log_probs: list[float | None] = []
    rows: list[list[TopLogprob] | None] = []
    for position, (token_id, candidates) in enumerate(zip(token_ids, positions, strict=True)):
        if not candidates:
            if not nullable:
                raise AlignmentError(f"no logprobs for generated position {position}")
            log_probs.append(None)
            rows.append(None)
            continue
        chosen = candidates.get(token_id)
        if chosen is None:
            raise AlignmentError(f"position {position}: token {token_id} missing from its logprobs")
        ordered = sorted(candidates.items(), key=lambda item: item[1].rank or 0)
        rows.append(
            [TopLogprob(lp.rank or 0, tid, texts[tid], lp.logprob, raw[tid]) for tid, lp in ordered]
        )
        log_probs.append(chosen.logprob)
    return log_probs, rows


def extract(
    token_ids: Sequence[int], logprobs: Any, k: int, table: TokenTable, *, prompt: bool = False
) -> Rows:
    """Rows for `token_ids` from vLLM's logprobs of the same positions.

    `prompt=True` allows empty positions (prompt position 0 has no logprob: nothing precedes it),
    which come out as None; for generated tokens an empty position is an AlignmentError.
    """
    # FlatLogprobs is checked by its start_indices (not its Python-level __len__): this runs
    # once per engine step and choice, so its fixed cost is paid per token at one token a step.
    starts = getattr(logprobs, "start_indices", None)
    have = len(starts) if starts is not None else None if logprobs is None else len(logprobs)
    if have != len(token_ids):
        raise AlignmentError(
            f"{len(token_ids)} tokens but logprobs for {'none' if have is None else have} positions"
        )
    if starts is not None:
        return _flat_rows(token_ids, logprobs, k, table, nullable=prompt)
    return _dict_rows(token_ids, logprobs, table, nullable=prompt)
