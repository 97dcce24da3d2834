"""OpenAI request bodies and their rules (pydantic; FastAPI turns a broken rule into a 400 that
names the field, see errors.py).

Every field is honoured or refused with a 400 that names it, never silently ignored, as the
worker does on the wire: `best_of`, `suffix`, `prompt_logprobs`, `skip_special_tokens: false`,
the older `guided_*` fields (vLLM 0.32's server ignores them) and any field not declared here are
refused (`extra="forbid"`). Structured outputs (`response_format`, `structured_outputs`) and
(chat) `tools`, `tool_choice`, `parallel_tool_calls` are taken loosely typed here and checked
with vLLM's own request classes (worker/frontend/vllm_parsers.py, only when a request sets them).
Besides OpenAI's fields, vLLM's sampling extras `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids` and (chat)
`chat_template_kwargs` are honoured, so requests written for vLLM's server work here too.
Stop strings (`stop`, `include_stop_str_in_output`) go to the worker, which has vLLM match
them; the text is cut here (openai_shapes.ChoiceText). `logit_bias` is honoured (token id
strings → bias, clamped to ±100 as vLLM's server does); `model` may be left out (the first
served name); completions take a batch of prompts and `echo` with `max_tokens` 0 (prompt
scoring).
OpenAI's bookkeeping fields that do not change an answer (`user`, `metadata`, `store`,
`service_tier`) are accepted.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from messages.request import LOGIT_BIAS_MAX

# OpenAI's own range for chat `top_logprobs`; completions' `logprobs` is capped by the worker's
# engine (`--max-logprobs`), which the worker checks and names in its error.
MAX_TOP_LOGPROBS = 20


class InvalidField(ValueError):
    """A rule the schema cannot express alone; `param` is the OpenAI error's `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = f"{param}: {message}"


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    # None (or left out): the first served model name, as vLLM's server.
    model: str | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extras.
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # Structured outputs: OpenAI's `response_format` and vLLM's `structured_outputs`, checked
    # and mapped to the wire's guided_decoding by vLLM's own classes (vllm_parsers.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def structured(self) -> bool:
        """Whether the request asks for structured outputs (a non-text `response_format`, or
        `structured_outputs`)."""
        text = self.response_format is None or self.response_format.get("type") == "text"
        return self.structured_outputs is not None or not text

    @property
    def stop_strings(self) -> list[str] | None:
        """`stop` as a list (OpenAI takes one string or several); None when there is none."""
        if self.stop is None or self.stop == []:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        if any(not stop for stop in self.stop_strings or ()):
            raise InvalidField("stop", "stop strings must not be empty")
        if not self.skip_special_tokens:
            raise InvalidField(
                "skip_special_tokens", "only true is supported (special tokens leave the text)"
            )
        if self.prompt_logprobs is not None:
            raise InvalidField(
                "prompt_logprobs",
                "not supported by this frontend (completions: echo with logprobs)",
            )
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise InvalidField("logit_bias", f"keys must be token ids, got {key!r}")
            if not math.isfinite(bias):
                raise InvalidField("logit_bias", f"bias of {key} must be finite, got {bias}")
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def token_bias(self) -> dict[int, float] | None:
        """`logit_bias` as the wire has it: int ids, biases clamped to ±100 (vLLM's server
        clamps; the wire refuses beyond)."""
        if not self.logit_bias:
            return None
        return {
            int(key): max(-LOGIT_BIAS_MAX, min(LOGIT_BIAS_MAX, bias))
            for key, bias in self.logit_bias.items()
        }


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# What a field of several shapes (a union) must be: pydantic reports a mismatch against each
# shape in turn ("should be a valid string" for a list), so the error says all of them.
UNION_SHAPES = {
    "prompt": "a string, a list of token ids, or a batch: a list of strings or a list of "
    "token-id lists (none empty)",
}


