"""Per-tokenizer table: token id → (text, true bytes), built once when the worker starts.

Frames never depend on vLLM's detokenizer (which is off for speed, and which gives "" or U+FFFD
for byte-fallback pieces): every `token`/`bytes` comes from this table. Invariant: for every id
below the model's vocabulary size there is an entry, so lookups are plain list indexing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in char → the real byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """Types of the fast tokenizer's decoder pipeline (e.g. {"ByteFallback", "Metaspace"})."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    kinds: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                kinds.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(backend.to_str()).get("decoder"))
    return kinds


@dataclass(frozen=True)
class TokenTable:
    texts: list[str]
    byte_values: list[bytes]

    def __len__(self) -> int:
        return len(self.texts)

    @classmethod
    def from_pieces(
        cls, pieces: list[str | None], kinds: set[str], specials: set[str]
    ) -> TokenTable:
        byte_level = "ByteLevel" in kinds
        byte_decoder = _gpt2_byte_decoder() if byte_level else {}
        texts: list[str] = []
        values: list[bytes] = []
        for piece in pieces:
            if piece is None:
                # Padded vocabulary rows the tokenizer does not know: no text, no bytes.
                raw = b""
            elif piece in specials:
                raw = piece.encode()
            elif byte_level:
                raw = (
                    bytes(byte_decoder[c] for c in piece)
                    if all(c in byte_decoder for c in piece)
                    else piece.encode()
                )
            elif (match := _BYTE_PIECE.match(piece)) is not None:
                raw = bytes([int(match.group(1), 16)])
            else:
                # SentencePiece / Metaspace: "▁" stands for the space the token starts with.
                raw = piece.replace("▁", " ").encode()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                # Not valid UTF-8 alone (a lone byte of a multi-byte char): the piece's name keeps
                # the token identifiable; `bytes` carries the truth.
                text = piece or ""
            texts.append(text)
            values.append(raw)
        return cls(texts, values)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int) -> TokenTable:
        """Builds the table for ids 0..vocab_size-1 from a Hugging Face tokenizer."""
        known = len(tokenizer)
        ids = list(range(min(known, vocab_size)))
        pieces: list[str | None] = list(tokenizer.convert_ids_to_tokens(ids))
        pieces += [None] * (vocab_size - len(pieces))
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        added = getattr(tokenizer, "get_added_vocab", None)
        if added is not None:
            specials |= set(added())
        return cls.from_pieces(pieces, _decoder_kinds(tokenizer), specials)
