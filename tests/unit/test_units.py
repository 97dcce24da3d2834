"""Fast unit tests: no vllm, no torch, no model, no nats-server.

The error table, the stop rule, client grouping for probes, configuration defaults and the
environment, logprob rows over constructed vLLM output shapes, byte-level token tables, and the
import boundaries between the packages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest

from messages.errors import ERROR_CODES, ERRORS, disposition, is_refusal, is_retryable, kind
from tests.unit.test_layers import _modules
from worker.client.reader import RequestEnd
from worker.config import (
    JetStreamSettings,
    NatsConfig,
    WorkerConfig,
    default,
    dev_cache_dir,
    environment,
)
from worker.engine import logprobs
from worker.errors import describe
from worker.shared.tokens import TokenTable

ROOT = Path(__file__).resolve().parents[2]


# --- the error model -----------------------------------------------------------------------------


def test_every_error_code_has_its_properties_spelled_out() -> None:
    assert (
        set(ERRORS)
        == set(ERROR_CODES)
        == {
            "invalid_request",
            "engine_error",
            "overloaded",
            "worker_shutdown",
            "internal_error",
            "deadline_exceeded",
            "client_gone",
            "no_workers",
            "worker_lost",
            "model_not_found",
        }
    )
    assert {c for c in ERROR_CODES if is_retryable(c)} == {
        "engine_error",
        "overloaded",
        "worker_shutdown",
        "internal_error",
        "no_workers",
        "worker_lost",
        "model_not_found",
    }
    assert {c for c in ERROR_CODES if is_refusal(c)} == {
        "overloaded",
        "worker_shutdown",
        "no_workers",
        "model_not_found",
    }
    assert [kind(c).http_status for c in ERROR_CODES] == [
        400,
        500,
        503,
        503,
        500,
        504,
        499,
        503,
        503,
        404,
    ]
    assert all(kind(c).meaning for c in ERROR_CODES)
    assert kind("a-newer-code").http_status == 500 and not is_retryable("a-newer-code")


def test_jetstream_disposition_follows_the_error_table() -> None:
    assert disposition(None, attempts_left=True) == "ack"
    assert disposition("engine_error", attempts_left=True) == "nak"
    assert disposition("engine_error", attempts_left=False) == "term"
    assert disposition("invalid_request", attempts_left=True) == "term"
    assert disposition("client_gone", attempts_left=True) == "term"
    # Another worker may hold the adapter: redelivered while attempts are left.
    assert disposition("model_not_found", attempts_left=True) == "nak"


def test_worker_exceptions_carry_their_code() -> None:
    from worker.engine.contract import EngineDead, EngineFailure, InvalidRequest
    from worker.framing import FrameTooLarge, Undeliverable

    assert InvalidRequest("f", "r").code == "invalid_request"
    assert EngineFailure().code == EngineDead().code == "engine_error"
    assert FrameTooLarge().code == "engine_error"
    assert logprobs.AlignmentError().code == "engine_error"
    assert Undeliverable().code == "client_gone"


def test_describe_is_never_empty() -> None:
    try:
        try:
            raise KeyError("lost")
        except KeyError as cause:
            raise RuntimeError() from cause
    except RuntimeError as error:
        assert describe(error) == "RuntimeError: KeyError: 'lost'"
    assert describe(ValueError()) == "ValueError"
    assert describe(ValueError("bad")) == "ValueError: bad"


# --- the reader's stop rule ----------------------------------------------------------------------


def test_a_request_ends_when_every_choice_finished_or_at_an_error() -> None:
    end = RequestEnd(2)
    assert not end.saw(0, None)
    assert not end.saw(0, "length")
    assert not end.saw(0, "length")  # the same choice twice is still one choice
    assert end.saw(1, "eos")
    errored = RequestEnd(3)
    assert errored.saw(0, "error")
    errored.restart()
    assert not errored.ended and not errored.saw(2, "cancelled")


# --- probes are per client -----------------------------------------------------------------------


def test_client_key_groups_a_connections_inboxes() -> None:
    from worker.nats.liveness import client_key

    a1, a2 = "_INBOX.ABCDEFGHIJKL0000000001", "_INBOX.ABCDEFGHIJKL0000000002"
    b1 = "_INBOX.ZYXWVUTSRQPO0000000001"
    assert client_key(a1) == client_key(a2) == "_INBOX.ABCDEFGHIJKL"
    assert client_key(b1) != client_key(a1)
    assert client_key("_INBOX.mux-prefix.17") == "_INBOX.mux-prefix"
    assert client_key("replies.app.7") == "replies.app"
    assert client_key("short.x") == "short.x"  # unknown scheme: probed on its own
    assert client_key("plain") == "plain"


# --- configuration ------------------------------------------------------------------------------


def test_defaults_live_in_the_config_classes_and_the_environment_is_read_in_one_place() -> None:
    assert default(WorkerConfig, "client_gone_grace_s") == 6.0
    assert default(NatsConfig, "servers") == ["nats://127.0.0.1:4222"]
    assert default(JetStreamSettings, "max_deliver") == 3
    env = {"NATS_URL": "nats://a:1", "WORKER_MAX_CONCURRENCY": "8", "UNRELATED": "x"}
    assert environment(env) == {"nats_url": "nats://a:1", "max_concurrency": "8"}
    assert dev_cache_dir({"VLLM_NATS_WORKER_CACHE": "/c"}) == Path("/c")
    assert dev_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/vllm-nats-worker")
    assert NatsConfig().user is None  # the dataclasses themselves never read the environment


def test_library_code_never_reads_or_writes_the_environment() -> None:
    allowed = {ROOT / "worker" / "config.py"}
    for path in _modules("worker", "messages"):
        if path in allowed:
            continue
        text = path.read_text()
        assert "os.environ" not in text and "os.getenv" not in text, path


# --- logprob rows over vLLM's output shapes (stand-ins with the same fields) ---------------------


class Logprob(NamedTuple):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs:
    """vLLM's FlatLogprobs layout: per position a [start, end) slice of parallel lists."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def add(self, ids: list[int], values: list[float], ranks: list[int]) -> None:
        self.start_indices.append(len(self.token_ids))
        self.token_ids += ids
        self.logprobs += values
        self.ranks += ranks
        self.decoded_tokens += [None] * len(ids)
        self.end_indices.append(len(self.token_ids))

    def __len__(self) -> int:
        return len(self.start_indices)


