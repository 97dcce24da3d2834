"""One production worker started by its CLI, as a user starts it (`python -m worker` with vLLM
engine arguments and a metrics port), on the real CPU engine: what it takes from vLLM's engine
arguments (`--stream-interval`, `--enable-lora` among them) and from `vllm serve`'s
(`--lora-modules`), its LoRA adapters beside vLLM's own server with the same adapters (over raw
NATS and through the frontend's admin routes), what an operator sees (the stats line, /health,
one log format), and its engine's death with a request in flight (answered, exit 1). The
module's tests share the one process (an engine start is ~40 CPU-seconds here) and run in file
order: the last one ends it. SIGTERM's drain and exit 0 are shown on the --worker-processes
worker (tests/e2e/test_scaleout.py). Its frames coalesced by `--stream-interval` are compared
with those of the session's engine."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import nats
import psutil
import pytest

from messages.codec import MSGPACK
from messages.control import ControlReply, ControlRequest
from messages.embeddings import unpack
from messages.frames import ResponseFrame
from messages.kv import BlocksStored, KvEventBatch, LoadReport
from messages.subjects import Subjects
from tests.helpers import (
    STATS_LINE,
    TEST_SUBJECTS,
    check_row,
    collect,
    discover,
    engine_processes,
    exchange,
    get_health,
    kill_if_running,
    last_worker_line,
    process_text,
    ready_metrics_port,
    scrape,
    serving,
    signal_each,
    start_cli_worker,
    stats_env,
    until_in_flight,
)
from worker.client import complete, generate
from worker.client.reader import RequestError
from worker.client.requests import make_request
from worker.dev.embedded import NatsServer
from worker.frontend.app import FrontendSettings, create_app
from worker.frontend.tokenizer import ModelTokenizer

PROMPT = [1, 300, 301, 302]
SUBJECTS = Subjects("cli", "vllm", "generate")
MAX_MODEL_LEN = 256
MAX_LOGPROBS = 7
ADAPTER, ADAPTER_2 = "tiny-lora", "tiny-lora-2"  # vLLM's server's --lora-modules names
SERVED = "tiny-chat"  # the CLI worker's --served-model-name
LORA_PROMPT = [1, 300, 301, 302, 303]
LORA_TOLERANCE = 1e-4
INTERVAL = 4
# vLLM's text format (after an optional "(process pid=N) " field): level, date, [file:line].
LOG_PREFIX = (
    r"(?:\(\S+ pid=\d+\) )?(INFO|WARNING|ERROR|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[\S+:\d+\] "
)


@dataclass
class CliWorker:
    proc: asyncio.subprocess.Process
    metrics_port: int
    reader: asyncio.Task[None]
    """Collects the output into `lines` until the process closes it."""
    lines: list[str] = field(default_factory=list)

    @property
    def output(self) -> str:
        return "".join(self.lines)


@pytest.fixture(scope="module")
async def cli_worker(
    nats_server: NatsServer, tiny_model: Path, tiny_lora: Path
) -> AsyncIterator[CliWorker]:
    proc = await start_cli_worker(
        nats_server.url,
        tiny_model,
        "--served-model-name",
        SERVED,
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"{ADAPTER}={tiny_lora}",
        "--namespace",
        SUBJECTS.namespace,
        "--instance-id",
        "cli1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
        "--stream-interval",
        str(INTERVAL),
        "--health-interval",
        "1",
        "--enable-log-requests",  # vLLM's flag: the worker's per-request line (off by default)
        env=stats_env("1"),
    )
    lines: list[str] = []
    output = None
    try:
        port = await ready_metrics_port(proc, lines)
        output = asyncio.create_task(collect(proc.stdout, lines))
        yield CliWorker(proc, port, output, lines)
    finally:
        await kill_if_running(proc)
        if output is not None:
            await asyncio.wait_for(output, 30)


async def test_the_cli_worker_takes_vllms_engine_arguments(
    cli_worker: CliWorker, client, tiny_model: Path
) -> None:
    subject = SUBJECTS.generate
    served = await complete(
        client, make_request("cli-1", PROMPT, max_tokens=5, logprobs=7), subject=subject
    )
    assert served.choices[0].finish_reason == "length"
    assert all(len(row) in (7, 8) for row in served.choices[0].top_logprobs)
    raw = await exchange(client, subject, MSGPACK.encode(make_request("cli-2", PROMPT, logprobs=8)))
    assert (
        "must be <= 7 (the engine's max_logprobs)"
        in msgspec.msgpack.decode(raw[0])["error"]["message"]
    )
    raw = await exchange(client, subject, MSGPACK.encode(make_request("cli-3", [5] * 300)))
    assert "max_model_len 256" in msgspec.msgpack.decode(raw[0])["error"]["message"]

    answers = await discover(client, "INFO", instances={"cli1"})
    infos = [i for i in answers if i["metadata"]["instance_id"] == "cli1"]
    assert len(infos) == 1 and infos[0]["metadata"]["max_logprobs"] == "7"
    samples = await asyncio.to_thread(scrape, cli_worker.metrics_port)
    model = f"model_name={SERVED}"
    assert samples[f"nats_worker_requests_total{{{model},outcome=length}}"] == 1
    assert samples[f"nats_worker_errors_total{{code=invalid_request,{model}}}"] == 2
    assert any(name.startswith("vllm:") for name in samples), "vLLM's own metrics are served too"


async def command(client, **fields: Any) -> ControlReply:
    """One admin command to the CLI worker over its control subject."""
    subject = SUBJECTS.control("cli1")
    answer = await client.request(subject, MSGPACK.encode(ControlRequest(**fields)), timeout=60)
    return MSGPACK.decode_as(answer.data, ControlReply)


async def vllm_completion(server, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0.0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
    }
    async with httpx.AsyncClient(timeout=120) as http:
        answer = await http.post(server.base_url + "/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


async def assert_answers_as_vllm(client, vllm_server, model: str, prompt: list[int]) -> list[int]:
    """The CLI worker's greedy tokens and logprobs (top 5 too, 1e-4) for `model`, as vLLM's
    server gives them; returns the tokens."""
    request = make_request(f"lora-{model}", prompt, max_tokens=16, logprobs=5)
    request.model = model
    ours = (await complete(client, request, subject=SUBJECTS.generate)).choices[0]
    theirs = (await vllm_completion(vllm_server, model, prompt))["logprobs"]
    assert ours.token_ids == [int(t.removeprefix("token_id:")) for t in theirs["tokens"]]
    for a, b in zip(ours.log_probs, theirs["token_logprobs"], strict=True):
        assert abs(a - b) <= LORA_TOLERANCE, (a, b)
    for row, top in zip(ours.top_logprobs, theirs["top_logprobs"], strict=True):
        want = {int(k.removeprefix("token_id:")): v for k, v in top.items()}
        got = {entry.token_id: entry.logprob for entry in row}
        assert got.keys() >= want.keys()
        assert all(abs(got[t] - want[t]) <= LORA_TOLERANCE for t in want)
    return ours.token_ids


async def test_lora_adapters_answer_as_vllms_server_and_an_unloaded_one_is_not_found(
    cli_worker: CliWorker, client, vllm_server, tiny_model: Path, tiny_lora: Path, tiny_lora_2: Path
) -> None:
    """`--lora-modules` (vLLM's flag and parser) loads tiny-lora before the worker serves;
    tiny-lora-2 is loaded at run time over the control plane. Each answers as vLLM's server
    with the same adapters, and unlike the base model; once unloaded, a request naming it is
    refused `model_not_found`, never answered by the base model."""
    answers = await discover(client, "INFO", instances={"cli1"})
    (info,) = [i for i in answers if i["metadata"]["instance_id"] == "cli1"]
    assert json.loads(info["metadata"]["adapters"]) == {ADAPTER: str(tiny_lora)}
    loads = await client.subscribe(SUBJECTS.kv("load", "cli1"))
    loaded = await command(
        client, command="load_lora_adapter", lora_name=ADAPTER_2, lora_path=str(tiny_lora_2)
    )
    assert loaded.error is None, loaded.error
    assert loaded.adapters == {ADAPTER: str(tiny_lora), ADAPTER_2: str(tiny_lora_2)}
    # Its load reports name it within a report interval (what a KV router routes an adapter by).
    reported: list[str] | None = None
    while reported != [ADAPTER, ADAPTER_2]:
        msg = await loads.next_msg(timeout=10)
        reported = msgspec.msgpack.decode(msg.data, type=LoadReport).adapters
    await loads.unsubscribe()
    again = await command(
        client, command="load_lora_adapter", lora_name=ADAPTER_2, lora_path=str(tiny_lora_2)
    )
    assert again.error is not None and again.error.code == "invalid_request"
    assert f"The lora adapter '{ADAPTER_2}' has already been loaded" in again.error.message
    base = await complete(
        client, make_request("lora-base", LORA_PROMPT, max_tokens=16), subject=SUBJECTS.generate
    )
    events = await client.subscribe(SUBJECTS.kv("events", "cli1"))
    for adapter in (ADAPTER, ADAPTER_2):
        tokens = await assert_answers_as_vllm(client, vllm_server, adapter, LORA_PROMPT)
        assert tokens != base.choices[0].token_ids, f"{adapter} changed nothing"
    # The blocks an adapter's request cached are published as that adapter's (vLLM hashes the
    # adapter in), so a router's prefix index keeps them apart from the base model's. A prompt
    # longer than a block (the CPU engine's are 128 tokens) stores one.
    long_prompt = [1] + [300 + i for i in range(199)]
    for adapter in (ADAPTER, ADAPTER_2):
        request = make_request(f"lora-long-{adapter}", long_prompt, max_tokens=1)
        request.model = adapter
        await complete(client, request, subject=SUBJECTS.generate)
    stored_for: set[str | None] = set()
    while not {ADAPTER, ADAPTER_2} <= stored_for:
        batch = msgspec.msgpack.decode((await events.next_msg(timeout=10)).data, type=KvEventBatch)
        stored_for |= {e.lora_name for e in batch.events if isinstance(e, BlocksStored)}
    await events.unsubscribe()

    unloaded = await command(client, command="unload_lora_adapter", lora_name=ADAPTER_2)
    assert unloaded.error is None and unloaded.adapters == {ADAPTER: str(tiny_lora)}
    request = make_request("lora-gone", LORA_PROMPT, max_tokens=4)
    request.model = ADAPTER_2
    with pytest.raises(RequestError) as refused:
        await complete(client, request, subject=SUBJECTS.generate)
    assert refused.value.code == "model_not_found"
    assert f"The model `{ADAPTER_2}` does not exist." in refused.value.message
    missing = await command(client, command="unload_lora_adapter", lora_name=ADAPTER_2)
    assert missing.error is not None and missing.error.code == "model_not_found"
    # vLLM 0.32's CPU engine with LoRA on dies on a batch of prompt-logprob requests: refused.
    raw = await exchange(
        client,
        SUBJECTS.generate,
        MSGPACK.encode(make_request("cli-plp", PROMPT, max_tokens=2, prompt_logprobs=1)),
    )
    error = msgspec.msgpack.decode(raw[0])["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith("output_options.prompt_logprobs: not served by this worker")


async def test_the_frontend_loads_lists_routes_and_unloads_adapters_as_vllm(
    cli_worker: CliWorker, nats_server: NatsServer, vllm_server, tiny_model: Path, tiny_lora_2: Path
) -> None:
    """vLLM's `/v1/load_lora_adapter` (VLLM_ALLOW_RUNTIME_LORA_UPDATING), `/v1/models`, a
    completion by the adapter's name (as vLLM's server answers it) and
    `/v1/unload_lora_adapter`, through the frontend to the worker."""
    settings = FrontendSettings(
        model_names=(SERVED,),
        model_path=str(tiny_model),
        subject=SUBJECTS.generate,
        allow_runtime_lora_updating=True,
    )
    nc = await nats.connect(nats_server.url)
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    body = {"lora_name": ADAPTER_2, "lora_path": str(tiny_lora_2)}
    request = {"model": ADAPTER_2, "prompt": "Hello world", "max_tokens": 12, "temperature": 0.0}
    request["logprobs"] = 3
    try:
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=120) as http:
            loaded = await http.post("/v1/load_lora_adapter", json=body)
            assert loaded.status_code == 200, loaded.text
            assert loaded.text == f"Success: LoRA adapter '{ADAPTER_2}' added successfully."
            cards = {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}
            assert cards[ADAPTER_2]["parent"] == SERVED
            assert cards[ADAPTER_2]["root"] == str(tiny_lora_2)
            assert ADAPTER in cards
            ours = (await http.post("/v1/completions", json=request)).json()["choices"][0]
            async with httpx.AsyncClient(timeout=120) as them:
                answer = await them.post(vllm_server.base_url + "/completions", json=request)
            theirs = answer.json()["choices"][0]
            assert ours["text"] == theirs["text"]
            for a, b in zip(
                ours["logprobs"]["token_logprobs"],
                theirs["logprobs"]["token_logprobs"],
                strict=True,
            ):
                assert abs(a - b) <= LORA_TOLERANCE
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER_2})
            assert unloaded.status_code == 200, unloaded.text
            gone = await http.post("/v1/completions", json=request)
            assert gone.status_code == 404
            assert gone.json()["error"] == {
                "message": f"The model `{ADAPTER_2}` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
            again = await http.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER_2})
            assert again.status_code == 404
            message = again.json()["error"]["message"]
            assert message.startswith("1 of 1 workers failed: cli1: model_not_found: ")
            assert f"The lora adapter '{ADAPTER_2}' cannot be found." in message
    finally:
        await nc.close()


async def served_counts(client, instances: set[str]) -> dict[tuple[str, str], int]:
    """(instance id, endpoint subject) → requests taken, from the micro STATS of every worker
    that answers, `instances` among them."""
    counts = {}
    for stats in await discover(client, "STATS", instances=instances):
        instance = stats["metadata"]["instance_id"]
        for endpoint in stats["endpoints"]:
            counts[(instance, endpoint["subject"])] = endpoint["num_requests"]
    return counts


async def test_one_frontend_without_model_serves_every_model_of_the_cluster(
    cli_worker: CliWorker,
    nats_server: NatsServer,
    client,
    embedding_engine,
    vllm_embed_server,
    tiny_embedding_model: Path,
    tiny_lora: Path,
) -> None:
    """A frontend started without `--model` learns the models from the workers' discovery:
    the CLI worker's generator (served as tiny-chat) and its adapter, and an embedding model's
    worker (a second tiny model, pooling). `/v1/models` lists them; each request reaches its
    model's workers (their STATS count it); the embeddings equal vLLM's; once the embedding
    model's last worker leaves, its name is a 404."""
    from worker.config import NatsConfig, WorkerConfig
    from worker.nats.runtime import open_worker

    embed_subjects = Subjects("multi", "vllm", "embed")
    embedder = await open_worker(
        embedding_engine,
        WorkerConfig(
            nats=NatsConfig(servers=[nats_server.url]), subjects=embed_subjects, instance_id="emb1"
        ),
    )
    embed_name = str(tiny_embedding_model)
    nc = await nats.connect(nats_server.url)
    app = create_app(FrontendSettings(discovery_refresh_s=0.5), None, nc=nc)
    texts = ["The quick brown fox", "jumps over the lazy dog", "Hello"]
    try:
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=120) as http:
            cards = {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}
            assert cards[SERVED]["parent"] is None
            assert cards[SERVED]["max_model_len"] == MAX_MODEL_LEN
            assert cards[ADAPTER] == {**cards[ADAPTER], "parent": SERVED, "root": str(tiny_lora)}
            assert cards[embed_name]["root"] == embed_name and cards[embed_name]["parent"] is None
            before = await served_counts(client, {"cli1", "emb1"})

            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
            answer = await http.post("/v1/chat/completions", json={**chat, "model": SERVED})
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == SERVED
            prompt = {"prompt": "Hello world", "max_tokens": 4, "model": ADAPTER}
            answer = await http.post("/v1/completions", json=prompt)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == ADAPTER

            body = {"model": embed_name, "input": texts}
            ours = await http.post("/v1/embeddings", json=body)
            assert ours.status_code == 200, ours.text
            async with httpx.AsyncClient(timeout=120) as them:
                theirs = await them.post(vllm_embed_server.base_url + "/embeddings", json=body)
                theirs64 = await them.post(
                    vllm_embed_server.base_url + "/embeddings",
                    json={**body, "encoding_format": "base64", "dimensions": 16},
                )
            ours64 = await http.post(
                "/v1/embeddings", json={**body, "encoding_format": "base64", "dimensions": 16}
            )
            mine, other = ours.json(), theirs.json()
            assert mine["object"] == "list" and mine["model"] == embed_name
            assert mine["usage"] == other["usage"]
            assert mine.keys() == other.keys()
            assert [d["index"] for d in mine["data"]] == [0, 1, 2]
            for a, b in zip(mine["data"], other["data"], strict=True):
                assert a["object"] == "embedding" and len(a["embedding"]) == 64
                worst = max(abs(x - y) for x, y in zip(a["embedding"], b["embedding"], strict=True))
                assert worst <= LORA_TOLERANCE, worst
            for a, b in zip(ours64.json()["data"], theirs64.json()["data"], strict=True):
                x, y = (unpack(base64.b64decode(d["embedding"])) for d in (a, b))
                assert len(x) == 16 and max(abs(p - q) for p, q in zip(x, y, strict=True)) <= 1e-4

            wrong = await http.post("/v1/embeddings", json={"model": SERVED, "input": "Hi"})
            assert wrong.status_code == 400
            assert "is a generate model, not a embed model" in wrong.json()["error"]["message"]
            unknown = await http.post("/v1/completions", json={**prompt, "model": "nope"})
            assert unknown.status_code == 404
            assert unknown.json()["error"]["message"] == "The model `nope` does not exist."

            after = await served_counts(client, {instance for instance, _ in before})
            generated = sum(after[key] - before.get(key, 0) for key in after if key[0] == "cli1")
            assert generated == 2, (before, after)
            assert (
                after[("emb1", embed_subjects.generate)]
                - before.get(("emb1", embed_subjects.generate), 0)
                == 2
            )
            # Every other worker that answered both reads served none of them.
            others = {
                key: after[key] - before[key]
                for key in after
                if key[0] not in ("cli1", "emb1") and key in before
            }
            assert not any(others.values()), others

            await embedder.stop()
            await asyncio.sleep(1.5)  # the catalog's next rounds find it gone
            gone = await http.post("/v1/embeddings", json=body)
            assert gone.status_code == 404
            assert gone.json()["error"]["message"] == f"The model `{embed_name}` does not exist."
            listed = {c["id"] for c in (await http.get("/v1/models")).json()["data"]}
            assert embed_name not in listed and SERVED in listed
    finally:
        await embedder.stop()
        await nc.close()


