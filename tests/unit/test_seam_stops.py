"""worker/engine/seam_stops.py: a stop string that straddles a continuation's seam ends the
choice at the token that completes it (on the real engine: tests/e2e/test_migration.py)."""

from __future__ import annotations

import pytest

from worker.engine.seam_stops import SeamStops
from worker.shared.tokens import TokenTable

pytestmark = pytest.mark.unit

PIECES = [b"a", b"b", b"E", b"N", b"D", b" x", b"EN", b"\xc3", b"\xa9", b"<s>"]
TABLE = TokenTable([p.decode(errors="replace") for p in PIECES], PIECES)
A, B, E, N, D, X, EN, HIGH, LOW, SPECIAL = range(len(PIECES))


def test_a_match_begun_in_the_earlier_output_ends_at_the_token_that_completes_it() -> None:
    seam = SeamStops(["END"], [A, B, E], TABLE)
    assert seam.stop_at([N]) is None
    assert seam.stop_at([D, A]) == (0, "END")


def test_several_new_tokens_in_one_step_and_the_first_of_several_strings() -> None:
    seam = SeamStops(["xyz", "ND"], [A, E, N], TABLE)
    assert seam.stop_at([A, D, A]) is None  # "N" + "aD": no match
    seam = SeamStops(["xyz", "ND"], [A, E, N], TABLE)
    assert seam.stop_at([D, A]) == (0, "ND")


def test_a_match_wholly_in_the_new_output_is_left_to_vllm() -> None:
    seam = SeamStops(["END"], [A, B], TABLE)
    assert seam.stop_at([E, N, D]) is None


def test_a_match_wholly_in_the_earlier_output_is_not_found_again() -> None:
    seam = SeamStops(["EN"], [EN, A], TABLE)
    assert seam.stop_at([A, B]) is None


def test_utf8_bytes_split_across_the_seam() -> None:
    seam = SeamStops(["é"], [A, HIGH], TABLE)
    assert seam.stop_at([LOW]) == (0, "é")


def test_nothing_is_looked_at_once_no_match_can_start_in_the_earlier_output() -> None:
    seam = SeamStops(["END"], [A, E], TABLE)
    assert seam.stop_at([A, A]) is None
    assert seam.stop_at([N, D]) is None  # "END" would need the "E" two bytes back: too far
