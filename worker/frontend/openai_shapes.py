"""Frames → OpenAI's shapes, one choice at a time: its text (stop strings cut), its logprobs
(chat's `content[]`, completions' `tokens`/`token_logprobs`/`top_logprobs`/`text_offset`), the
echoed prompt, finish and stop reasons; and the bodies of usage, `/v1/models` and `/tokenize`.

Invariants carried over from the wire (messages/frames.py): a frame's `log_probs` and
`top_logprobs` rows are aligned with its `token_ids`, and each row holds the top k candidates in
rank order followed by the chosen token when its rank is above k. So:
- chat `top_logprobs` = the row's first k entries (exactly the requested length);
- completions `top_logprobs` = the whole row as a map (k entries, or k + 1 when the chosen token
  is not among the top k: OpenAI's and vLLM's "top logprobs plus the sampled one").
`token`/`bytes` are the wire's: the true bytes of the token and their UTF-8 text, or the
vocabulary piece (`<0xE2>`) when a lone byte is not valid UTF-8. JSON has no -inf: logprobs are
floored at -9999.0 as vLLM's server does.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET

from messages.embeddings import unpack
from messages.frames import ResponseFrame, TopLogprob
from worker.client.stops import held_back, stop_cut
from worker.frontend import tool_calls
from worker.frontend.catalog import Card
from worker.frontend.tokenizer import ModelTokenizer
from worker.frontend.tool_calls import OutputParser, Parsed, ToolChoice

LOGPROB_FLOOR = -9999.0

# Wire finish reasons → OpenAI's. `cancelled` (deadline, cancel) has no OpenAI name; vLLM's
# server says "abort" for an aborted request, and so does this frontend.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}


def openai_finish_reason(wire: str | None) -> str | None:
    return None if wire is None else FINISH_REASONS.get(wire, wire)


def floor_logprob(value: float | None) -> float:
    return LOGPROB_FLOOR if value is None or value < LOGPROB_FLOOR else value


def _chosen(row: list[TopLogprob], token_id: int) -> TopLogprob:
    return next(entry for entry in row if entry.token_id == token_id)


def _steps(frame: ResponseFrame) -> list[tuple[int, float | None, list[TopLogprob] | None]]:
    """(token id, logprob, row) per generated token of the frame; None where not asked."""
    values = frame.log_probs or [None] * len(frame.token_ids)
    rows: list[list[TopLogprob] | None] = [None] * len(frame.token_ids)
    if frame.top_logprobs:
        rows = list(frame.top_logprobs)
    return list(zip(frame.token_ids, values, rows, strict=True))


def chat_logprob_entry(
    token_id: int, logprob: float | None, row: list[TopLogprob], k: int
) -> dict[str, Any]:
    chosen = _chosen(row, token_id)
    return {
        "token": chosen.token,
        "logprob": floor_logprob(logprob),
        "bytes": list(chosen.bytes),
        "top_logprobs": [
            {"token": e.token, "logprob": floor_logprob(e.logprob), "bytes": list(e.bytes)}
            for e in row[:k]
        ],
    }


class ChoiceText:
    """A choice's generated text as it may be sent: decoded token by token (TextDecoder) with
    the request's stop strings applied by vLLM's rule (worker.client.stops). While the choice
    runs, its last `max(len(stop)) - 1` characters wait (they may start a match); when it ended
    on a stop string, the text ends at the match. Text once sent is never taken back: the match
    completes in the last token, so it never starts before what was held back."""

    def __init__(self, tokenizer: ModelTokenizer, stop: list[str] | None, include: bool) -> None:
        self._decoder = tokenizer.text_decoder()
        self._hold = held_back(stop, include)
        self._include = include
        self._sent = 0
        self._last_start = 0

    @property
    def decoded(self) -> int:
        """Characters decoded so far (where the next token's text starts)."""
        return len(self._decoder.text)

    def feed(self, token_id: int) -> None:
        self._last_start = len(self._decoder.text)
        self._decoder.feed(token_id)

    def release(self, frame: ResponseFrame) -> str:
        """The text this frame lets out, after its tokens were fed."""
        if frame.finish_reason is None:
            end = len(self._decoder.text) - self._hold
        else:
            self._decoder.finish()
            text = self._decoder.text
            end = len(text)
            if isinstance(frame.stop_reason, str):
                end = stop_cut(text, self._last_start, frame.stop_reason, self._include)
        end = max(end, self._sent)
        delta = self._decoder.text[self._sent : end]
        self._sent = end
        return delta


def stop_reason(frame: ResponseFrame) -> str | int | None:
    """vLLM's `stop_reason` of a choice: the matched stop string or stop token id, else None."""
    return None if frame.stop_reason is UNSET else frame.stop_reason


@dataclass
class ChatChoice:
    """One chat choice being assembled, frame by frame. `tools` (with `parser`, vLLM's output
    parser of this choice, when one runs) shapes tool calls and reasoning as vLLM's server does
    (worker/frontend/tool_calls.py); None: the text is the content."""

    index: int
    tokenizer: ModelTokenizer
    top_logprobs: int | None  # None: logprobs were not asked
    stop: list[str] | None = None
    include_stop: bool = False
    tools: ToolChoice | None = None
    parser: OutputParser | None = None
    streamed: bool = False
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    delta_message: dict[str, Any] | None = None
    """Streamed with a parser: the last frame's delta (None: the parser held its text back)."""
    streamed_calls: bool = False

    def __post_init__(self) -> None:
        self._text = ChoiceText(self.tokenizer, self.stop, self.include_stop)

    def add(self, frame: ResponseFrame) -> tuple[str, list[dict[str, Any]]]:
        """The frame's new text and logprob entries (also kept for the whole answer)."""
        entries = []
        for token_id, logprob, row in _steps(frame):
            self._text.feed(token_id)
            if self.top_logprobs is not None and row is not None:
                entries.append(chat_logprob_entry(token_id, logprob, row, self.top_logprobs))
        self.completion_tokens += len(frame.token_ids)
        delta = self._text.release(frame)
        if frame.finish_reason is not None:
            self.finish_reason = openai_finish_reason(frame.finish_reason)
            self.stop_reason = stop_reason(frame)
        self.text += delta
        self.logprobs += entries
        if self.parser is not None:
            self._parse(delta, list(frame.token_ids), frame.finish_reason is not None)
        return delta, entries

    def _parse(self, delta: str, token_ids: list[int], finished: bool) -> None:
        """Non-streamed: the tokens kept for the final parse; streamed: the frame's delta
        message, and the streamed finish reason."""
        assert self.parser is not None and self.tools is not None
        if not self.streamed:
            self.token_ids += token_ids
            return
        message = self.parser.delta(delta, token_ids, finished)
        if message is not None:
            message = tool_calls.filter_delta(self.tools, message)
            self.streamed_calls = self.streamed_calls or bool(message.get("tool_calls"))
        self.delta_message = message
        if finished:
            self.finish_reason = tool_calls.streamed_finish_reason(
                self.tools, self.streamed_calls, self.finish_reason
            )

    def delta(self, text: str) -> dict[str, Any] | None:
        """A streamed chunk's `delta` for this frame's `text`; None: nothing to send (the
        parser held it back)."""
        if self.parser is None:
            return {"content": text}
        return self.delta_message

    def message(self) -> dict[str, Any]:
        content: dict[str, Any] = {"role": "assistant", "content": self.text}
        finish = self.finish_reason
        if self.tools is not None:
            parsed = (
                self.parser.final(self.text, self.token_ids)
                if self.parser is not None
                else Parsed(None, self.text)
            )
            content, called = tool_calls.message(self.tools, parsed)
            finish = tool_calls.finish_reason(self.tools, called, finish)
        return {
            "index": self.index,
            "message": content,
            "logprobs": {"content": self.logprobs} if self.top_logprobs is not None else None,
            "finish_reason": finish,
            "stop_reason": self.stop_reason,
        }


def empty_completion_logprobs() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


@dataclass
class PromptEcho:
    """`echo`: the prompt's text, and with logprobs its per-position entries (OpenAI's shape:
    position 0 has a null logprob and null top_logprobs, nothing precedes it)."""

    text: str
    logprobs: dict[str, list[Any]] | None


def prompt_echo(
    tokenizer: ModelTokenizer,
    prompt_ids: list[int],
    prompt_text: str | None,
    log_probs: list[float | None],
    rows: list[list[TopLogprob] | None],
    with_logprobs: bool,
) -> PromptEcho:
    decoder = tokenizer.text_decoder()
    starts = []
    for token_id in prompt_ids:
        starts.append(len(decoder.text))
        decoder.feed(token_id)
    decoder.finish()
    text = prompt_text if prompt_text is not None else decoder.text
    # Tokenizers that prepend a space (Metaspace) decode "Hi" as " Hi": offsets count in the
    # text the response returns, so shift by what the decoded prompt has in front of it.
    shift = len(decoder.text) - len(text) if decoder.text.endswith(text) else 0
    if not with_logprobs:
        return PromptEcho(text, None)
    logprobs = empty_completion_logprobs()
    for position, token_id in enumerate(prompt_ids):
        row = rows[position] if position < len(rows) else None
        value = log_probs[position] if position < len(log_probs) else None
        logprobs["tokens"].append(
            _chosen(row, token_id).token if row else tokenizer.token_text(token_id)
        )
        logprobs["token_logprobs"].append(None if row is None else floor_logprob(value))
        logprobs["top_logprobs"].append(
            None if row is None else {e.token: floor_logprob(e.logprob) for e in row}
        )
        logprobs["text_offset"].append(max(0, starts[position] - shift))
    return PromptEcho(text, logprobs)


@dataclass
class CompletionChoice:
    """One completions choice being assembled. `text_offset` is where each token's text starts
    in the choice's `text` (echoed prompt included). `score_only` (echo with max_tokens 0):
    generated tokens are dropped, so the choice is the echoed prompt alone, its finish reason
    the one token's (`length`), and it counts no completion tokens."""

    index: int
    tokenizer: ModelTokenizer
    logprobs_k: int | None  # None: logprobs were not asked
    score_only: bool = False
    stop: list[str] | None = None
    include_stop: bool = False
    echo: PromptEcho | None = None
    text: str = ""
    logprobs: dict[str, list[Any]] = field(default_factory=empty_completion_logprobs)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    completion_tokens: int = 0
    _echoed: bool = False

    def __post_init__(self) -> None:
        self._text = ChoiceText(self.tokenizer, self.stop, self.include_stop)

    def add(self, frame: ResponseFrame) -> tuple[str, dict[str, list[Any]]]:
        """The frame's new text and logprobs (the echoed prompt in front, on the first frame)."""
        delta, logprobs = "", empty_completion_logprobs()
        if not self._echoed:
            self._echoed = True
            if self.echo is not None:
                delta = self.echo.text
                if self.echo.logprobs is not None:
                    logprobs = {key: list(value) for key, value in self.echo.logprobs.items()}
        base = len(self.echo.text) if self.echo is not None else 0
        for token_id, logprob, row in [] if self.score_only else _steps(frame):
            offset = base + self._text.decoded
            self._text.feed(token_id)
            if self.logprobs_k is not None and row is not None:
                logprobs["tokens"].append(_chosen(row, token_id).token)
                logprobs["token_logprobs"].append(floor_logprob(logprob))
                logprobs["top_logprobs"].append({e.token: floor_logprob(e.logprob) for e in row})
                logprobs["text_offset"].append(offset)
        if not self.score_only:
            self.completion_tokens += len(frame.token_ids)
            delta += self._text.release(frame)
        if frame.finish_reason is not None:
            self.finish_reason = openai_finish_reason(frame.finish_reason)
            self.stop_reason = stop_reason(frame)
        self.text += delta
        for key, values in logprobs.items():
            self.logprobs[key] += values
        return delta, logprobs

    def choice(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "text": self.text,
            "logprobs": self.logprobs if self.logprobs_k is not None else None,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_cards(cards: Sequence[Card]) -> dict[str, Any]:
    """`/v1/models`, as vLLM's server lists models and adapters (`root`: the model's directory
    or an adapter's path; `parent`: an adapter's model)."""
    return {
        "object": "list",
        "data": [
            {
                "id": card.name,
                "object": "model",
                "created": 0,
                "owned_by": "vllm-nats-worker",
                "root": card.root or card.name,
                "parent": card.parent,
                "max_model_len": card.max_model_len,
            }
            for card in cards
        ],
    }


def embedding_body(
    request_id: str, model: str, vectors: Sequence[bytes], encoding_format: str, prompt_tokens: int
) -> dict[str, Any]:
    """`/v1/embeddings`' body, as vLLM's server answers it: each vector as floats, or as base64
    of its little-endian float32 bytes (the wire's packing, messages.embeddings)."""
    data = [
        {
            "index": index,
            "object": "embedding",
            "embedding": (
                base64.b64encode(vector).decode("ascii")
                if encoding_format == "base64"
                else unpack(vector)
            ),
        }
        for index, vector in enumerate(vectors)
    ]
    return {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }


def tokenize_body(
    token_ids: list[int], max_model_len: int | None, token_strs: list[str] | None
) -> dict[str, Any]:
    """`/tokenize`, as vLLM's server answers it."""
    return {
        "count": len(token_ids),
        "max_model_len": max_model_len,
        "tokens": token_ids,
        "token_strs": token_strs,
    }