async def test_health_and_the_stats_line_while_it_serves(cli_worker: CliWorker, client) -> None:
    code, body = await asyncio.to_thread(get_health, cli_worker.metrics_port)
    assert code == 200, body
    assert body["status"] == "ok"
    assert body["engine_alive"] is True
    assert body["nats_connected"] is True
    assert body["draining"] is False
    assert body["expected_processes"] == 1 and len(body["processes"]) == 1

    # A stats line comes within the interval (1 s here) while the engine works.
    served = await complete(
        client, make_request("obs-1", PROMPT, max_tokens=64), subject=SUBJECTS.generate
    )
    assert served.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 15
    while not re.search(STATS_LINE, cli_worker.output):
        assert time.monotonic() < deadline, "no stats line:\n" + "".join(cli_worker.lines[-40:])
        await asyncio.sleep(0.2)


async def test_stream_interval_coalesces_frames_and_keeps_logprobs_aligned(
    cli_worker: CliWorker, client, worker, engine
) -> None:
    """vLLM's own `--stream-interval N` (an engine argument the CLI passes through) makes the
    worker send a request's tokens N at a time, first token at once, with every frame's logprobs
    still aligned and the same tokens and values as one frame per step (the session's worker)."""
    tokens = 25
    request = make_request("interval-1", [1, 40, 41, 42, 43, 44], max_tokens=tokens, logprobs=5)
    coalesced = [
        MSGPACK.decode_frame(data)
        for data in await exchange(client, SUBJECTS.generate, MSGPACK.encode(request))
    ]
    stepwise = [
        MSGPACK.decode_frame(data)
        for data in await exchange(client, TEST_SUBJECTS.generate, MSGPACK.encode(request))
    ]
    sizes = [len(f.token_ids) for f in coalesced]
    # First token at once (TTFT unchanged), then INTERVAL per frame: 25 = 1 + 6 x 4. A worker
    # that lags merges a request's pending outputs (both workers do, by design), so under load a
    # frame may carry more than one interval (the first token too: [5, 4, 16] on CI), never a
    # part of one.
    assert sizes[0] % INTERVAL == 1 and sum(sizes) == tokens, sizes
    assert all(size % INTERVAL == 0 for size in sizes[1:]), sizes
    assert len(stepwise) > len(coalesced)
    assert [f.seq for f in coalesced] == list(range(len(coalesced)))
    assert [f.finish_reason for f in coalesced] == [None] * (len(coalesced) - 1) + ["length"]
    for frame in coalesced:
        assert len(frame.log_probs) == len(frame.top_logprobs) == len(frame.token_ids)
        for token_id, logprob, row in zip(
            frame.token_ids, frame.log_probs, frame.top_logprobs, strict=True
        ):
            check_row(row, token_id, logprob, 5, engine.table)

    def flat(frames: list[ResponseFrame], field: str) -> list[Any]:
        return [v for f in frames for v in getattr(f, field)]

    assert flat(coalesced, "token_ids") == flat(stepwise, "token_ids")
    for a, b in zip(flat(coalesced, "log_probs"), flat(stepwise, "log_probs"), strict=True):
        assert abs(a - b) < 1e-4
    ids = [[e.token_id for e in row] for row in flat(coalesced, "top_logprobs")]
    assert ids == [[e.token_id for e in row] for row in flat(stepwise, "top_logprobs")]
    assert coalesced[-1].completion_usage == stepwise[-1].completion_usage


