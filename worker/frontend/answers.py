"""One HTTP request's answer, assembled from its frames (no I/O here):
- its choices: a completions batch's numbered `prompt_index * n + j` (j: the frame's `index`
  within its prompt), as vLLM numbers them; a chat request's by the frame's `index`;
- the envelope every body and chunk of the request shares (`id`, `object`, `created`, `model`);
- its usage: the prompts' tokens and the sum of the choices' generated tokens;
- a stream's chunks: one per frame that brings text, logprobs or the choice's end; chat's
  first chunk per choice carries the role alone, as OpenAI's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from messages.frames import ResponseFrame, TopLogprob
from worker.frontend.openai_shapes import (
    ChatChoice,
    CompletionChoice,
    PromptEcho,
    prompt_echo,
    usage,
)
from worker.frontend.prompts import Prompt
from worker.frontend.schemas import ChatCompletionRequest, CompletionRequest
from worker.frontend.tokenizer import ModelTokenizer
from worker.frontend.tool_calls import ChatOutput

Choice = TypeVar("Choice", bound=ChatChoice | CompletionChoice)


def choice_index(prompt_index: int, n: int, j: int) -> int:
    """The response's index of choice `j` of prompt `prompt_index` when each prompt has `n`."""
    return prompt_index * n + j


def summed_usage(
    prompt_tokens: int, choices: Sequence[ChatChoice | CompletionChoice]
) -> dict[str, int]:
    """`usage`: the prompts' tokens, and every choice's generated tokens summed."""
    return usage(prompt_tokens, sum(choice.completion_tokens for choice in choices))


