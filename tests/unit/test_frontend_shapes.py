"""The frontend's shaping of frames into OpenAI bodies and chunks (worker/frontend/answers.py,
openai_shapes.py), fed synthetic frames: no NATS, no model. Wire literals are spelled out.

The fakes here (a tokenizer of a few whole-word pieces and three byte tokens, frame builders)
are shared by the other tests/unit/test_frontend_*.py files."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from msgspec import UNSET

from messages.frames import ErrorInfo, ResponseFrame, TopLogprob
from worker.frontend.answers import (
    ChatAnswer,
    CompletionAnswer,
    ResponseEnvelope,
    choice_index,
    summed_usage,
)
from worker.frontend.catalog import Card
from worker.frontend.openai_shapes import (
    floor_logprob,
    model_cards,
    openai_finish_reason,
    stop_reason,
    tokenize_body,
)
from worker.frontend.prompts import Prompt, encode_prompts
from worker.frontend.schemas import ChatCompletionRequest, CompletionRequest
from worker.frontend.sse import sse
from worker.frontend.tokenizer import ModelTokenizer
from worker.shared.tokens import TokenTable

# id:      0      1       2        3         4    5         6        7        8        9
PIECES = ["<s>", "</s>", "Hello", " world", "!", " there", "<0xE4>", "<0xB8>", "<0xAD>", " stop"]
BYTES = [b"<s>", b"</s>", b"Hello", b" world", b"!", b" there", b"\xe4", b"\xb8", b"\xad", b" stop"]
BOS, EOS, HELLO, WORLD, BANG, THERE, B1, B2, B3, STOP = range(10)
WORDS = {PIECES[i]: i for i in (HELLO, WORLD, BANG, THERE, STOP)}


class FakeHFTokenizer:
    """The few calls ModelTokenizer makes of a transformers tokenizer."""

    chat_template = "{{ messages }}"

    def __call__(self, text: str, add_special_tokens: bool = True) -> SimpleNamespace:
        ids = [BOS] if add_special_tokens else []
        while text:
            word = max((w for w in WORDS if text.startswith(w)), key=len)
            ids.append(WORDS[word])
            text = text[len(word) :]
        return SimpleNamespace(input_ids=ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool, **kw: Any
    ) -> str:
        if kw.get("refuse"):
            raise ValueError("roles must alternate")
        return "".join(message["content"] for message in messages)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [PIECES[i] for i in ids]

    def decode(self, ids: list[int]) -> str:
        return "".join(PIECES[i] for i in ids if i not in (BOS, EOS))


def fake_tokenizer() -> ModelTokenizer:
    return ModelTokenizer(FakeHFTokenizer(), TokenTable(PIECES, BYTES), frozenset({BOS, EOS}))


def row(*entries: tuple[int, float | None]) -> list[TopLogprob]:
    """A logprobs row: (token id, logprob) in rank order."""
    return [
        TopLogprob(rank=rank, token_id=t, token=PIECES[t], logprob=lp, bytes=BYTES[t])
        for rank, (t, lp) in enumerate(entries, 1)
    ]


def frame(
    *token_ids: int,
    index: int = 0,
    finish: str | None = None,
    stop: str | int | None = None,
    logprobs: list[float | None] | None = None,
    rows: list[list[TopLogprob]] | None = None,
    error: tuple[str, str] | None = None,
) -> ResponseFrame:
    return ResponseFrame(
        request_id="r",
        seq=0,
        index=index,
        token_ids=list(token_ids),
        log_probs=UNSET if logprobs is None else logprobs,
        top_logprobs=UNSET if rows is None else rows,
        finish_reason=finish,  # type: ignore[arg-type]
        stop_reason=UNSET if stop is None else stop,
        error=UNSET if error is None else ErrorInfo(*error),  # type: ignore[arg-type]
    )


def prompt_frame(
    logprobs: list[float | None], rows: list[list[TopLogprob] | None]
) -> ResponseFrame:
    return ResponseFrame(
        request_id="r",
        seq=0,
        prompt_position=0,
        prompt_log_probs=logprobs,
        prompt_top_logprobs=rows,
    )


TOKENIZER = fake_tokenizer()
ENVELOPE = ResponseEnvelope("cmpl-1", "m", created=7)


def completion(body: CompletionRequest) -> CompletionAnswer:
    prompts = encode_prompts(TOKENIZER, body.prompts, body.batched)
    return CompletionAnswer(ENVELOPE, TOKENIZER, prompts, body)


def chat(body: ChatCompletionRequest, top_logprobs: int | None = None) -> ChatAnswer:
    envelope = ResponseEnvelope("chatcmpl-1", "m", created=7)
    return ChatAnswer(envelope, TOKENIZER, 3, body, top_logprobs)


def chat_body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Hello"}], **fields)


# --- finish reasons, stop reasons, usage, numbering -------------------------------------------


@pytest.mark.parametrize(
    ("wire", "openai"),
    [("eos", "stop"), ("stop", "stop"), ("length", "length"), ("cancelled", "abort"), (None, None)],
)
def test_wire_finish_reasons_become_openais(wire: str | None, openai: str | None) -> None:
    assert openai_finish_reason(wire) == openai


def test_stop_reason_is_the_matched_string_or_token_id_else_null() -> None:
    assert stop_reason(frame(STOP, finish="stop", stop=" stop")) == " stop"
    assert stop_reason(frame(EOS, finish="stop", stop=EOS)) == EOS
    assert stop_reason(frame(EOS, finish="eos")) is None


def test_batch_choice_index_is_prompt_index_times_n_plus_j() -> None:
    assert [choice_index(p, 3, j) for p in range(2) for j in range(3)] == [0, 1, 2, 3, 4, 5]
    assert choice_index(4, 2, 1) == 9


def test_logprobs_are_floored_for_json() -> None:
    assert floor_logprob(None) == -9999.0
    assert floor_logprob(float("-inf")) == -9999.0
    assert floor_logprob(-12345.0) == -9999.0
    assert floor_logprob(-0.25) == -0.25


def test_envelope_keys_and_usage_only_when_given() -> None:
    assert ENVELOPE.wrap("text_completion", []) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [],
    }
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert ENVELOPE.wrap("x", [], usage)["usage"] == usage


# --- completions ---------------------------------------------------------------------------------


def test_completions_batch_places_each_prompts_choices_and_sums_usage() -> None:
    """Two prompts, n = 2: frames of prompt p, choice j land at p * n + j, in any order."""
    answer = completion(CompletionRequest(prompt=["Hello", "Hello world"], n=2))
    answer.feed(1, frame(BANG, index=0, finish="length"))
    answer.feed(0, frame(THERE, index=1, finish="eos"))
    answer.feed(0, frame(WORLD, index=0, finish="length"))
    answer.feed(1, frame(EOS, index=1, finish="stop", stop=EOS))
    body = answer.body()
    assert body["object"] == "text_completion"
    assert [
        (c["index"], c["text"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]
    ] == [
        (0, " world", "length", None),
        (1, " there", "stop", None),
        (2, "!", "length", None),
        (3, "", "stop", EOS),
    ]
    assert all(c["logprobs"] is None for c in body["choices"])
    # Prompts: <s> Hello and <s> Hello world; one token per choice.
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert summed_usage(5, answer.choices) == body["usage"]


def test_completions_logprobs_table_with_the_sampled_token_beyond_top_k() -> None:
    answer = completion(CompletionRequest(prompt="Hello", logprobs=1, stream=True))
    first = answer.next_chunk(0, frame(WORLD, logprobs=[-0.5], rows=[row((WORLD, -0.5))]))
    last = answer.next_chunk(
        0, frame(BANG, finish="length", logprobs=[-2.0], rows=[row((THERE, -0.1), (BANG, -2.0))])
    )
    assert first is not None and last is not None
    assert first["choices"] == [
        {
            "index": 0,
            "text": " world",
            "logprobs": {
                "tokens": [" world"],
                "token_logprobs": [-0.5],
                "top_logprobs": [{" world": -0.5}],
                "text_offset": [0],
            },
            "finish_reason": None,
            "stop_reason": None,
        }
    ]
    assert last["choices"][0]["logprobs"] == {
        "tokens": ["!"],
        "token_logprobs": [-2.0],
        "top_logprobs": [{" there": -0.1, "!": -2.0}],  # top 1 plus the sampled one
        "text_offset": [6],
    }
    assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"]) == (
        "length",
        None,
    )
    whole = answer.body()["choices"][0]["logprobs"]
    assert whole["tokens"] == [" world", "!"] and whole["text_offset"] == [0, 6]


def test_completions_stream_chunks_skip_frames_that_bring_nothing() -> None:
    """Bytes of one character: no chunk until it is whole; the end always makes one."""
    answer = completion(CompletionRequest(prompt="Hello", stream=True))
    assert answer.next_chunk(0, frame(B1)) is None
    assert answer.next_chunk(0, frame(B2)) is None
    chunk = answer.next_chunk(0, frame(B3))
    assert chunk is not None and chunk["object"] == "text_completion"
    assert chunk["choices"][0]["text"] == "\u4e2d"
    end = answer.next_chunk(0, frame(EOS, finish="eos"))
    assert end is not None and end["choices"][0]["text"] == ""
    assert end["choices"][0]["finish_reason"] == "stop"
    assert answer.usage_chunk() == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6},
    }


def test_completions_echo_puts_the_prompt_text_in_front() -> None:
    answer = completion(CompletionRequest(prompt="Hello", echo=True))
    answer.feed(0, frame(WORLD, finish="length"))
    assert answer.body()["choices"][0]["text"] == "Hello world"


def test_completions_echo_with_logprobs_has_a_null_first_position_and_offsets() -> None:
    answer = completion(CompletionRequest(prompt="Hello world", echo=True, logprobs=1))
    answer.feed(
        0,
        prompt_frame(
            [None, -1.0, -0.5], [None, row((HELLO, -1.0)), row((THERE, -0.3), (WORLD, -0.5))]
        ),
    )
    answer.feed(0, frame(BANG, finish="length", logprobs=[-0.1], rows=[row((BANG, -0.1))]))
    choice = answer.body()["choices"][0]
    assert choice["text"] == "Hello world!"
    assert choice["logprobs"] == {
        "tokens": ["<s>", "Hello", " world", "!"],
        "token_logprobs": [None, -1.0, -0.5, -0.1],
        "top_logprobs": [None, {"Hello": -1.0}, {" there": -0.3, " world": -0.5}, {"!": -0.1}],
        "text_offset": [0, 0, 5, 11],
    }


def test_prompt_scoring_returns_the_prompt_alone_and_counts_no_completion_tokens() -> None:
    answer = completion(CompletionRequest(prompt="Hello", echo=True, max_tokens=0))
    answer.feed(0, frame(WORLD, finish="length"))
    body = answer.body()
    assert body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}


def test_completions_stop_string_is_cut_or_kept_with_include_stop_str_in_output() -> None:
    for include, text in ((False, " world"), (True, " world stop")):
        body = CompletionRequest(prompt="Hello", stop=[" stop"], include_stop_str_in_output=include)
        answer = completion(body)
        answer.feed(0, frame(WORLD))
        answer.feed(0, frame(STOP, finish="stop", stop=" stop"))
        choice = answer.body()["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (
            text,
            "stop",
            " stop",
        )


# --- chat ----------------------------------------------------------------------------------------


def test_chat_body_message_finish_and_usage() -> None:
    answer = chat(chat_body(n=2))
    answer.feed(0, frame(WORLD, index=1, finish="length"))
    answer.feed(0, frame(THERE, BANG, index=0, finish="cancelled"))
    body = answer.body()
    assert body["object"] == "chat.completion"
    assert body["id"] == "chatcmpl-1"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": " there!"},
            "logprobs": None,
            "finish_reason": "abort",
            "stop_reason": None,
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": " world"},
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        },
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_logprobs_content_with_exactly_k_top_logprobs() -> None:
    """The row holds the top k and the sampled token beyond them: chat shows the first k."""
    answer = chat(chat_body(logprobs=True, top_logprobs=1), top_logprobs=1)
    answer.feed(
        0, frame(WORLD, finish="length", logprobs=[None], rows=[row((THERE, -0.2), (WORLD, None))])
    )
    content = answer.body()["choices"][0]["logprobs"]["content"]
    assert content == [
        {
            "token": " world",
            "logprob": -9999.0,
            "bytes": list(b" world"),
            "top_logprobs": [{"token": " there", "logprob": -0.2, "bytes": list(b" there")}],
        }
    ]


def test_chat_stream_opens_with_the_role_then_content_then_usage() -> None:
    answer = chat(chat_body(n=2, stream=True))
    openings = answer.opening_chunks()
    assert [c["choices"] for c in openings] == [
        [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        for i in (0, 1)
    ]
    assert {c["object"] for c in openings} == {"chat.completion.chunk"}
    chunk = answer.next_chunk(0, frame(HELLO, index=1))
    assert chunk is not None and chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"] == [
        {
            "index": 1,
            "delta": {"content": "Hello"},
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
    ]
    end = answer.next_chunk(0, frame(EOS, index=1, finish="eos"))
    assert end is not None and end["choices"][0]["finish_reason"] == "stop"
    assert end["choices"][0]["delta"] == {"content": ""}
    assert answer.usage_chunk()["choices"] == []
    assert answer.usage_chunk()["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
    }


def test_chat_stream_sends_logprob_entries_of_a_split_character_at_once() -> None:
    """With logprobs, a byte token's chunk goes out (its entry) though its text waits."""
    answer = chat(chat_body(logprobs=True, stream=True), top_logprobs=0)
    first = answer.next_chunk(0, frame(B1, logprobs=[-0.1], rows=[row((B1, -0.1))]))
    assert first is not None
    assert first["choices"][0]["delta"] == {"content": ""}
    entry = first["choices"][0]["logprobs"]["content"][0]
    assert (entry["token"], entry["bytes"], entry["top_logprobs"]) == ("<0xE4>", [0xE4], [])
    answer.next_chunk(0, frame(B2, logprobs=[-0.1], rows=[row((B2, -0.1))]))
    last = answer.next_chunk(0, frame(B3, finish="length", logprobs=[-0.1], rows=[row((B3, -0.1))]))
    assert last is not None and last["choices"][0]["delta"] == {"content": "\u4e2d"}