async def test_engine_death_answers_in_flight_and_exits_non_zero(
    cli_worker: CliWorker, client, tiny_model: Path
) -> None:
    """The module's last test: it kills the worker's engine. The request in flight gets a
    retryable `engine_error` (migration off, so the test sees the worker's own frame) and the
    worker exits 1 with its last line."""
    proc = cli_worker.proc
    frames: list[ResponseFrame] = []
    request = make_request("crash-1", PROMPT, max_tokens=250)

    async def in_flight() -> None:
        async for frame in generate(client, request, subject=SUBJECTS.generate, migration_limit=0):
            frames.append(frame)

    # The engine is stopped before the request comes, so the request is in flight, admitted by
    # the worker, when the engine dies, however fast the tiny model and however slow the host
    # (running the worker in slices until a first frame, a starved test overran a slice and
    # the request ended first). The engine dies whole (an OOM kill of its processes): its core
    # and whatever the core started (with V1 multiprocessing on, the CPU executor's worker, which
    # would otherwise report its parent's death after the worker's last line).
    engine = engine_processes(proc.pid)
    assert engine, [process_text(p) for p in psutil.Process(proc.pid).children()]
    signal_each(engine, signal.SIGSTOP)
    reading = asyncio.create_task(in_flight())
    await until_in_flight(cli_worker.metrics_port, SERVED, 1)
    signal_each(engine, signal.SIGKILL)
    await asyncio.wait_for(reading, 60)
    final = frames[-1]
    assert final.finish_reason == "error" and final.error is not None
    assert final.error.code == "engine_error"
    assert sum(len(f.token_ids) for f in frames) < 250
    assert await asyncio.wait_for(proc.wait(), 60) == 1
    await asyncio.wait_for(cli_worker.reader, 30)  # every line, up to the last
    lines, output = cli_worker.lines, cli_worker.output
    assert "engine is dead: answering in-flight requests and exiting" in output
    assert last_worker_line(lines) == "vllm-nats-worker stopped (exit 1)"
    assert "request cli-1 length tokens=5" in output  # --enable-log-requests: one line each
    assert "request cli-2 invalid_request" in output
    assert "Passing raw prompts" not in output
    assert "--worker-processes auto: 1" in output  # no GPU: one process, as before "auto"
    # The worker's own log lines have vLLM's format, as vLLM's stats line has.
    worker_line = next(line for line in lines if "request obs-1 length tokens=64" in line)
    stats_line = next(line for line in lines if re.search(STATS_LINE, line))
    assert re.match(LOG_PREFIX + "request obs-1 length", worker_line), worker_line
    assert re.match(LOG_PREFIX, stats_line), stats_line
