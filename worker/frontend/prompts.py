"""Request prompts → token ids, with the 400 a prompt the frontend cannot encode answers: an
empty completions prompt, chat messages the model's chat template cannot render, a token id
outside the tokenizer's vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.frontend.errors import OpenAIError, invalid
from worker.frontend.schemas import ChatMessage, InvalidField
from worker.frontend.tokenizer import ChatTemplateMissing, ModelTokenizer


@dataclass(frozen=True)
class Prompt:
    """One prompt of a completions request: its token ids, and its text when it came as text
    (`echo` returns that text as given)."""

    token_ids: list[int]
    text: str | None = None


def encode_prompts(
    tokenizer: ModelTokenizer, prompts: Sequence[str | list[int]], batched: bool
) -> list[Prompt]:
    """Each prompt's token ids; an empty one is a 400 (`prompt.<i>` in a batch, else `prompt`)."""
    encoded = []
    for position, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            encoded.append(Prompt(tokenizer.encode_prompt(prompt), prompt))
        else:
            encoded.append(Prompt(list(prompt)))
        if not encoded[-1].token_ids:
            raise invalid(f"prompt.{position}" if batched else "prompt", "must not be empty")
    return encoded


def encode_inputs(
    tokenizer: ModelTokenizer,
    inputs: Sequence[str | list[int]],
    batched: bool,
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """`/v1/embeddings`: each input's token ids (text encoded as vLLM's server does); an empty
    one is a 400 (`input.<i>` in a list, else `input`)."""
    encoded = []
    for position, item in enumerate(inputs):
        tokens = (
            tokenizer.encode_prompt(item, add_special_tokens) if isinstance(item, str) else item
        )
        if not tokens:
            raise invalid(f"input.{position}" if batched else "input", "must not be empty")
        encoded.append(list(tokens))
    return encoded


def encode_messages(
    tokenizer: ModelTokenizer, messages: Sequence[ChatMessage], **options: Any
) -> list[int]:
    """The messages rendered by the chat template and encoded (`options`: encode_chat's; `tools`
    as vLLM hands them to the template). Tool calls and tool results reach the template as
    vLLM passes them (ChatMessage.for_template)."""
    rendered = []
    for position, message in enumerate(messages):
        try:
            rendered.append(message.for_template())
        except InvalidField as error:
            rule = error.message[len(error.param) + 2 :]
            raise invalid(f"messages.{position}.{error.param}", rule) from error
    try:
        return tokenizer.encode_chat(rendered, **options)
    except ChatTemplateMissing as error:
        raise invalid("messages", str(error)) from error
    except Exception as error:  # a template that rejects these messages (roles, order)
        raise invalid("messages", f"the chat template failed: {error}") from error


def check_vocabulary(token_ids: Sequence[int], size: int) -> None:
    """`/detokenize`: every id below the tokenizer's `size`, else a 400 naming the first one."""
    for position, token_id in enumerate(token_ids):
        if token_id >= size:
            raise OpenAIError(
                400,
                f"tokens.{position}: token id {token_id} is outside the tokenizer's "
                f"vocabulary (must be < {size})",
                "invalid_request_error",
                f"tokens.{position}",
            )
