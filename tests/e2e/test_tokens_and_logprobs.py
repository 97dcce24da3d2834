"""Token table and logprob rows, as pure functions over vLLM's own output types."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from messages.frames import TopLogprob
from worker.dev.tiny_model import build
from worker.engine import logprobs
from worker.shared.tokens import TokenTable


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def table(tokenizer) -> TokenTable:
    return TokenTable.from_tokenizer(tokenizer, 1024)


def test_tiny_model_build_is_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    build(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        a = hashlib.sha256((tiny_model / name).read_bytes()).hexdigest()
        b = hashlib.sha256((tmp_path / "again" / name).read_bytes()).hexdigest()
        assert a == b, name


def test_byte_fallback_tokens_carry_their_real_byte(tokenizer, table: TokenTable) -> None:
    # "中" is not in the training corpus: it encodes as its three UTF-8 byte tokens.
    ids = tokenizer("中", add_special_tokens=False).input_ids
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces[-3:] == ["<0xE4>", "<0xB8>", "<0xAD>"]
    assert b"".join(table.byte_values[i] for i in ids).endswith("中".encode())
    e4 = tokenizer.convert_tokens_to_ids("<0xE4>")
    assert table.byte_values[e4] == b"\xe4"
    assert table.texts[e4] == "<0xE4>"  # not valid UTF-8 alone: the piece names it, never U+FFFD
    nl = tokenizer.convert_tokens_to_ids("<0x0A>")
    assert (table.texts[nl], table.byte_values[nl]) == ("\n", b"\n")


def test_pieces_decode_with_their_leading_space(tokenizer, table: TokenTable) -> None:
    text = "Hello world é"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    joined = b"".join(table.byte_values[i] for i in ids).decode()
    assert joined.strip() == text
    assert any(table.texts[i].startswith(" ") for i in ids[1:])
    eos = tokenizer.eos_token_id
    assert (table.texts[eos], table.byte_values[eos]) == ("</s>", b"</s>")


def test_every_vocab_id_has_an_entry(table: TokenTable) -> None:
    assert len(table) == 1024
    assert all(isinstance(b, bytes) for b in table.byte_values)


def test_byte_level_tokenizers_map_back_to_bytes() -> None:
    # GPT-2 style: "Ġ" stands for the space byte, "Ċ" for newline, "Ã©" for é's two bytes.
    table = TokenTable.from_pieces(["Ġhi", "Ċ", "Ã©", "<|eot|>"], {"ByteLevel"}, {"<|eot|>"})
    assert table.byte_values == [b" hi", b"\n", "é".encode(), b"<|eot|>"]
    assert table.texts == [" hi", "\n", "é", "<|eot|>"]
    half = TokenTable.from_pieces(["Ã"], {"ByteLevel"}, set())
    assert half.byte_values == [b"\xc3"] and half.texts == ["Ã"]


def _row_ids(row: list[TopLogprob]) -> list[tuple[int, int]]:
    return [(e.rank, e.token_id) for e in row]


def test_flat_and_dict_shapes_give_identical_rows(table: TokenTable) -> None:
    from vllm.logprobs import FlatLogprobs, Logprob

    # Position 0: sampled 7 at rank 3 (outside top-2); position 1: sampled 4 is the top-1.
    positions = [
        {7: Logprob(-2.0, 3), 4: Logprob(-0.5, 1), 9: Logprob(-1.0, 2)},
        {4: Logprob(-0.1, 1), 8: Logprob(-3.0, 2)},
    ]
    flat = FlatLogprobs()
    flat.append_fast([7, 4, 9], [-2.0, -0.5, -1.0], iter([3, 1, 2]), [None] * 3)
    # Flat keeps duplicates: the sampled token first, then the top-k again.
    flat.append_fast([4, 4, 8], [-0.1, -0.1, -3.0], iter([1, 1, 2]), [None] * 3)
    lp_flat, rows_flat = logprobs.extract([7, 4], flat, 2, table)
    lp_dict, rows_dict = logprobs.extract([7, 4], positions, 2, table)
    assert lp_flat == lp_dict == [-2.0, -0.1]
    assert rows_flat == rows_dict
    assert _row_ids(rows_flat[0]) == [(1, 4), (2, 9), (3, 7)]  # top-k by rank, then the sampled
    assert _row_ids(rows_flat[1]) == [(1, 4), (2, 8)]
    assert rows_flat[0][2].bytes == table.byte_values[7]


def test_k0_row_is_the_sampled_token_only(table: TokenTable) -> None:
    from vllm.logprobs import FlatLogprobs

    flat = FlatLogprobs()
    flat.append_fast([300], [-4.25], iter([17]), [None])
    lp, rows = logprobs.extract([300], flat, 0, table)
    assert lp == [-4.25]
    assert _row_ids(rows[0]) == [(17, 300)]


def test_prompt_position_zero_is_none_and_misalignment_raises(table: TokenTable) -> None:
    from vllm.logprobs import FlatLogprobs

    prompt = FlatLogprobs()
    prompt.append(None)
    prompt.append_fast([5, 6], [-1.5, -0.2], iter([2, 1]), [None] * 2)
    lp, rows = logprobs.extract([1, 5], prompt, 1, table, prompt=True)
    assert lp == [None, -1.5] and rows[0] is None
    assert _row_ids(rows[1]) == [(1, 6), (2, 5)]

    with pytest.raises(logprobs.AlignmentError, match="2 tokens but logprobs for 1"):
        logprobs.extract([5, 6], prompt[1:], 1, table)
    with pytest.raises(logprobs.AlignmentError, match="logprobs are for token 5, output has 9"):
        logprobs.extract([9], prompt[1:], 1, table)
    with pytest.raises(logprobs.AlignmentError, match="no logprobs for generated position 0"):
        logprobs.extract([1], prompt[:1], 1, table)
