"""Migration on the real engine: one of two workers, a CLI worker process group, is SIGKILLed
while 64 streams from 4 clients (300 greedy tokens, logprobs 5) are mid-flight on it; every
stream ends with `length` and is token for token, and logprob for logprob, an undisturbed run's.
The survivor is an in-process worker on the session's engine, started just before the kill.
The library's defaults are used (heartbeats every 1 s, a 5 s silence timeout, 3 migrations).
The same in JetStream mode, where the publisher owns the continuation; there the worker's main
process alone is killed, and its reaper takes vLLM's engine processes with it.

The transport-level variants (drain handover, slow prefill, no worker left, JetStream mode on the
fake engine): tests/integration/test_migration.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import statistics
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import nats
import psutil
import pytest

from messages.frames import ResponseFrame
from messages.request import GenerateRequest
from messages.subjects import Subjects
from tests.e2e.conftest import MIGRATED_STREAMS, MIGRATED_TOKENS, migrated_request
from tests.helpers import (
    DOOMED_CORE,
    DOOMED_JETSTREAM,
    EARLY_WORKERS,
    REAPER,
    Started,
    Streams,
    check_continued,
    engine_processes,
    process_text,
    processes_of,
    run_in_slices,
    serving,
    signal_each,
    stream_state,
    until_in_flight,
    wait_gone,
    worker_processes,
)
from worker.client import generate, jetstream_stream
from worker.config import JetStreamSettings, NatsConfig, WorkerConfig
from worker.nats.runtime import WorkerRuntime, open_worker

STREAMS, TOKENS, CLIENTS = MIGRATED_STREAMS, MIGRATED_TOKENS, 4


def _report_stalls(streams: Streams, killed_at: float, mode: str) -> None:
    """Every stream's worker was the one killed: each waited out the silence timeout, then the
    survivor's next step. Prints the stall at the seam."""
    stalls = [stall for stall in streams.stalls(killed_at) if stall > 2.0]
    assert len(stalls) == STREAMS
    p50, p99 = statistics.median(stalls), statistics.quantiles(stalls, n=100)[98]
    print(f"\n{mode}migrated {len(stalls)}/{STREAMS} streams; stall at the seam p50 {p50:.2f} s, "
          f"p99 {p99:.2f} s")  # fmt: skip
    assert p99 < 5.0 + 10.0