@dataclass(frozen=True)
class ResponseEnvelope:
    """What every body and chunk of one response carries around its choices."""

    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(
        self, object_: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
    ) -> dict[str, Any]:
        wrapped = {
            "id": self.request_id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            wrapped["usage"] = usage
        return wrapped


def ended(choice: ChatChoice | CompletionChoice, frame: ResponseFrame) -> dict[str, Any]:
    """A chunk's `finish_reason` and `stop_reason`: the choice's once this frame ended it."""
    done = frame.finish_reason is not None
    return {
        "finish_reason": choice.finish_reason if done else None,
        "stop_reason": choice.stop_reason if done else None,
    }


def completion_chunk_choice(
    choice: CompletionChoice, delta: str, logprobs: dict[str, list[Any]], frame: ResponseFrame
) -> dict[str, Any] | None:
    """A streamed completions choice; None when the frame brings nothing to send."""
    if not delta and not logprobs["tokens"] and frame.finish_reason is None:
        return None
    return {
        "index": choice.index,
        "text": delta,
        "logprobs": logprobs if choice.logprobs_k is not None else None,
        **ended(choice, frame),
    }


def chat_chunk_choice(
    choice: ChatChoice, delta: str, entries: list[dict[str, Any]], frame: ResponseFrame
) -> dict[str, Any] | None:
    """A streamed chat choice; None when the frame brings nothing to send. With an output
    parser the delta is the parser's (content, reasoning, tool calls), `{}` when it held the
    text back from a frame that must still be sent (logprobs, the end), as vLLM's server."""
    message = choice.delta(delta)
    quiet = message is None if choice.parser is not None else not delta
    if quiet and not entries and frame.finish_reason is None:
        return None
    return {
        "index": choice.index,
        "delta": message if message is not None else {},
        "logprobs": {"content": entries} if choice.top_logprobs is not None else None,
        **ended(choice, frame),
    }


def chat_opening_choice(index: int) -> dict[str, Any]:
    """Chat's first chunk of a choice: the role alone."""
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


class Answer(Generic[Choice]):
    """A response being assembled: `feed` each frame (non-streamed) or take `next_chunk` of
    each (streamed), then `body()` or `usage_chunk()`."""

    body_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(
        self, envelope: ResponseEnvelope, prompt_tokens: int, choices: list[Choice]
    ) -> None:
        self.envelope = envelope
        self.prompt_tokens = prompt_tokens
        self.choices = choices

    def feed(self, prompt: int, frame: ResponseFrame) -> None:
        self.chunk_choice(prompt, frame)

    def chunk_choice(self, prompt: int, frame: ResponseFrame) -> dict[str, Any] | None:
        raise NotImplementedError

    def body_choices(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def opening_choices(self) -> list[dict[str, Any]]:
        return []

    def usage(self) -> dict[str, int]:
        return summed_usage(self.prompt_tokens, self.choices)

    def body(self) -> dict[str, Any]:
        return self.envelope.wrap(self.body_object, self.body_choices(), self.usage())

    def opening_chunks(self) -> list[dict[str, Any]]:
        return [self.envelope.wrap(self.chunk_object, [c]) for c in self.opening_choices()]

    def next_chunk(self, prompt: int, frame: ResponseFrame) -> dict[str, Any] | None:
        """The chunk a frame of prompt `prompt` makes; None when it makes none."""
        choice = self.chunk_choice(prompt, frame)
        return None if choice is None else self.envelope.wrap(self.chunk_object, [choice])

    def usage_chunk(self) -> dict[str, Any]:
        """`stream_options.include_usage`: the last chunk, no choices and the usage."""
        return self.envelope.wrap(self.chunk_object, [], self.usage())


@dataclass
class PromptLogprobs:
    """A prompt's logprobs as its frames bring them (they precede its generated tokens)."""

    values: list[float | None] = field(default_factory=list)
    rows: list[list[TopLogprob] | None] = field(default_factory=list)


class CompletionAnswer(Answer[CompletionChoice]):
    """`/v1/completions`: `n` choices per prompt; with `echo`, each choice's text starts with
    its prompt (and its logprobs with the prompt's)."""

    body_object = chunk_object = "text_completion"

    def __init__(
        self,
        envelope: ResponseEnvelope,
        tokenizer: ModelTokenizer,
        prompts: Sequence[Prompt],
        body: CompletionRequest,
    ) -> None:
        choices = [
            CompletionChoice(
                choice_index(p, body.n, j),
                tokenizer,
                body.logprobs,
                score_only=body.scoring,
                stop=body.stop_strings,
                include_stop=body.include_stop_str_in_output,
            )
            for p in range(len(prompts))
            for j in range(body.n)
        ]
        super().__init__(envelope, sum(len(p.token_ids) for p in prompts), choices)
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.n = body.n
        self.echo = body.echo
        self.logprobs = body.logprobs
        self.prompt_logprobs = [PromptLogprobs() for _ in prompts]

    def prompt_echo(self, prompt: int) -> PromptEcho:
        logprobs = self.prompt_logprobs[prompt]
        return prompt_echo(
            self.tokenizer,
            self.prompts[prompt].token_ids,
            self.prompts[prompt].text,
            logprobs.values,
            logprobs.rows,
            self.logprobs is not None,
        )

    def chunk_choice(self, prompt: int, frame: ResponseFrame) -> dict[str, Any] | None:
        if frame.prompt_log_probs:
            self.prompt_logprobs[prompt].values.extend(frame.prompt_log_probs)
            self.prompt_logprobs[prompt].rows.extend(frame.prompt_top_logprobs or [])
            return None
        choice = self.choices[choice_index(prompt, self.n, frame.index)]
        if self.echo and choice.echo is None:
            choice.echo = self.prompt_echo(prompt)
        delta, logprobs = choice.add(frame)
        return completion_chunk_choice(choice, delta, logprobs, frame)

    def body_choices(self) -> list[dict[str, Any]]:
        return [choice.choice() for choice in self.choices]


class ChatAnswer(Answer[ChatChoice]):
    """`/v1/chat/completions`: one prompt (the rendered messages), `n` choices."""

    body_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        envelope: ResponseEnvelope,
        tokenizer: ModelTokenizer,
        prompt_tokens: int,
        body: ChatCompletionRequest,
        top_logprobs: int | None,
        output: ChatOutput | None = None,
    ) -> None:
        choices = [
            ChatChoice(
                i,
                tokenizer,
                top_logprobs,
                stop=body.stop_strings,
                include_stop=body.include_stop_str_in_output,
                tools=None if output is None else output.choice,
                parser=None if output is None else output.make_parser(),
                streamed=body.stream,
            )
            for i in range(body.n)
        ]
        super().__init__(envelope, prompt_tokens, choices)

    def chunk_choice(self, prompt: int, frame: ResponseFrame) -> dict[str, Any] | None:
        choice = self.choices[frame.index]
        delta, entries = choice.add(frame)
        return chat_chunk_choice(choice, delta, entries, frame)

    def body_choices(self) -> list[dict[str, Any]]:
        return [choice.message() for choice in self.choices]

    def opening_choices(self) -> list[dict[str, Any]]:
        return [chat_opening_choice(choice.index) for choice in self.choices]
