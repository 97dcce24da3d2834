"""The fast FlatLogprobs merge gives exactly what vLLM's own `extend` gives."""

from __future__ import annotations

import random

import pytest

vllm_logprobs = pytest.importorskip("vllm.logprobs")
FlatLogprobs = vllm_logprobs.FlatLogprobs
Logprob = vllm_logprobs.Logprob


def _random_flat(rng: random.Random, positions: int, k: int) -> FlatLogprobs:
    flat = FlatLogprobs()
    for _ in range(positions):
        count = rng.choice([k, k + 1])  # the sampled token outside the top-k adds an entry
        ids = [rng.randrange(32000) for _ in range(count)]
        flat.append_fast(
            ids,
            [-rng.random() * 10 for _ in ids],
            iter(range(1, count + 1)),
            [None] * count,
        )
    return flat


def _fields(flat: FlatLogprobs) -> tuple:
    return (
        flat.start_indices,
        flat.end_indices,
        flat.token_ids,
        flat.logprobs,
        flat.ranks,
        flat.decoded_tokens,
    )


def _reference_extend(target: FlatLogprobs, other) -> None:
    """vLLM's own semantics: append each position of `other` as its dict."""
    for position in other:
        target.append(position)


def test_fast_merge_equals_vllms_extend_on_delta_slices() -> None:
    from worker.engine import fast_merge as vllm_fast_merge

    assert vllm_fast_merge.install()
    rng = random.Random(0)
    for trial in range(50):
        k = rng.choice([0, 1, 5, 20])
        whole = _random_flat(rng, rng.randint(1, 12), k)
        cut = rng.randint(0, len(whole))
        head, tail = whole[:cut], whole[cut:]  # DELTA outputs are slices like these
        expected = whole[:cut]
        _reference_extend(expected, tail)
        head.extend(tail)
        assert _fields(head) == _fields(expected) == _fields(whole[:]), trial
        # The merged container reads back the same positions.
        assert [dict(p) for p in head] == [dict(p) for p in whole]


def test_non_flat_and_non_contiguous_arguments_take_vllms_path() -> None:
    from worker.engine import fast_merge as vllm_fast_merge

    assert vllm_fast_merge.install()
    flat = FlatLogprobs()
    flat.extend([{5: Logprob(-0.5, 1, None)}, {7: Logprob(-1.5, 2, None)}])
    assert _fields(flat)[:4] == ([0, 1], [1, 2], [5, 7], [-0.5, -1.5])
    odd = FlatLogprobs(
        start_indices=[1],
        end_indices=[2],
        token_ids=[9, 8],
        logprobs=[-9.0, -8.0],
        ranks=[1, 1],
        decoded_tokens=[None, None],
    )  # position 0 covers data index 1 only: not laid out from 0
    flat.extend(odd)
    assert flat.token_ids == [5, 7, 8] and flat.end_indices == [1, 2, 3]


def test_installed_only_on_the_vllm_releases_it_was_written_for(monkeypatch, caplog) -> None:
    import vllm

    from worker.engine import fast_merge as vllm_fast_merge

    original = vllm_fast_merge._original or FlatLogprobs.extend
    was_installed = vllm_fast_merge.installed()
    vllm_fast_merge.uninstall()
    try:
        assert FlatLogprobs.extend is original  # vLLM's own method is back
        monkeypatch.setattr(vllm, "__version__", "0.40.1")
        assert not vllm_fast_merge.install()
        assert "fast logprob merge not installed" in caplog.text
        assert FlatLogprobs.extend is original
        monkeypatch.setattr(vllm, "__version__", "0.24.0")
        assert vllm_fast_merge.install()
        assert FlatLogprobs.extend is not original
    finally:
        vllm_fast_merge.uninstall()
        if was_installed:
            monkeypatch.undo()
            assert vllm_fast_merge.install()


def test_starting_an_engine_does_not_install_it() -> None:
    """Only the composition root (worker.process.serve) and the test session install it."""
    import inspect

    from worker import process
    from worker.engine import vllm_adapter as vllm_engine

    assert "vllm_fast_merge.install" not in inspect.getsource(vllm_engine)
    assert "fast_merge.install()" in inspect.getsource(process.serve)
