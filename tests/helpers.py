"""Shared test helpers: the raw frame reader (one stop rule), request/response exchange, the
alignment checks, and running the worker as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerInfo, StreamState
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from messages.codec import MSGPACK
from messages.frames import ResponseFrame, TopLogprob
from messages.request import GenerateRequest
from messages.subjects import REPLY_HEADER, SERVICE_NAME, Subjects
from worker.client import Completion, RequestEnd, complete, frame_payloads, generate
from worker.client.library import discovery_answers
from worker.config import JetStreamSettings
from worker.engine.contract import Engine
from worker.nats.intake.jetstream import stream_name
from worker.shared.tokens import TokenTable

ROOT = Path(__file__).resolve().parent.parent
# Small on purpose: large prompt-logprob answers must be split to fit (the default is 1 MiB).
TEST_MAX_PAYLOAD = 32 * 1024
TEST_SUBJECTS = Subjects(namespace="test", component="vllm", endpoint="generate")


async def complete_all(nc: NATS, subject: str, requests: list[GenerateRequest]) -> list[Completion]:
    """Every request sent to `subject` at once, each read to its end, in the requests' order."""
    return await asyncio.gather(*(complete(nc, r, subject=subject) for r in requests))


async def raw_frames(
    subscription: Subscription, *, json: bool = False, choices: int = 1, timeout: float = 60.0
) -> AsyncIterator[bytes]:
    """The encoded frames of one request as they arrive, until it ends by the one stop rule
    (worker.client.reader.RequestEnd); probes skipped. No seq check: tests count gaps."""
    decode = msgspec.json.decode if json else msgspec.msgpack.decode
    end = RequestEnd(choices)
    async for data in frame_payloads(subscription, timeout):
        frame = decode(data)
        yield data
        if end.saw(frame["index"], frame["finish_reason"]):
            return


async def request_frames(
    nc: NATS,
    subject: str,
    payload: bytes,
    *,
    json: bool = False,
    choices: int = 1,
    timeout: float = 60.0,
    inbox: str | None = None,
    jetstream: bool = False,
) -> AsyncIterator[bytes]:
    """Publishes one request (core, or to a JetStream work queue with the Reply-To header) and
    yields its encoded frames until it ends (`raw_frames`); unsubscribes when done."""
    inbox = inbox or nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    headers = {"Content-Type": "application/json"} if json else {}
    try:
        if jetstream:
            headers[REPLY_HEADER] = inbox
            await nc.jetstream().publish(subject, payload, headers=headers)
        else:
            await nc.publish(subject, payload, reply=inbox, headers=headers or None)
        async for data in raw_frames(subscription, json=json, choices=choices, timeout=timeout):
            yield data
    finally:
        await subscription.unsubscribe()


async def frame_maps(
    nc: NATS, subject: str, payload: bytes, *, json: bool = False, **options: Any
) -> AsyncIterator[dict[str, Any]]:
    """`request_frames` decoded as maps, so tests can spell the wire's field names out."""
    decode = msgspec.json.decode if json else msgspec.msgpack.decode
    async for data in request_frames(nc, subject, payload, json=json, **options):
        yield decode(data)


async def exchange(
    nc: NATS,
    subject: str,
    payload: bytes,
    *,
    json: bool = False,
    choices: int = 1,
    timeout: float = 60.0,
) -> list[bytes]:
    """Raw frames of one request until every choice ended or an error frame came."""
    frames = request_frames(nc, subject, payload, json=json, choices=choices, timeout=timeout)
    return [data async for data in frames]


def check_row(
    row: list[TopLogprob], token_id: int, logprob: float, k: int, table: TokenTable
) -> None:
    """One top_logprobs row: top-k by rank, the chosen token present with the same logprob."""
    ranks = [entry.rank for entry in row]
    assert ranks[: min(k, len(ranks))] == list(range(1, min(k, len(ranks)) + 1)), ranks
    chosen = [entry for entry in row if entry.token_id == token_id]
    assert len(chosen) == 1, (token_id, row)
    assert chosen[0].logprob == logprob
    if chosen[0].rank > k:
        assert len(row) == k + 1 and row[-1] is chosen[0]
    else:
        assert len(row) == k
    for entry in row:
        assert entry.bytes == table.byte_values[entry.token_id]
        assert entry.token == table.texts[entry.token_id]
    assert all(a.logprob >= b.logprob for a, b in zip(row[:k], row[1:k], strict=False))


