"""vLLM's own request classes and output parsers, for what the frontend takes as vLLM's server
takes it: structured outputs (`response_format`, `structured_outputs`), tools and tool choices,
tool-call and reasoning parsers (`--tool-call-parser`, `--reasoning-parser`).

The only frontend module that imports vllm, and only inside functions, when a request or the
command line asks for one of these: plain text requests never import it, so the frontend serves
them without vllm installed. What is vLLM's here:
- a request's checks and defaults: vLLM's `ChatCompletionRequest` / `CompletionRequest`
  (`tool_choice` defaults to `auto` with tools, one constraint, a named tool among `tools`, a
  `json_schema` with its schema, ...), their `extract_structured_outputs` (`response_format`
  over `structured_outputs`), and the tools as the chat template gets them (`model_dump`);
- `--enable-auto-tool-choice --tool-call-parser NAME --reasoning-parser NAME`: vLLM's
  `ParserManager.get_parser` composes the parser class (`ToolParserManager`,
  `ReasoningParserManager`); its `adjust_request` turns a `required` or named tool choice into
  the structured output that forces it (vLLM's `get_json_schema_from_tools`, or the parser's
  xgrammar structural tag when vLLM enforces strict tool calling, its default), and one parser
  per choice splits the answer (`parse`) or each streamed delta (`parse_delta`);
- the refusals of a tool choice the command line cannot serve, in vLLM's words.

vLLM's `StructuredOutputsParams` then becomes the wire's `guided_decoding` (same fields).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from messages.request import GuidedDecoding
from worker.frontend.errors import OpenAIError, invalid, validation_error
from worker.frontend.schemas import ChatCompletionRequest, SamplingFields
from worker.frontend.tool_calls import ChatOutput, Parsed, ToolChoice

# The fields vLLM's request classes check for us (the rest are the frontend's own).
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs"})
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
# StructuredOutputsParams' options the wire cannot carry: refused, never ignored.
UNCARRIED_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")


@dataclass(frozen=True)
class ParserNames:
    """The command line's parsers (vLLM's flags)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    @property
    def any(self) -> bool:
        return bool(self.reasoning_parser) or (
            self.enable_auto_tool_choice and bool(self.tool_call_parser)
        )


@functools.cache
def parser_class(names: ParserNames, tokenizer: Any) -> Any:
    """vLLM's composed Parser class for these flags (None when they name none), checked against
    the tokenizer as `vllm serve` checks it at start."""
    if not names.any:
        return None
    from vllm.parser import ParserManager

    return ParserManager.get_parser(
        tool_parser_name=names.tool_call_parser,
        reasoning_parser_name=names.reasoning_parser,
        enable_auto_tools=names.enable_auto_tool_choice,
        tokenizer=tokenizer,
    )


def check_parsers(names: ParserNames, tokenizer: Any) -> None:
    """At start: the flags name parsers vLLM has, that work with this tokenizer (else an error
    that says which flag)."""
    if names.enable_auto_tool_choice and not names.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    parser_class(names, tokenizer)


@contextlib.contextmanager
def needs_vllm(param: str) -> Iterator[None]:
    """A request field that needs vLLM's classes, in a frontend installed without vllm: a 400
    naming the field (the frontend's `frontend` extra has no vllm). A refusal of vLLM's that
    names no field names this one."""
    try:
        yield
    except OpenAIError as error:
        if error.param is not None:
            raise
        raise invalid(param, error.message) from error
    except ImportError as error:
        raise invalid(
            param, f"needs vllm installed beside the frontend (vLLM's request classes): {error}"
        ) from error


def _first_set(body: SamplingFields, names: Iterable[str]) -> str:
    return next((n for n in sorted(names) if n in body.model_fields_set), "messages")


def _vllm_error(error: Exception) -> OpenAIError:
    """A vLLM request class's refusal as the frontend's 400 naming the field."""
    import pydantic

    if isinstance(error, pydantic.ValidationError):
        return validation_error(error.errors())
    param = getattr(error, "parameter", None)
    message = str(error.args[0]) if error.args else str(error)
    return OpenAIError(400, message if param is None else f"{param}: {message}",
                       "invalid_request_error", param)  # fmt: skip