@pytest.fixture(scope="module")
def table() -> TokenTable:
    return TokenTable.from_pieces([f"t{i}" for i in range(16)], set(), set())


def test_flat_and_dict_shapes_give_the_same_rows(table: TokenTable) -> None:
    # Position 0: sampled 7 at rank 3 (outside the top 2); position 1: sampled 4 is the top 1.
    positions = [
        {7: Logprob(-2.0, 3), 4: Logprob(-0.5, 1), 9: Logprob(-1.0, 2)},
        {4: Logprob(-0.1, 1), 8: Logprob(-3.0, 2)},
    ]
    flat = FlatLogprobs()
    flat.add([7, 4, 9], [-2.0, -0.5, -1.0], [3, 1, 2])
    flat.add([4, 4, 8], [-0.1, -0.1, -3.0], [1, 1, 2])  # the sampled token first, then top-k
    lp_flat, rows_flat = logprobs.extract([7, 4], flat, 2, table)
    lp_dict, rows_dict = logprobs.extract([7, 4], positions, 2, table)
    assert lp_flat == lp_dict == [-2.0, -0.1]
    assert rows_flat == rows_dict
    assert [(e.rank, e.token_id) for e in rows_flat[0]] == [(1, 4), (2, 9), (3, 7)]
    assert [(e.rank, e.token_id, e.token, e.bytes) for e in rows_flat[1]] == [
        (1, 4, "t4", b"t4"),
        (2, 8, "t8", b"t8"),
    ]


def test_misaligned_logprobs_raise_instead_of_being_sent(table: TokenTable) -> None:
    flat = FlatLogprobs()
    flat.add([5], [-1.5], [1])
    with pytest.raises(logprobs.AlignmentError, match="2 tokens but logprobs for 1"):
        logprobs.extract([5, 6], flat, 1, table)
    with pytest.raises(logprobs.AlignmentError, match="logprobs are for token 5, output has 9"):
        logprobs.extract([9], flat, 1, table)


def test_byte_level_pieces_map_back_to_their_bytes() -> None:
    # GPT-2 style: "Ġ" stands for the space byte, "Ċ" for newline, "Ã©" for é's two bytes.
    table = TokenTable.from_pieces(["Ġhi", "Ċ", "Ã©", "<|eot|>"], {"ByteLevel"}, {"<|eot|>"})
    assert table.byte_values == [b" hi", b"\n", "é".encode(), b"<|eot|>"]
    assert table.texts == [" hi", "\n", "é", "<|eot|>"]


# --- package boundaries ---------------------------------------------------------------------------