@dataclasses.dataclass
class _Doomed:
    """A CLI worker (its own process group, a metrics port) that dies with the 64 streams
    mid-flight on it, and the test's side: its 4 clients, the streams and the survivor."""

    proc: asyncio.subprocess.Process
    port: int
    model: Path
    clients: list[nats.NATS]
    lines: list[str]
    output: asyncio.Task[None]  # reads the worker's stdout into `lines` until every holder exits
    streams: Streams = dataclasses.field(default_factory=lambda: Streams(STREAMS, at_least=4))
    tasks: list[asyncio.Task[list[ResponseFrame]]] = dataclasses.field(default_factory=list)
    survivor: WorkerRuntime | None = None
    engine_pids: list[int] = dataclasses.field(default_factory=list)

    async def every_stream_mid_flight(self, open_stream: OpenStream) -> None:
        """Starts the 64 streams (`migrated_request(i)` from client i % 4) and returns with every
        one mid-flight and the worker's engine stopped. The engine is stopped while the worker,
        running on, takes every stream (on a busy host its intake takes them in pieces, and
        with the whole worker running in slices the first streams had ended before the last
        began); then the engine runs in slices, every stream in its batch, until each has
        tokens."""
        self.engine_pids = engine_pids = engine_processes(self.proc.pid)
        signal_each(engine_pids, signal.SIGSTOP)
        self.tasks += [
            asyncio.create_task(
                self.streams.read(i, open_stream(self.clients[i % CLIENTS], migrated_request(i)))
            )
            for i in range(STREAMS)
        ]
        await until_in_flight(self.port, self.model, STREAMS)
        streams = self.streams
        await run_in_slices(engine_pids, streams.started.is_set, lambda: sum(streams.received))
        assert max(streams.received) < TOKENS, "a stream ended before the kill"

    async def kill_the_main_process(self) -> None:
        """The worker's main process alone, as an OOM killer or a careless operator does. Its
        process group is stopped first, so that nothing of it runs on; the reaper (a session of
        its own, not stopped) then kills vLLM's engine processes, which have no parent-death
        handling, and names them in its one line."""
        family = psutil.Process(self.proc.pid).children(recursive=True)
        cores = [p for p in family if "EngineCore" in process_text(p)]
        reapers = [p for p in family if "worker.engine.reaper" in process_text(p)]
        assert len(reapers) == 1 and cores, [process_text(p) for p in family]
        os.killpg(self.proc.pid, signal.SIGSTOP)
        os.kill(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        left = await asyncio.to_thread(wait_gone, family, 15)
        assert left == [], [process_text(p) for p in left]
        await asyncio.wait_for(self.output, 15)  # every holder of the worker's stdout is gone
        reaped = [line for line in self.lines if line.startswith(REAPER)]
        assert len(reaped) == 1 and all(f"{p.pid} (" in reaped[0] for p in cores), reaped

    def kill_the_worker_processes(self) -> list[psutil.Process]:
        """Both processes of `--worker-processes 2` (SIGKILL), the engine core let run on: the
        parent sees them die and ends the whole worker. Returns every process the worker had,
        for `ended_as_one`."""
        family = psutil.Process(self.proc.pid).children(recursive=True)
        processes = worker_processes(self.proc.pid)
        assert len(processes) == 2, [process_text(p) for p in family]
        signal_each((p.pid for p in processes), signal.SIGKILL)
        signal_each(self.engine_pids, signal.SIGCONT)
        return family

    async def ended_as_one(self, family: list[psutil.Process]) -> None:
        """A worker process that dies ends the whole worker non-zero, never half alive, and
        leaves no process behind."""
        assert await asyncio.wait_for(self.proc.wait(), 60) != 0
        left = await asyncio.to_thread(wait_gone, family, 20)
        assert left == [], [process_text(p) for p in left]
        await asyncio.wait_for(self.output, 15)
        assert "died with exit code" in "".join(self.lines)


OpenStream = Callable[[nats.NATS, GenerateRequest], AsyncIterator[ResponseFrame]]


@contextlib.asynccontextmanager
async def _doomed_worker(
    nats_url: str, model: Path, flags: tuple[str, ...]
) -> AsyncIterator[_Doomed]:
    """The CLI worker of `flags` (tests.helpers.DOOMED_*): the one started early for this test
    (tests/conftest.py), else one started now."""
    started = await EARLY_WORKERS.take(flags) or await Started.start(nats_url, model, *flags)
    processes = processes_of(flags)
    doomed = None
    try:
        clients = [await nats.connect(nats_url) for _ in range(CLIENTS)]
        port = await started.metrics_port(processes)
        doomed = _Doomed(started.proc, port, model, clients, started.lines, started.output)
        yield doomed
    finally:
        await started.kill()
        if doomed is not None:
            for task in doomed.tasks:
                task.cancel()
            if doomed.survivor is not None:
                await doomed.survivor.stop()
            for nc in doomed.clients:
                await nc.close()


@pytest.mark.second_session  # CI: beside the integration layer, to even the jobs out
async def test_a_sigkilled_worker_loses_no_stream_and_changes_no_token(
    engine, nats_server, tiny_model, undisturbed
) -> None:
    subjects = Subjects("e2emigrate", "vllm", "generate")
    async with _doomed_worker(nats_server.url, tiny_model, DOOMED_CORE) as doomed:
        await doomed.every_stream_mid_flight(
            lambda client, request: generate(client, request, subject=subjects.generate)
        )
        killed_at = time.monotonic()
        # The second worker joins: the first holds every stream when it dies.
        config = WorkerConfig(nats=NatsConfig(servers=[nats_server.url]), subjects=subjects)
        doomed.survivor = await open_worker(engine, config)
        await doomed.kill_the_main_process()
        results = await asyncio.wait_for(asyncio.gather(*doomed.tasks), 240)

        for i, frames in enumerate(results):
            check_continued(undisturbed[i], len(migrated_request(i).token_ids), frames)
        _report_stalls(doomed.streams, killed_at, "")


@pytest.mark.second_session  # CI: beside the integration layer, to even the jobs out
async def test_jetstream_a_sigkilled_worker_loses_no_user_stream_and_restarts_none(
    engine, nats_server, tiny_model, undisturbed
) -> None:
    """JetStream mode: the same 64 streams, as `jetstream_stream` publishers (the publisher owns
    the continuation), queued for a CLI worker whose main process is SIGKILLed with every stream
    mid-flight (its reaper kills the engine's processes). Each continues on the survivor as a
    new queue message after the tokens it had, attempt 1 throughout (no stream restarts from
    token 0); the killed worker's messages, redelivered at `ack_wait`, find nobody listening and
    are terminated, so the queue ends empty."""
    subjects = Subjects("e2ejsmigrate", "vllm", "generate")
    settings = JetStreamSettings(ack_wait_s=8.0)  # DOOMED_JETSTREAM's --js-ack-wait
    async with _doomed_worker(nats_server.url, tiny_model, DOOMED_JETSTREAM) as doomed:
        await doomed.every_stream_mid_flight(
            lambda client, request: jetstream_stream(client, request, subjects=subjects)
        )
        killed_at = time.monotonic()
        _, consumer = await stream_state(doomed.clients[0], subjects, settings)
        assert consumer.num_ack_pending == STREAMS
        family = doomed.kill_the_worker_processes()
        config = WorkerConfig(
            nats=NatsConfig(servers=[nats_server.url]),
            subjects=subjects,
            max_concurrency=STREAMS,
            jetstream=dataclasses.replace(settings, capacity=STREAMS),
        )
        doomed.survivor = await open_worker(engine, config)
        results = await asyncio.wait_for(asyncio.gather(*doomed.tasks), 240)

        for i, frames in enumerate(results):
            assert {f.attempt for f in frames} == {1}, f"stream {i} restarted"
            check_continued(undisturbed[i], len(migrated_request(i).token_ids), frames)
        _report_stalls(doomed.streams, killed_at, "JetStream: ")
        # The killed worker's 64 messages come back at ack_wait and are terminated.
        deadline = time.monotonic() + settings.ack_wait_s + 30
        while True:
            state, consumer = await stream_state(doomed.clients[0], subjects, settings)
            if state.messages == 0 and consumer.num_ack_pending == 0:
                break
            assert time.monotonic() < deadline, (state, consumer)
            await asyncio.sleep(0.2)
        await doomed.ended_as_one(family)


async def test_a_rolling_restart_under_load_ends_no_request_in_error(
    engine, nats_server, tiny_model
) -> None:
    """Two workers on the session's engine, each stopped in turn as SIGTERM stops one
    (`WorkerRuntime.run` until its stop event: a drain of `drain_timeout_s`, then the rest ended
    with `worker_shutdown`) and started again, under the load of the SIGKILL test: 64
    streams of 300 tokens with logprobs 5, 48 from library callers on 4 connections and 16
    OpenAI streaming chats through the frontend, each sending its next request as soon as one
    ends. Every request ends with `length`."""
    import openai
    from prometheus_client import CollectorRegistry

    from worker.frontend.app import FrontendSettings, create_app
    from worker.frontend.tokenizer import ModelTokenizer
    from worker.metrics import WorkerMetrics

    subjects = Subjects("rolling", "vllm", "generate")
    config = WorkerConfig(
        nats=NatsConfig(servers=[nats_server.url]), subjects=subjects, drain_timeout_s=1.0
    )
    nc = await nats.connect(nats_server.url)
    clients = [await nats.connect(nats_server.url) for _ in range(4)]
    settings = FrontendSettings(model_names=("tiny",), subject=subjects.generate)
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    # The workers' own count of what they ended: a drain's `worker_shutdown` frames.
    metrics = WorkerMetrics(engine.limits.model, CollectorRegistry())
    workers = [await open_worker(engine, config, metrics) for _ in range(2)]
    stops = [asyncio.Event() for _ in workers]
    runs = [asyncio.create_task(w.run(s)) for w, s in zip(workers, stops, strict=True)]
    restarting = True
    in_flight: list[int] = []  # each stopped worker's streams at its SIGTERM
    library_ends: list[str | None] = []
    frontend_ends: list[str | None] = []

    progress = [0] * 48  # each library caller: tokens of its current request so far
    chats: dict[int, list[str]] = {}  # each chat caller: its current stream's id and chunks

    async def library_caller(i: int) -> None:
        n = 0
        while restarting:
            request = migrated_request(i + n, f"roll-{i}-{n}")
            request.stop_conditions.max_tokens = 300
            progress[i] = 0
            frames = []
            async for frame in generate(clients[i % 4], request, subject=subjects.generate):
                frames.append(frame)
                progress[i] += len(frame.token_ids)
            library_ends.append(frames[-1].finish_reason)
            assert sum(len(f.token_ids) for f in frames) == 300
            n += 1

    async def chat_caller(base: str, i: int) -> None:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        while restarting:
            stream = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"Tell me {i}"}],
                max_tokens=300,
                logprobs=True,
                top_logprobs=5,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finish = None
            chats[i] = []
            async for chunk in stream:
                chats[i].append(chunk.id)
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
            frontend_ends.append(finish)

    async with serving(app) as base:
        callers = [asyncio.create_task(library_caller(i)) for i in range(48)]
        callers += [asyncio.create_task(chat_caller(base, i)) for i in range(16)]
        try:
            await asyncio.sleep(3)
            for k in range(2):
                # Each stop lands while the worker serves a share of the streams, and while
                # half the library's streams have 250 tokens or more to go, more than a 1 s
                # drain lets them make: the drain's timeout ends streams. (The callers' requests
                # start and end nearly together; stops that landed near their end saw every
                # stream finish within the drain.)
                while workers[k].service.in_flight < 8 or sum(p < 50 for p in progress) < 24:
                    await asyncio.sleep(0.01)
                in_flight.append(workers[k].service.in_flight)
                stops[k].set()  # SIGTERM
                assert await asyncio.wait_for(runs[k], 30) == 0
                workers[k] = await open_worker(engine, config, metrics)  # restarted
                stops[k] = asyncio.Event()
                runs[k] = asyncio.create_task(workers[k].run(stops[k]))
                await asyncio.sleep(3)
            restarting = False
            _, open_callers = await asyncio.wait(callers, timeout=120)
            # A caller still open names its stream: the library's request id and tokens so far,
            # or the chat's completion id and chunks so far.
            assert not open_callers, sorted(
                f"library roll-{i}: {progress[i]} tokens"
                if i < 48
                else f"chat {i - 48}: {len(chats.get(i - 48, []))} chunks of "
                f"{(chats.get(i - 48) or ['no stream'])[-1]}"
                for i, task in enumerate(callers)
                if task in open_callers
            )
            for task in callers:
                task.result()
        finally:
            restarting = False
            for task in callers:
                task.cancel()
            for stop in stops:
                stop.set()
            await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 60)
    for each in (nc, *clients):
        await each.close()
    assert library_ends and set(library_ends) == {"length"}, library_ends
    assert frontend_ends and set(frontend_ends) == {"length"}, frontend_ends
    # Streams a drain's timeout ended went on elsewhere (the workers' own count of the
    # `worker_shutdown` frames they sent; the frontend's and the library's ends are all `length`).
    handed_over = (
        metrics.registry.get_sample_value(
            "nats_worker_requests_total",
            {"model_name": engine.limits.model, "outcome": "worker_shutdown"},
        )
        or 0
    )
    print(f"\nrolling restart: {len(library_ends)} library requests, {len(frontend_ends)} chats, "
          f"{in_flight} streams on the workers at their SIGTERMs, {handed_over:g} ended by the "
          "drain's timeout and continued")  # fmt: skip
    assert min(in_flight) >= 8
    assert handed_over >= 2, "each drain's timeout ended streams that went on elsewhere"
