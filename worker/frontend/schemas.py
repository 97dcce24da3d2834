"""OpenAI request bodies and their rules (pydantic; FastAPI turns a broken rule into a 400 that
names the field, see app.py).

Every field is honoured or refused with a 400 that names it, never silently ignored, as the
worker does on the wire: stop strings, `best_of`, `suffix`, `logit_bias`, tools, response
formats, `prompt_logprobs`, `skip_special_tokens: false`, guided decoding and any field not
declared here are refused (`extra="forbid"`). Besides OpenAI's fields, vLLM's sampling extras
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids` and (chat)
`chat_template_kwargs` are honoured, so requests written for vLLM's server work here too.
OpenAI's bookkeeping fields that do not change an answer (`user`, `metadata`, `store`,
`service_tier`) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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

    model: str
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

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        if self.stop:
            raise InvalidField("stop", "stop strings are not supported by this frontend")
        if self.include_stop_str_in_output:
            raise InvalidField(
                "include_stop_str_in_output", "stop strings are not supported by this frontend"
            )
        if not self.skip_special_tokens:
            raise InvalidField(
                "skip_special_tokens", "only true is supported (special tokens leave the text)"
            )
        if self.prompt_logprobs is not None:
            raise InvalidField(
                "prompt_logprobs",
                "not supported by this frontend (completions: echo with logprobs)",
            )
        if self.logit_bias:
            raise InvalidField("logit_bias", "not supported by this frontend")
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    # A string, or the prompt's token ids. Batches (a list of prompts) are not served.
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
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
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs", "only allowed when logprobs is true")
        if self.tools:
            raise InvalidField("tools", "not supported by this frontend")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise InvalidField("response_format", "only {'type': 'text'} is supported")
        taken = {"add_generation_prompt", "tokenize", "conversation", "messages"}
        if clash := sorted(taken & set(self.chat_template_kwargs or {})):
            raise InvalidField(
                "chat_template_kwargs", f"{', '.join(clash)} are set by the frontend"
            )
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
