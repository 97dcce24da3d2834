"""Client-supplied strings as they may appear in a log line: whatever a request carries (its
request_id, a stop string, a model name, an error message that quotes the payload), the line
stays one line of printable text. CR/LF would forge whole log lines, NUL makes the log binary
to grep, and bidirectional controls (U+202E) reorder what a reader sees."""

from __future__ import annotations

MAX_LOGGED = 256
"""Longer strings are cut (with a marker): a 1 MiB request_id must not become a 1 MiB line."""


def _escape(char: str) -> str:
    # Not printable: C0/C1 controls (CR, LF, NUL, ESC), format controls (U+202E, U+200B), line
    # and paragraph separators, unassigned code points.
    if char == "\\":
        return "\\\\"
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def loggable(text: object, limit: int = MAX_LOGGED) -> str:
    """`text` escaped for a log line: what is not printable as `\\xNN`, `\\uNNNN` or
    `\\UNNNNNNNN`, backslashes doubled (so an escape in the log is never the client's own
    text), cut at `limit` characters."""
    raw = text if isinstance(text, str) else str(text)
    cut = raw[:limit]
    escaped = "".join(c if c.isprintable() and c != "\\" else _escape(c) for c in cut)
    return escaped + (f"…(+{len(raw) - limit} chars)" if len(raw) > limit else "")