def subprocess_env() -> dict[str, str]:
    # No VLLM_CPU_KVCACHE_SPACE: vLLM's CPU engine lets it win over --kv-cache-memory-bytes
    # (TINY_MODEL_FLAGS), and the worker's CLI sizes the cache itself when neither is given.
    env = dict(os.environ)
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def read_until(stream, pattern: str, lines: list[str], timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = await asyncio.wait_for(stream.readline(), left)
        except asyncio.TimeoutError:
            break
        if not line:
            break
        lines.append(line.decode(errors="replace"))
        if match := re.search(pattern, lines[-1]):
            return match
    waited = timeout - max(0.0, deadline - time.monotonic())
    raise AssertionError(f"no {pattern!r} in output after {waited:.0f} s:\n{''.join(lines[-60:])}")


def signal_another_thread(pid: int, signum: int) -> int:
    """Sends `signum` to a thread of process `pid` other than its main thread (Linux tgkill), as
    the kernel may deliver a signal sent to the process; returns that thread's id."""
    import ctypes

    thread = next(t.id for t in psutil.Process(pid).threads() if t.id != pid)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, thread, signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill {pid} {thread}")
    return thread


async def sigterm_mid_stream(
    proc: asyncio.subprocess.Process,
    frames: AsyncIterator[ResponseFrame],
    timeout: float = 60.0,
    *,
    to_another_thread: bool = False,
) -> list[ResponseFrame]:
    """Every frame of one request, with SIGTERM sent to `proc` once its first frame arrived (a
    draining worker lets a request in flight finish); `to_another_thread`: to one of its threads
    other than the main one (signal_another_thread)."""
    seen: list[ResponseFrame] = []

    async def read() -> None:
        async for frame in frames:
            seen.append(frame)

    reading = asyncio.create_task(read())
    while not seen and not reading.done():
        await asyncio.sleep(0.01)
    if to_another_thread:
        signal_another_thread(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(reading, timeout)
    return seen


READY_LINE = "vllm-nats-worker ready:"


def ready_deadline(processes: int) -> float:
    """When a CLI worker of `processes` worker processes must have printed its ready lines (an
    engine core and its clients starting on a busy 2-core host)."""
    return time.monotonic() + 300 + 150 * (processes - 1)


def metrics_port_in(lines: list[str]) -> int:
    """The one metrics port a CLI worker's lines name (started with `--metrics-port 0
    --metrics-host 127.0.0.1`: in the ready line of one process, in the parent's own line of
    several)."""
    ports = re.findall(r"metrics http://127\.0\.0\.1:(\d+)/metrics", "".join(lines))
    assert len(set(ports)) == 1, ports
    return int(ports[0])


async def ready_metrics_port(proc, lines: list[str], processes: int = 1) -> int:
    """Reads a CLI worker's output up to the ready lines of its `processes` worker processes
    and returns the metrics port it names."""
    deadline = ready_deadline(processes)
    for _ in range(processes):
        await read_until(proc.stdout, READY_LINE, lines, deadline - time.monotonic())
    return metrics_port_in(lines)


async def collect(stream, lines: list[str]) -> None:
    while line := await stream.readline():
        lines.append(line.decode(errors="replace"))


@dataclass
class Started:
    """A CLI worker started with its own process group, its output read into `lines` by
    `output` from the start (an unread pipe would stall the worker once full)."""

    proc: asyncio.subprocess.Process
    lines: list[str]
    output: asyncio.Task[None]

    @classmethod
    async def start(cls, nats_url: str, model: Path, *flags: str) -> Started:
        proc = await start_cli_worker(nats_url, model, *flags, own_session=True)
        lines: list[str] = []
        return cls(proc, lines, asyncio.create_task(collect(proc.stdout, lines)))

    async def metrics_port(self, processes: int = 1) -> int:
        """`ready_metrics_port` for lines `output` reads: waits for them to hold the ready
        lines."""
        deadline = ready_deadline(processes)
        while sum(READY_LINE in line for line in self.lines) < processes:
            assert self.proc.returncode is None and time.monotonic() < deadline, "".join(
                self.lines[-60:]
            )
            await asyncio.sleep(0.2)
        return metrics_port_in(self.lines)

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        self.output.cancel()


def processes_of(flags: tuple[str, ...]) -> int:
    """The `--worker-processes` a CLI worker's flags give (1 without it)."""
    if "--worker-processes" not in flags:
        return 1
    return int(flags[flags.index("--worker-processes") + 1])


class EarlyWorkers:
    """CLI workers started at the session's first test for tests that come last (the core
    SIGKILL migration test, .ci/run's integration job): an engine's start (a minute or more on
    a busy CI host) overlaps the integration layer, which mostly waits, instead of adding to it.
    A test takes its worker by the exact flags it would start it with."""

    def __init__(self) -> None:
        self._started: dict[tuple[str, ...], asyncio.Task[Started]] = {}

    def start(self, nats_url: str, model: Path, flags: tuple[str, ...]) -> None:
        self._started[flags] = asyncio.create_task(Started.start(nats_url, model, *flags))

    async def take(self, flags: tuple[str, ...]) -> Started | None:
        task = self._started.pop(flags, None)
        return None if task is None else await task

    async def stop(self) -> None:
        """Kills what no test took (a run that failed or stopped early)."""
        for task in self._started.values():
            with contextlib.suppress(BaseException):
                await (await task).kill()
        self._started.clear()


EARLY_WORKERS = EarlyWorkers()

# The CLI workers the SIGKILL migration tests kill (tests/e2e/test_migration.py), by their whole
# flags (after the model's). DOOMED_CORE starts early when those tests are selected
# (tests/conftest.py); DOOMED_JETSTREAM does not: started early, idle for minutes and then given
# 64 requests at once, it had one of them delivered twice (attempt 2) in three runs of three
# (CI run 28 and two local runs), which the test takes for a restarted stream; started by its
# test it never did. The cause: a pull request that outlived its fetch (flushed late by a starved
# event loop) delivered a process more than it had room for; the extras waited in its buffer past
# ack_wait and were served twice. A worker now hands such extras back at once (tests/integration/
# test_jetstream_intake.py), so none is served twice, but each is still an attempt more.
_METRICS = ("--metrics-port", "0", "--metrics-host", "127.0.0.1")
DOOMED_CORE = ("--namespace", "e2emigrate", "--worker-processes", "1", *_METRICS)
DOOMED_JETSTREAM = (
    "--mode", "jetstream", "--namespace", "e2ejsmigrate", "--js-ack-wait", "8",
    # Two worker processes, each taking at most half of --max-concurrency: 64 in flight means
    # both pull the one durable consumer.
    "--max-concurrency", "64", "--worker-processes", "2", *_METRICS,
)  # fmt: skip


@dataclass
class Tally:
    """What a reader saw of one request's stream (see `tally`)."""

    request_id: str
    frames: int = 0
    tokens: int = 0
    gaps: int = 0
    """Frames missing by `seq` (frames in transit when the broker died; see README)."""
    holes: int = 0
    """Runs of missing frames: places in the stream where `seq` jumped."""
    final: dict | None = None
    first: asyncio.Event = field(default_factory=asyncio.Event)


async def tally(nc: NATS, subject: str, request: GenerateRequest, stream: Tally) -> None:
    """Publishes a core request and reads its frames to the end, counting frames, tokens and seq
    gaps and checking the per-position alignment of every frame."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, MSGPACK.encode(request), reply=inbox)
    expected = 0
    k = request.output_options.logprobs
    async for data in raw_frames(sub, timeout=60):
        frame = msgspec.msgpack.decode(data)
        if frame["seq"] != expected:
            stream.gaps += frame["seq"] - expected
            stream.holes += 1
        expected = frame["seq"] + 1
        stream.frames += 1
        stream.tokens += len(frame["token_ids"])
        if k is not None and frame["token_ids"]:
            assert len(frame["log_probs"]) == len(frame["top_logprobs"]) == len(frame["token_ids"])
            assert all(len(row) >= k for row in frame["top_logprobs"])
        stream.first.set()
        if frame["finish_reason"] is not None:
            stream.final = frame
    await sub.unsubscribe()


# The KV cache of every engine a test starts: the tiny model's KV is 1 KiB a token, so 64 MiB hold
# 65k tokens, 128 sequences of the 512-token max_model_len. The CPU default (1 GiB) is written
# through at start: ~4 s more CPU per engine start, measured here, a dozen starts per CI run.
TEST_KV_CACHE_BYTES = 64 << 20

# The tiny model's engine flags (fp32 for exact logprobs, eager for a fast start); flags given
# after them on the same command line win.
TINY_MODEL_FLAGS = (
    "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    "--kv-cache-memory-bytes", str(TEST_KV_CACHE_BYTES),
)  # fmt: skip


async def start_cli_worker(
    nats_url: str,
    model: Path,
    *flags: str,
    env: dict[str, str] | None = None,
    own_session: bool = False,
) -> asyncio.subprocess.Process:
    """`python -m worker` on the tiny model as a subprocess, stdout and stderr piped together;
    `own_session`: its own process group, so a test can end the worker and its engine at once.

    It runs niced, its engine processes too: on a host with fewer cores than busy processes
    (CI runs three pytest processes on two), the test that watches a worker must not be starved
    by it, or it sees what the worker did long after it was done (a stream it means to cancel or
    kill mid-flight has already ended)."""
    return await asyncio.create_subprocess_exec(
        "nice",
        "-n",
        "10",
        sys.executable,
        "-m",
        "worker",
        "--nats-url",
        nats_url,
        "--model",
        str(model),
        *TINY_MODEL_FLAGS,
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env or subprocess_env(),
        cwd=ROOT,
        start_new_session=own_session,
    )


# --- the metrics port and the CLI's console -------------------------------------------------


async def kill_if_running(proc: asyncio.subprocess.Process) -> None:
    """A test's `finally` for a CLI worker it started: gone, whatever happened."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


def run_client_cli(
    nats_url: str, *flags: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -m worker.client --nats-url URL FLAGS…` to its end, output captured as text
    (blocking: from a test, through asyncio.to_thread)."""
    return subprocess.run(
        [sys.executable, "-m", "worker.client", "--nats-url", nats_url, *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=timeout,
    )


@contextlib.contextmanager
def metrics_server(registry: CollectorRegistry) -> Iterator[int]:
    """A worker registry's Prometheus text on a free loopback port, for the `with` block."""
    server, _ = start_http_server(0, "127.0.0.1", registry=registry)
    try:
        yield server.server_port
    finally:
        server.shutdown()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:
                samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


REAPER = "vllm-nats-worker reaper:"
"""The watchdog's line (worker/engine/reaper.py): a process of its own, it may report after the
worker's last line."""


def last_worker_line(lines: list[str]) -> str:
    """The worker's own last line: not its reaper's, nor multiprocessing's resource tracker's
    (a separate process that reports, after the worker exited, shared memory a killed engine
    process leaked; a known issue of --worker-processes shutdown, see the closing note)."""
    tracker = ("resource_tracker", "warnings.warn(")
    own = [
        line
        for line in lines
        if not line.startswith(REAPER) and not any(mark in line for mark in tracker)
    ]
    return own[-1].strip()


# --- processes ------------------------------------------------------------------------------


def gone(process: psutil.Process) -> bool:
    """Exited (a zombie holds nothing but its PID table entry), or its PID is someone else's."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def wait_gone(processes: Iterable[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still alive after `timeout` s."""
    left = list(processes)
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if not gone(p)]
    return left


def kill_all(processes: Iterable[psutil.Process]) -> None:
    for process in processes:
        if not gone(process):  # is_running() compares creation times: never a reused PID
            with contextlib.suppress(psutil.Error):
                process.kill()


def process_text(process: psutil.Process) -> str:
    """Its name and command line, or "" once it is gone."""
    try:
        return " ".join([process.name(), *process.cmdline()])
    except psutil.Error:
        return ""


def engine_processes(parent: int) -> list[int]:
    """The pids of vLLM's engine core under `parent` and of the processes it started (its model
    executor's worker): what runs the model, apart from the worker that feeds it."""
    cores = [
        p
        for p in psutil.Process(parent).children(recursive=True)
        if "EngineCore" in process_text(p)
    ]
    return [p.pid for core in cores for p in (core, *core.children(recursive=True))]


def worker_processes(parent: int) -> list[psutil.Process]:
    """The worker processes of a CLI worker started with `--worker-processes`: its children
    other than vLLM's engine core, the reaper and multiprocessing's resource tracker."""
    found = []
    for child in psutil.Process(parent).children():
        command = " ".join(child.cmdline())
        if "spawn_main" in command and "resource_tracker" not in command:
            if not child.name().startswith("VLLM::"):
                found.append(child)
    return found


def signal_each(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


async def until_in_flight(port: int, model: str | Path, count: int) -> None:
    """Returns once a CLI worker's in-flight gauge (its `--metrics-port`) reads `count` or more:
    the worker has admitted that many requests, whatever its engine is doing."""
    gauge = f"nats_worker_in_flight_requests{{model_name={model}}}"
    while (await asyncio.to_thread(scrape, port)).get(gauge, 0) < count:
        await asyncio.sleep(0.05)


def get_health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """An ASGI app (the frontend) on uvicorn on a free loopback port, in this event loop; yields
    its base URL (`http://127.0.0.1:<port>`)."""
    import uvicorn

    port = free_port()
    # A stream the app never ends would hold uvicorn's shutdown forever; 5 s bounds it, so such
    # a test fails on its own assertion instead of hanging to the per-test timeout.
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Returns once `condition()` holds; fails the test after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def discover(
    nc: NATS, verb: str, wait: float = 0.5, *, instances: Collection[str] = ()
) -> list[dict[str, Any]]:
    """Every worker's answer to `$SRV.<verb>.vllm-nats-worker` within `wait` seconds; with
    `instances`, read until each of those instance ids answered (up to 15 s, failing the test
    past it): on CI's starved host an answer can come later than a short fixed window."""
    subject = f"$SRV.{verb}.{SERVICE_NAME}"
    expected = set(instances)
    answers: list[dict[str, Any]] = []
    answered: set[str] = set()
    window = 15.0 if expected else wait
    async with contextlib.aclosing(discovery_answers(nc, subject, window)) as arriving:
        async for data in arriving:
            answer = json.loads(data)
            answers.append(answer)
            answered.add(answer.get("metadata", {}).get("instance_id", ""))
            if expected and expected <= answered:
                break
    assert expected <= answered, (sorted(expected - answered), "did not answer", verb)
    return answers


STATS_LINE = r"Avg prompt throughput: .* Running: \d+ reqs, Waiting: \d+ reqs, .*KV cache usage"
"""vLLM's periodic stats line (`--disable-log-stats` turns it off)."""


def stats_env(interval_s: str) -> dict[str, str]:
    """A CLI worker's environment with vLLM's stats line every `interval_s` seconds."""
    env = subprocess_env()
    env["VLLM_LOG_STATS_INTERVAL"] = interval_s
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # vLLM logs its stats line at INFO
    return env


async def frame_list(
    nc: NATS, subject: str, payload: bytes, *, json: bool = False, **options: Any
) -> list[dict[str, Any]]:
    """Every frame of one request as a map (`frame_maps`, read to the end; 30 s a frame)."""
    options.setdefault("timeout", 30)
    return [frame async for frame in frame_maps(nc, subject, payload, json=json, **options)]


async def wait_engine_idle(engine: Engine, within: float) -> float:
    """Seconds until the engine holds no request (`num_unfinished_requests`), or fail."""
    started = time.monotonic()
    while engine.num_unfinished_requests() != 0:
        assert time.monotonic() - started < within, (
            f"engine still holds {engine.num_unfinished_requests()} requests after {within}s"
        )
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def stream_state(
    nc: NATS, subjects: Subjects, settings: JetStreamSettings
) -> tuple[StreamState, ConsumerInfo]:
    """A JetStream work queue's stream state and its durable consumer's info."""
    js = nc.jetstream()
    name = stream_name(subjects, settings)
    return (await js.stream_info(name)).state, await js.consumer_info(name, settings.durable)


async def settled_state(
    nc: NATS, subjects: Subjects, settings: JetStreamSettings
) -> tuple[StreamState, ConsumerInfo]:
    """`stream_state` once the last acks landed (or after 5 s): a worker acks just after the
    final frame, so the client may see its answer a moment before the stream does."""
    deadline = time.monotonic() + 5.0
    while True:
        state, consumer = await stream_state(nc, subjects, settings)
        if (state.messages == 0 and consumer.num_ack_pending == 0) or time.monotonic() > deadline:
            return state, consumer
        await asyncio.sleep(0.05)


async def final_reasons(
    nc: NATS, request: GenerateRequest, subject: str, first: asyncio.Event, timeout: float = 5.0
) -> str:
    """Reads one request through the client library (`timeout` seconds a frame), setting `first`
    at its first frame: its choices' finish reasons joined by commas, or the name of the error
    that ended it (frames lost in a broker outage: the client's deadline ends it)."""
    finals: list[str] = []
    try:
        async for frame in generate(nc, request, subject=subject, timeout=timeout):
            first.set()
            if frame.finish_reason is not None:
                finals.append(frame.finish_reason)
    except Exception as error:
        return type(error).__name__
    return ",".join(finals)


def check_continued(want: Completion, prompt_len: int, frames: list[ResponseFrame]) -> None:
    """A stream that went through migrations is one undisturbed greedy stream: seq 0…, no error,
    one `length` end with the original prompt's usage, and `want`'s tokens, logprobs (within
    1e-5) and top-logprob candidates, row for row."""
    expected = want.choices[0]
    assert [f.seq for f in frames] == list(range(len(frames)))
    assert not any(f.error for f in frames), [f.error for f in frames if f.error]
    assert [f.finish_reason for f in frames if f.finish_reason] == ["length"]
    assert sum((f.token_ids for f in frames), []) == expected.token_ids
    log_probs = sum((f.log_probs or [] for f in frames), [])
    rows = sum((f.top_logprobs or [] for f in frames), [])
    assert len(log_probs) == len(rows) == len(expected.token_ids)
    pairs = zip(log_probs, expected.log_probs, strict=True)
    assert max(abs(a - b) for a, b in pairs if a is not None and b is not None) < 1e-5
    for row, expected_row in zip(rows, expected.top_logprobs, strict=True):
        assert [r.token_id for r in row] == [r.token_id for r in expected_row]
    usage = frames[-1].completion_usage
    assert usage and (usage.prompt_tokens, usage.completion_tokens) == (
        prompt_len,
        len(expected.token_ids),
    )


async def run_in_slices(
    target: int | Sequence[int],
    done: Callable[[], bool],
    progress: Callable[[], int],
    *,
    slice_s: float = 0.2,
    quiet_s: float = 0.3,
    within: float = 120.0,
) -> None:
    """Lets stopped processes run in slices of `slice_s` (the tiny model makes about 20 tokens a
    stream in one) until `done()` holds; leaves them stopped. `target`: a process group (a
    worker started with `own_session`, SIGSTOPped), or the pids of some processes (its engine's,
    `engine_processes`: the worker itself runs on). `done()` is asked while they are stopped and
    once the test has read all they sent: `progress()` (e.g. tokens read so far) stayed the
    same for `quiet_s`. So a test can kill a worker in the middle of its streams however fast
    the worker and however slow the test's reading (on a busy host, a tiny model ended 64
    streams of 300 tokens before a starved reader had seen their first tokens)."""

    def send(sig: signal.Signals) -> None:
        if isinstance(target, int):
            os.killpg(target, sig)
        else:
            signal_each(target, sig)

    deadline = time.monotonic() + within
    while True:
        send(signal.SIGCONT)
        await asyncio.sleep(slice_s)
        send(signal.SIGSTOP)
        seen = progress()
        while True:
            await asyncio.sleep(quiet_s)
            if progress() == seen:
                break
            seen = progress()
        if done():
            return
        assert time.monotonic() < deadline, f"not done after {within} s of slices"


class Streams:
    """Many streams read at once, as a load test reads them: the tokens each received, when each
    frame came, and `started` once every stream has `at_least` tokens."""

    def __init__(self, count: int, at_least: int = 1) -> None:
        self.received = [0] * count
        self.arrivals: list[list[float]] = [[] for _ in range(count)]
        self.at_least = at_least
        self.started = asyncio.Event()

    async def read(self, i: int, frames: AsyncIterator[ResponseFrame]) -> list[ResponseFrame]:
        """Stream `i` to its end."""
        kept = []
        async for frame in frames:
            kept.append(frame)
            self.arrivals[i].append(time.monotonic())
            self.received[i] += len(frame.token_ids)
            if min(self.received) >= self.at_least:
                self.started.set()
        return kept

    def stalls(self, since: float) -> list[float]:
        """Each stream's longest wait between two frames after `since` (0 where none)."""
        return [
            max((b - a for a, b in zip(times, times[1:], strict=False) if b > since), default=0.0)
            for times in self.arrivals
        ]
