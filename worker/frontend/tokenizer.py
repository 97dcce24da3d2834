"""The model's tokenizer, as the frontend needs it: prompts in, text out.

Text is built from the true bytes of each token (`worker.shared.tokens.TokenTable`, the same table
the worker uses for `token`/`bytes`), so the text a response returns is exactly the UTF-8 decoding
of its tokens' bytes. Special tokens (e.g. `</s>`) are left out of the text, as vLLM's
`skip_special_tokens=True` default does, but keep their logprob entries.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.shared.tokens import TokenTable


class ChatTemplateMissing(ValueError):
    """The tokenizer has no chat template, so /v1/chat/completions cannot render messages."""


@dataclass
class ModelTokenizer:
    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    table: TokenTable
    special_ids: frozenset[int]

    @classmethod
    def load(cls, path: str | Path) -> ModelTokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path))
        # The table covers every id the tokenizer knows (the worker's covers the model's padded
        # vocabulary too; ids beyond the tokenizer have empty text and bytes in both).
        table = TokenTable.from_tokenizer(tokenizer, len(tokenizer))
        return cls(tokenizer, table, frozenset(tokenizer.all_special_ids))

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Completions: special tokens added the way the tokenizer's own config says (vLLM too)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat template rendered (with the assistant's generation prompt unless told
        otherwise, as `/tokenize` may), then encoded without extra special tokens by default:
        the template already holds them (vLLM does the same). `template_kwargs`: the request's
        `chat_template_kwargs`, variables of the template; `tools`: the request's tools, as
        vLLM passes them (`tools=`, None without)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateMissing("the model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools,
            **(template_kwargs or {}),
        )
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The vocabulary pieces of the ids (`/tokenize`'s `token_strs`, as vLLM gives them)."""
        return list(self.tokenizer.convert_ids_to_tokens(token_ids))

    def decode(self, token_ids: list[int]) -> str:
        """`/detokenize`: the tokenizer's own decode, as vLLM's server does."""
        return str(self.tokenizer.decode(token_ids))

    def __len__(self) -> int:
        return len(self.table)

    def token_text(self, token_id: int) -> str:
        return self.table.texts[token_id] if token_id < len(self.table) else ""

    def token_bytes(self, token_id: int) -> bytes:
        return self.table.byte_values[token_id] if token_id < len(self.table) else b""

    def text(self, token_ids: list[int]) -> str:
        """The text the frontend makes of these tokens, whole (a TextDecoder fed them all)."""
        decoder = self.text_decoder()
        for token_id in token_ids:
            decoder.feed(token_id)
        decoder.finish()
        return decoder.text

    def text_decoder(self) -> TextDecoder:
        return TextDecoder(self)


_REPLACEMENT = "\ufffd"
_PER_BYTE = "vllm-nats-replace-per-byte"


def _replace_per_byte(error: UnicodeError) -> tuple[str, int]:
    """A U+FFFD for each byte that is not UTF-8, as tokenizers' byte-fallback decoder (vLLM's
    detokenizer) writes them; Python's "replace" writes one for a whole cut-short character."""
    assert isinstance(error, UnicodeDecodeError)
    return _REPLACEMENT * (error.end - error.start), error.end


codecs.register_error(_PER_BYTE, _replace_per_byte)


class TextDecoder:
    """Token ids → text, incrementally, as vLLM's incremental detokenizer gives it.

    A multi-byte character split over byte-fallback tokens appears once its last byte arrived.
    Text that ends in U+FFFD (bytes that are not UTF-8 on their own, which later bytes may still
    explain) is held back until something that is not U+FFFD follows; what is still held when
    the answer ends (a length cut inside a character, a prompt of lone byte tokens) is dropped,
    never sent as U+FFFD, as vLLM drops it.
    """

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors=_PER_BYTE)
        self._held = ""
        self.text = ""

    def feed(self, token_id: int) -> str:
        if token_id in self._tokenizer.special_ids:
            return ""
        pending = self._held + self._utf8.decode(self._tokenizer.token_bytes(token_id))
        kept = pending.rstrip(_REPLACEMENT)
        self._held = pending[len(kept) :]
        self.text += kept
        return kept

    def finish(self) -> str:
        """The end of the text: bytes and U+FFFD still held back are dropped."""
        self._utf8.reset()
        self._held = ""
        return ""
