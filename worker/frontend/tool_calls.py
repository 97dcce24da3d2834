"""A chat answer's tool calls and reasoning, shaped as vLLM 0.32's server shapes them (its
`chat_completion/serving.py`), from what an output parser found (no vllm here: the parsers are
vLLM's own, run by worker/frontend/vllm_parsers.py behind the `OutputParser` protocol).

vLLM's rules, kept here:
- the message: with a named or `required` tool choice, `content` is the parser's content or `""`
  and `tool_calls` what it found; with `auto` (tools sent, `--enable-auto-tool-choice`), the
  calls the tool parser found, if any, beside the content left; otherwise the content alone;
- `finish_reason`: `tool_calls` when `auto` found calls, or with `required` when the run
  stopped (`stop`); a named choice keeps `stop`, as OpenAI's API does. Streamed: `tool_calls`
  once a chunk carried tool calls and the choice is not named and stopped;
- `parallel_tool_calls: false` keeps the first call only (a stream's deltas of index 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request asked of tools, as the answer's shaping needs it."""

    named: str | None = None
    """The function a named `tool_choice` forces, else None."""
    required: bool = False
    auto: bool = False
    """Tools sent with `tool_choice` auto, and the frontend parses tool calls (vLLM's
    `--enable-auto-tool-choice` with a `--tool-call-parser`)."""
    parallel: bool = True
    """`parallel_tool_calls` not false."""
    reasoning: bool = False
    """A reasoning parser runs: the message has vLLM's `reasoning` field."""


@dataclass
class Parsed:
    """A whole answer's text split by the parsers: reasoning, content, tool calls (OpenAI's
    `{id, type, function: {name, arguments}}`, arguments a JSON string)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class OutputParser(Protocol):
    """One choice's output parser (vLLM's, one per choice: they keep state)."""

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        """A stream's delta message for the new text (OpenAI's `delta`: `content`,
        `reasoning`, `tool_calls`), or None when it holds the text back."""
        ...

    def final(self, text: str, token_ids: list[int]) -> Parsed:
        """The whole answer split."""
        ...


@dataclass(frozen=True)
class ChatOutput:
    """How a chat answer's choices are shaped: the tool choice, and a fresh output parser per
    choice (None: no parser runs, the text is the content)."""

    choice: ToolChoice
    make_parser: Callable[[], OutputParser | None]


def message(choice: ToolChoice, parsed: Parsed) -> tuple[dict[str, Any], bool]:
    """A non-streamed answer's `message`, and whether `auto` tool calls were made."""
    calls = parsed.tool_calls if choice.parallel else parsed.tool_calls[:1]
    shaped: dict[str, Any] = {"role": "assistant", "content": parsed.content, "tool_calls": []}
    called = False
    if choice.named is not None or choice.required:
        shaped.update(content=parsed.content or "", tool_calls=calls)
    elif choice.auto and calls:
        shaped["tool_calls"] = calls
        called = True
    if choice.reasoning:
        shaped["reasoning"] = parsed.reasoning
    return shaped, called


def finish_reason(choice: ToolChoice, called: bool, finish: str | None) -> str | None:
    """A non-streamed choice's `finish_reason` (`finish`: the OpenAI one of its last frame)."""
    if called or (choice.required and finish == "stop"):
        return "tool_calls"
    return finish


def streamed_finish_reason(
    choice: ToolChoice, streamed_calls: bool, finish: str | None
) -> str | None:
    """A streamed choice's `finish_reason` once it ended."""
    if streamed_calls and choice.named is None and finish == "stop":
        return "tool_calls"
    return finish


def filter_delta(choice: ToolChoice, delta: dict[str, Any]) -> dict[str, Any]:
    """`parallel_tool_calls: false`: a delta's tool calls of index 0 only."""
    if choice.parallel or not delta.get("tool_calls"):
        return delta
    return {**delta, "tool_calls": [c for c in delta["tool_calls"] if c.get("index") == 0]}