def _vllm_request(fields: dict[str, Any], chat: bool) -> Any:
    """vLLM's own request object for the fields that were sent, with its checks."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmChatRequest,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest as VllmCompletionRequest,
    )

    try:
        if chat:
            return VllmChatRequest.model_validate(fields)
        return VllmCompletionRequest.model_validate(fields)
    except Exception as error:  # pydantic's ValidationError, vLLM's VLLMValidationError
        raise _vllm_error(error) from error


def guided_decoding(params: Any) -> GuidedDecoding | None:
    """vLLM's StructuredOutputsParams as the wire's guided_decoding (the same fields)."""
    if params is None:
        return None
    for option in UNCARRIED_OPTIONS:
        if getattr(params, option, False):
            raise invalid(f"structured_outputs.{option}", "not supported by this frontend")
    return GuidedDecoding(
        json=params.json,
        regex=params.regex,
        choice=params.choice,
        grammar=params.grammar,
        json_object=params.json_object,
        structural_tag=params.structural_tag,
        whitespace_pattern=params.whitespace_pattern,
    )


def completion_guided_decoding(body: SamplingFields) -> GuidedDecoding | None:
    """A completions request's structured outputs, as vLLM's CompletionRequest extracts them."""
    if not body.structured:
        return None
    fields = {name: getattr(body, name) for name in STRUCTURED_FIELDS} | {"prompt": "x"}
    fields = {k: v for k, v in fields.items() if v is not None}
    with needs_vllm(_first_set(body, STRUCTURED_FIELDS)):
        request = _vllm_request(fields, chat=False)
        return guided_decoding(_extract(request))


def _extract(request: Any) -> Any:
    try:
        return request.extract_structured_outputs()
    except Exception as error:  # vLLM's VLLMValidationError (e.g. a malformed structural tag)
        raise _vllm_error(error) from error


def tool_dicts_of(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """`tools` as vLLM hands them to the chat template (its `ChatCompletionToolsParam` dumps);
    used by `/tokenize` too."""
    if tools is None:
        return None
    with needs_vllm("tools"):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam

    try:
        return [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]
    except Exception as error:
        raise _vllm_error(error) from error


@dataclass
class ChatPlan:
    """A chat request as vLLM sees it: its vLLM request (adjusted by the parser), the tools the
    template renders, the wire's guided_decoding, and how to parse the answer."""

    request: Any  # vLLM's ChatCompletionRequest
    parser_cls: Any  # vLLM's Parser class, or None
    tool_dicts: list[dict[str, Any]] | None
    guided: GuidedDecoding | None
    choice: ToolChoice
    tokenizer: Any
    template_kwargs: dict[str, Any]
    enable_auto_tools: bool = False

    def output(self, prompt_ids: list[int]) -> ChatOutput | None:
        """How the answer's choices are shaped: None when no parser runs (the text is the
        content, as in vLLM's server without parsers)."""
        if self.parser_cls is None:
            return None
        return ChatOutput(self.choice, functools.partial(self.output_parser, prompt_ids))

    def output_parser(self, prompt_ids: list[int]) -> VllmOutputParser:
        """A fresh parser for one choice (vLLM's parsers keep state)."""
        parser = self.parser_cls(
            self.tokenizer, self.request.tools, chat_template_kwargs=self.template_kwargs
        )
        return VllmOutputParser(parser, self.request, prompt_ids, self.enable_auto_tools)


def _tool_choice_refusal(request: Any, parser_cls: Any, names: ParserNames) -> None:
    """vLLM's refusals of a tool choice that no tool parser serves (its OnlineRenderer)."""
    tool_parser = parser_cls.tool_parser_cls if parser_cls is not None else None
    choice = request.tool_choice
    if tool_parser is not None or choice in (None, "none"):
        return
    if choice == "auto" and not names.enable_auto_tool_choice:
        message = (
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
        )
        raise OpenAIError(400, message, "invalid_request_error", "tool_choice")
    if choice != "auto":
        named = getattr(choice, "function", None)
        described = f'function "{named.name}"' if named is not None else f'"{choice}"'
        message = f"tool_choice={described} requires --tool-call-parser to be set"
        raise OpenAIError(400, message, "invalid_request_error", "tool_choice")


