"""Where a choice's text ends when it stopped on a stop string.

The worker sends every token up to and including the one that completed the match (vLLM's
`stop_reason` names the string); the text is cut by whoever turns tokens into text, by vLLM's own
rule (`vllm/v1/engine/detokenizer.py`): the match is searched only where it can have been
completed by the last token, the text ends where the match starts (or, with
`include_stop_str_in_output`, where it ends), and a stream holds back the last
`max(len(stop)) - 1` characters until it knows they are not the start of a match.
"""

from __future__ import annotations


def held_back(stop: list[str] | None, include_stop_str_in_output: bool) -> int:
    """How many characters at the end of streamed text wait until the next token or the end."""
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1


def stop_cut(text: str, last_token_start: int, stop: str, include_stop_str_in_output: bool) -> int:
    """The length of `text` to keep, where `text[last_token_start:]` is the last token's text.

    The last token completed the match, so it ends in that token's text and starts at most
    `len(stop) - 1` characters before it (vLLM searches the same window). When a different
    decoding of the tokens hides the match, the text is kept whole rather than cut elsewhere.
    """
    start = text.find(stop, max(0, last_token_start - len(stop) + 1))
    if start == -1:
        return len(text)
    return start + len(stop) if include_stop_str_in_output else start
