"""Where text ends on a stop string (worker.client.stops), by vLLM's rule."""

from __future__ import annotations

import pytest

from worker.client.stops import held_back, stop_cut


def test_held_back_is_the_longest_stop_string_less_one_unless_included() -> None:
    assert held_back(None, False) == 0
    assert held_back(["\n", "END", "STOP!"], False) == 4
    assert held_back(["\n", "END", "STOP!"], True) == 0


@pytest.mark.parametrize(
    ("text", "last_token_start", "stop", "include", "kept"),
    [
        # The last token "END." completed "END": text ends where the match starts.
        ("hello END.", 6, "END", False, "hello "),
        ("hello END.", 6, "END", True, "hello END"),
        # The match may start before the last token (here "EN" + "D!").
        ("hello END!", 8, "END", False, "hello "),
        # An earlier occurrence outside the window (before min_tokens let matching start) stays.
        ("END ab END", 7, "END", False, "END ab "),
        ("END ab END", 7, "END", True, "END ab END"),
        # Not found in this decoding of the tokens: kept whole, never cut elsewhere.
        ("hello", 3, "END", False, "hello"),
    ],
)
def test_stop_cut(text: str, last_token_start: int, stop: str, include: bool, kept: str) -> None:
    assert text[: stop_cut(text, last_token_start, stop, include)] == kept
