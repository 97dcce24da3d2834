"""Stop strings across a continuation's seam (`GenerateRequest.continued_tokens`).

vLLM matches stop strings on the text of a request's own output, so when a migrated request
continues with its earlier output in the prompt, a stop string that began in that output and
ends in the new one is not vLLM's to see. This finds it, on the tokens' bytes (the worker's token
table), one token at a time, so the choice ends exactly at the token that completes the match, as
vLLM ends it: finish "stop", `stop_reason` the string, that token the last one sent.

Only matches that start in the earlier output are looked for: one wholly inside the new output
is vLLM's, and one wholly inside the earlier output would have ended the earlier leg. Once the
new output is as long as the longest stop string less one byte, no such match can come, and
nothing more is looked at.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.shared.tokens import TokenTable


class SeamStops:
    def __init__(self, stops: Sequence[str], earlier: Sequence[int], table: TokenTable) -> None:
        self._stops = [(stop, stop.encode()) for stop in stops]
        self._table = table
        self._longest = max(len(encoded) for _, encoded in self._stops)
        tail = b"".join(table.byte_values[t] for t in earlier[-self._longest :])
        self._tail = tail[len(tail) - (self._longest - 1) :] if self._longest > 1 else b""
        self._new = b""

    def stop_at(self, token_ids: Sequence[int]) -> tuple[int, str] | None:
        """(position in `token_ids` of the token that completes a match, the stop string), or
        None; call it with each step's new tokens, in order."""
        for position, token_id in enumerate(token_ids):
            if len(self._new) >= self._longest - 1:
                return None
            self._new += self._table.byte_values[token_id]
            window = self._tail + self._new
            for stop, encoded in self._stops:
                start = window.find(encoded, max(0, len(self._tail) - len(encoded) + 1))
                if start != -1 and start < len(self._tail):
                    return position, stop
        return None