def test_text_holds_back_incomplete_utf8_and_drops_it_at_the_end() -> None:
    """As vLLM's incremental detokenizer: a character split over byte tokens appears whole, a
    length cut inside one leaves no U+FFFD, lone bytes at the end give "" (vLLM: ""), lone bytes
    that text follows stay U+FFFD."""
    from worker.frontend.tokenizer import ModelTokenizer

    pieces = ["a", "<0xE4>", "<0xB8>", "<0xAD>", "<0x85>", "</s>"]
    values = [b"a", b"\xe4", b"\xb8", b"\xad", b"\x85", b""]
    tokenizer = ModelTokenizer(None, TokenTable(pieces, values), frozenset({5}))

    def decode(ids: list[int]) -> tuple[list[str], str]:
        decoder = tokenizer.text_decoder()
        deltas = [decoder.feed(i) for i in ids]
        deltas.append(decoder.finish())
        assert "".join(deltas) == decoder.text
        return deltas, decoder.text

    assert decode([0, 1, 2, 3]) == (["a", "", "", "\u4e2d", ""], "a\u4e2d")
    assert decode([0, 1, 2]) == (["a", "", "", ""], "a")  # cut inside the character
    assert decode([4, 4, 4]) == (["", "", "", ""], "")  # a prompt of lone byte tokens
    assert decode([4, 0, 5]) == (["", "\ufffda", "", ""], "\ufffda")
    assert tokenizer.text([0, 1, 2, 3]) == "a\u4e2d"  # the same decoder, fed at once


def test_frontend_options_defaults_and_api_key_from_env(monkeypatch) -> None:
    """The frontend's defaults are FrontendSettings' (host: all interfaces, as vllm serve);
    VLLM_API_KEY gives --api-key its default; several --served-model-name values."""
    from worker.frontend.cli import parse_args, settings_of
    from worker.frontend.settings import FrontendSettings

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    settings = settings_of(parse_args(["--model", "/models/m"]))
    assert (settings.host, settings.port, settings.api_key) == ("0.0.0.0", 8000, None)
    assert settings.model_names == ("/models/m",) and settings.model_path == "/models/m"
    assert settings.host == FrontendSettings(model_names=("x",)).host
    monkeypatch.setenv("VLLM_API_KEY", "sk-env")
    args = parse_args(["--model", "/m", "--served-model-name", "a", "b"])
    assert settings_of(args).api_key == "sk-env"
    assert settings_of(args).model_names == ("a", "b")
    assert settings_of(parse_args(["--model", "/m", "--api-key", "sk-flag"])).api_key == "sk-flag"


def test_process_counts_default_to_auto_sized_from_the_machine() -> None:
    """`--worker-processes` and the frontend's `--processes` default to "auto": 4 worker
    processes per engine core on a GPU host with the cores for them, 1 without a GPU (the CPU
    engine needs the cores); one frontend process per 4 cores, at most 4, so a 2-core machine
    runs one of each and pays nothing."""
    import argparse

    from worker.config import (
        AUTO,
        auto_frontend_processes,
        auto_worker_processes,
        process_count,
    )
    from worker.frontend.cli import parse_args
    from worker.frontend.settings import FrontendSettings

    assert default(WorkerConfig, "processes") == AUTO == "auto"
    assert FrontendSettings().processes == AUTO
    assert parse_args([]).processes == AUTO
    assert parse_args(["--processes", "3"]).processes == 3
    assert process_count("auto") == AUTO and process_count("2") == 2
    with pytest.raises(argparse.ArgumentTypeError, match="must be >= 1, got 0"):
        process_count("0")
    # (gpu, cores, data-parallel size) → worker processes
    assert auto_worker_processes(False, 64) == 1
    assert auto_worker_processes(True, 16) == 4
    assert auto_worker_processes(True, 4) == 2
    assert auto_worker_processes(True, 1) == 1
    assert auto_worker_processes(True, 64, data_parallel=2) == 8
    assert [auto_frontend_processes(c) for c in (1, 2, 4, 8, 16, 128)] == [1, 1, 1, 2, 4, 4]


def test_the_startup_heap_is_frozen_after_a_collection() -> None:
    """worker.shared.gc_heap: start-up's garbage collected first (not pinned), every survivor
    moved to the permanent generation that full collections skip."""
    import gc

    from worker.shared.gc_heap import freeze_startup_heap

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    garbage = Cycle()
    survivor = Cycle()
    del garbage  # unreachable, kept alive only by its cycle until a collection
    gc.disable()  # no automatic collection between here and the freeze
    try:
        frozen_before = gc.get_freeze_count()
        freeze_startup_heap()
        assert gc.get_freeze_count() > frozen_before
        assert not any(type(o) is Cycle and o is not survivor for o in gc.get_objects())
        assert not any(o is survivor for o in gc.get_objects()), "frozen: not in a generation"
    finally:
        gc.unfreeze()  # this test process goes on collecting as before
        gc.enable()