def chat_plan(body: ChatCompletionRequest, names: ParserNames, tokenizer: Any) -> ChatPlan:
    """vLLM's handling of a chat request's structured outputs and tools, before it runs."""
    with needs_vllm(_first_set(body, STRUCTURED_FIELDS | TOOL_FIELDS)):
        return _chat_plan(body, names, tokenizer)


def _chat_plan(body: ChatCompletionRequest, names: ParserNames, tokenizer: Any) -> ChatPlan:
    fields = {name: getattr(body, name) for name in STRUCTURED_FIELDS | TOOL_FIELDS}
    fields = {k: v for k, v in fields.items() if k in body.model_fields_set}
    fields["messages"] = [{"role": "user", "content": ""}]  # checked by the frontend itself
    request = _vllm_request(fields, chat=True)
    parser_cls = parser_class(names, tokenizer)
    _tool_choice_refusal(request, parser_cls, names)
    tool_dicts = tool_dicts_of(fields.get("tools")) if request.tools else None
    template_kwargs = dict(body.chat_template_kwargs or {})
    if parser_cls is not None and (
        parser_cls.always_adjust_request
        or parser_cls.reasoning_parser_cls is not None
        or request.tool_choice != "none"
    ):
        parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=template_kwargs)
        try:
            request = parser.adjust_request(request)
        except Exception as error:
            raise _vllm_error(error) from error
    return ChatPlan(
        request,
        parser_cls,
        tool_dicts,
        guided_decoding(_extract(request)),
        _tool_choice(request, parser_cls, names),
        tokenizer,
        template_kwargs,
        names.enable_auto_tool_choice,
    )


def _tool_choice(request: Any, parser_cls: Any, names: ParserNames) -> ToolChoice:
    choice = request.tool_choice
    named = getattr(getattr(choice, "function", None), "name", None)
    auto_parsing = (
        bool(request.tools)
        and choice in ("auto", None)
        and names.enable_auto_tool_choice
        and parser_cls is not None
        and parser_cls.tool_parser_cls is not None
    )
    return ToolChoice(
        named=named,
        required=choice == "required",
        auto=auto_parsing,
        parallel=request.parallel_tool_calls is not False,
        reasoning=parser_cls is not None and parser_cls.reasoning_parser_cls is not None,
    )


class VllmOutputParser:
    """One choice's vLLM Parser (tool calls, reasoning), as worker.frontend.tool_calls'
    OutputParser."""

    def __init__(
        self, parser: Any, request: Any, prompt_ids: list[int], enable_auto_tools: bool
    ) -> None:
        self._parser = parser
        self._request = request
        self._prompt_ids = prompt_ids
        self._enable_auto_tools = enable_auto_tools

    def delta(self, text: str, token_ids: list[int], finished: bool) -> dict[str, Any] | None:
        message = self._parser.parse_delta(
            delta_text=text,
            delta_token_ids=token_ids,
            request=self._request,
            prompt_token_ids=self._prompt_ids,
            finished=finished,
        )
        if message is None:
            return None
        dumped: dict[str, Any] = message.model_dump(exclude_unset=True)
        return dumped

    def final(self, text: str, token_ids: list[int]) -> Parsed:
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.renderers.chat_utils import make_tool_call_id

        self._parser.set_prompt_token_ids(self._prompt_ids)
        reasoning, content, calls = self._parser.parse(
            text,
            self._request,
            enable_auto_tools=self._enable_auto_tools,
            model_output_token_ids=token_ids,
        )
        tool_calls = [
            ToolCall(id=call.id or make_tool_call_id(), function=call).model_dump()
            for call in calls or []
        ]
        return Parsed(reasoning, content, tool_calls)