def test_chat_stream_holds_back_a_possible_stop_string_start() -> None:
    answer = chat(chat_body(stop=" stop", stream=True))
    running = answer.next_chunk(0, frame(WORLD))
    assert running is not None and running["choices"][0]["delta"] == {"content": " w"}
    end = answer.next_chunk(0, frame(STOP, finish="stop", stop=" stop"))
    assert end is not None
    assert end["choices"][0]["delta"] == {"content": "orld"}
    assert (end["choices"][0]["finish_reason"], end["choices"][0]["stop_reason"]) == (
        "stop",
        " stop",
    )


# --- other bodies --------------------------------------------------------------------------------


def test_sse_event_framing_and_non_finite_floats_as_null() -> None:
    event = sse({"logprob": float("-inf"), "text": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert msgspec.json.decode(event[len(b"data: ") :]) == {"logprob": None, "text": "é"}


def test_models_and_tokenize_bodies() -> None:
    cards = [
        Card("a", "/models/m", None, 2048),
        Card("b", "", None, None),
        Card("lora-1", "/adapters/1", "a", None),
    ]
    models = model_cards(cards)
    assert models["object"] == "list"
    assert [
        (m["id"], m["object"], m["root"], m["parent"], m["max_model_len"]) for m in models["data"]
    ] == [
        ("a", "model", "/models/m", None, 2048),
        ("b", "model", "b", None, None),
        ("lora-1", "model", "/adapters/1", "a", None),
    ]
    assert tokenize_body([0, 2], None, ["<s>", "Hello"]) == {
        "count": 2,
        "max_model_len": None,
        "tokens": [0, 2],
        "token_strs": ["<s>", "Hello"],
    }


def test_prompts_keep_their_text_for_echo() -> None:
    assert encode_prompts(TOKENIZER, ["Hello", [HELLO, WORLD]], True) == [
        Prompt([BOS, HELLO], "Hello"),
        Prompt([HELLO, WORLD], None),
    ]