class CompletionRequest(SamplingFields):
    # A string, its token ids, or a batch of either (one NATS request per prompt).
    prompt: str | TokenIds | list[str] | list[TokenIds]
    # 0 only with echo: prompt scoring (the prompt and its logprobs, nothing generated).
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported_completion_fields(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidField("best_of", "not supported by this frontend (use n)")
        if self.suffix:
            raise InvalidField("suffix", "not supported by this frontend")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidField("prompt", "must not be empty")
        if self.max_tokens == 0:
            if not self.echo:
                raise InvalidField("max_tokens", "must be >= 1 (0 only with echo: prompt scoring)")
            if self.min_tokens:
                raise InvalidField("min_tokens", "must be <= max_tokens (0)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (one unless it is a batch)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def batched(self) -> bool:
        return len(self.prompts) > 1 or (
            isinstance(self.prompt, list) and not isinstance(self.prompt[0], int)
        )

    @property
    def scoring(self) -> bool:
        """echo with max_tokens 0: vLLM's prompt scoring."""
        return self.echo and self.max_tokens == 0


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    # An assistant's earlier calls (OpenAI's shape, `function.arguments` a JSON string) and a
    # tool's answer to one: they reach the chat template as vLLM passes them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it (vLLM's rendering): the text content, and
        the tool fields that were sent, tool-call arguments parsed into objects."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls is not None and self.role == "assistant":
            message["tool_calls"] = template_tool_calls(self.tool_calls)
            if not message["tool_calls"]:
                del message["tool_calls"]
        if self.tool_call_id is not None and self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` for the chat template, by vLLM's rule
    (`_postprocess_messages`): each `function.arguments` JSON string parsed to an object; one
    that is empty, not JSON or not an object becomes `{}`."""
    rendered = []
    for position, call in enumerate(calls):
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidField(
                f"tool_calls.{position}", "only tool calls of type 'function' are supported"
            )
        arguments = function.get("arguments")
        parsed: Any = arguments if isinstance(arguments, dict) else None
        if isinstance(arguments, str) and arguments:
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
        arguments = parsed if isinstance(parsed, dict) else {}
        rendered.append({**call, "function": {**function, "arguments": arguments}})
    return rendered


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Tools, checked by vLLM's ChatCompletionRequest (vllm_parsers.py): `tool_choice` left
    # out means "auto" when there are tools, as in vLLM.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs", "only allowed when logprobs is true")
        taken = {"add_generation_prompt", "tokenize", "conversation", "messages", "tools"}
        if clash := sorted(taken & set(self.chat_template_kwargs or {})):
            raise InvalidField(
                "chat_template_kwargs", f"{', '.join(clash)} are set by the frontend"
            )
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def uses_tools(self) -> bool:
        """Whether vLLM's request classes must check this request (tools or a tool choice)."""
        return self.tools is not None or "tool_choice" in self.model_fields_set


class TokenizeCompletionRequest(BaseModel):
    """`POST /tokenize` with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """`POST /tokenize` with chat messages (vLLM's shape): rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the tools rendered into the prompt by the chat template.
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    """`POST /detokenize` (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class EmbeddingRequest(BaseModel):
    """`/v1/embeddings`, by OpenAI's and vLLM's field names: `input` as a string, a list of
    strings, token ids or a list of token-id lists; `encoding_format` float or base64;
    `dimensions` (a Matryoshka model's); vLLM's `use_activation` (false: not normalized) and
    `add_special_tokens`."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    use_activation: bool | None = None
    add_special_tokens: bool = True
    user: str | None = None

    @model_validator(mode="after")
    def _refuse_empty(self) -> EmbeddingRequest:
        if isinstance(self.input, list) and not self.input:
            raise InvalidField("input", "must not be empty")
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input of the request (one unless it is a list of them)."""
        if isinstance(self.input, str) or isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)

    @property
    def batched(self) -> bool:
        return isinstance(self.input, list) and not isinstance(self.input[0], int)
