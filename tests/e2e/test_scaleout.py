"""--worker-processes N: N worker processes over one vLLM engine core (the real CPU engine),
started by the CLI as a production worker is. In JetStream mode, with both processes pulling one
durable consumer and a worker process's death ending the whole worker:
tests/e2e/test_migration.py (its JetStream test)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time

import psutil
import pytest

from messages.frames import ResponseFrame
from messages.subjects import SERVICE_NAME, Subjects
from tests.helpers import (
    STATS_LINE,
    collect,
    complete_all,
    get_health,
    last_worker_line,
    process_text,
    read_until,
    run_in_slices,
    scrape,
    sigterm_mid_stream,
    start_cli_worker,
    stats_env,
    until,
    worker_processes,
)
from worker.client import KvRouter, complete, discover_workers, generate
from worker.client.library import discovery_answers
from worker.client.prefix_index import prefix_keys
from worker.client.requests import make_request
from worker.engine import placement

pytestmark = pytest.mark.own_engine  # CI runs these beside the session-engine tests

PROMPT = [1, 300, 301, 302]
# The engine core on the first CPU of this host's, the worker's processes on the others (a host
# of one CPU has no others: no placement there).
CPUS = sorted(os.sched_getaffinity(0))
ENGINE_CORE_CPUS = ("--engine-core-cpus", str(CPUS[0])) if len(CPUS) > 1 else ()


async def _start(nats_server, tiny_model, namespace: str, lines: list[str]):
    proc = await start_cli_worker(
        nats_server.url,
        tiny_model,
        "--worker-processes",
        "2",
        "--namespace",
        namespace,
        "--max-concurrency",
        "64",
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
        "--disable-log-stats",  # vLLM's engine argument, honoured as `vllm serve` does
        *ENGINE_CORE_CPUS,
        env=stats_env("1"),  # a stats line a second, were it not disabled
        own_session=True,
    )
    ready = 0
    deadline = time.monotonic() + 600  # an engine core and two clients starting on 2 cores
    while ready < 2:
        await read_until(
            proc.stdout, r"vllm-nats-worker ready:", lines, deadline - time.monotonic()
        )
        ready += 1
    return proc


async def _engine_requests(client, engine_subject: str) -> dict[str, int]:
    """Per process (instance id): the requests its endpoint on `engine_subject` took (STATS)."""
    counts: dict[str, int] = {}
    async for data in discovery_answers(client, f"$SRV.STATS.{SERVICE_NAME}", 0.5):
        stats = json.loads(data)
        for endpoint in stats.get("endpoints") or []:
            if endpoint["subject"] == engine_subject:
                assert endpoint["name"] == "generate-engine"
                counts[stats["metadata"]["instance_id"]] = endpoint["num_requests"]
    return counts


def _kill_group(proc) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


async def test_two_processes_share_one_engine_core_and_the_queue_group(
    nats_server, tiny_model, client
) -> None:
    lines: list[str] = []
    proc = await _start(nats_server, tiny_model, "mp", lines)
    output = asyncio.create_task(collect(proc.stdout, lines))
    subjects = Subjects("mp", "vllm", "generate")
    try:
        workers = await discover_workers(client, subjects.generate, window=1.0)
        ids = sorted(w.instance_id for w in workers)
        assert len(ids) == 2 and ids[0].endswith("-0") and ids[1].endswith("-1"), ids
        assert ids[0][:-2] == ids[1][:-2]  # one worker: one instance id, a suffix per process
        assert {w.engine_id for w in workers} == {ids[0][:-2]}  # discovery names the one engine
        # ... and the one process that answers KV snapshots (metadata kv_events)
        assert {w.instance_id: w.kv_snapshots for w in workers} == {ids[0]: True, ids[1]: False}
        # --max-concurrency is the whole worker's: split evenly over the processes.
        assert [w.max_concurrency for w in workers] == [32, 32]
        assert len(psutil.Process(proc.pid).children()) >= 3  # engine core + 2 processes
        if ENGINE_CORE_CPUS:
            parent = psutil.Process(proc.pid)
            (core,) = [p for p in parent.children() if p.name().startswith("VLLM::EngineCor")]
            assert core.cpu_affinity() == CPUS[:1]  # its executor's process inherits them
            assert {tuple(p.cpu_affinity()) for p in core.children()} <= {tuple(CPUS[:1])}
            # The worker's processes and multiprocessing's resource tracker on the rest (the
            # reaper's watchdog, started before the launch, keeps every CPU).
            others = [
                p
                for p in parent.children()
                if p.pid != core.pid and "worker.engine.reaper" not in p.cmdline()
            ]
            assert len(others) == 3, [p.cmdline() for p in others]
            assert parent.cpu_affinity() == CPUS[1:]
            assert all(p.cpu_affinity() == CPUS[1:] for p in others)
            rest = placement.text(frozenset(CPUS[1:]))
            said = f"engine core on CPUs {CPUS[0]}, this worker's processes on {rest}"
            assert any(said in line for line in lines), lines

        results = await complete_all(
            client,
            subjects.generate,
            [make_request(f"mp-{i}", PROMPT, max_tokens=8, logprobs=3) for i in range(16)],
        )
        assert [r.choices[0].finish_reason for r in results] == ["length"] * 16
        assert all(len(r.choices[0].top_logprobs) == 8 for r in results)

        # KV-aware routing: process 0 alone republishes the one engine core's cache events
        # (the others would send the same again), so the router holds one index of the engine,
        # with what either process served.
        router = KvRouter(client, subjects)
        await router.start()
        try:
            assert sorted(router.workers) == ids
            # `start` returns with process 0's index: it asks for its snapshot even where a
            # report of it came during discovery (the prompts above fill no block, so it names
            # no batch, kv_seq -1, and no later report or batch would ask before mp-kv's).
            index = router.workers[ids[0]].index
            assert index is not None
            size = index.block_size
            prompt = [3 + (i * 7) % 900 for i in range(2 * size)]
            served = await complete(
                client,
                make_request("mp-kv", prompt, max_tokens=2),
                subject=subjects.instance(ids[1]),
            )
            assert served.choices[0].finish_reason == "length"
            keys = prefix_keys(prompt, size)
            await until(lambda: router.workers[ids[0]].index.overlap(keys) == 2)  # type: ignore[union-attr]
            assert router.workers[ids[1]].index is None
            assert router.workers[ids[1]].load.kv_seq == -1  # type: ignore[union-attr]
            # Their load reports name the one engine core, so the router routes to the engine
            # (no process can hold more of the one cache): the subject both processes serve in
            # a queue group of their own.
            engine_id = ids[0][:-2]
            engines = {router.workers[i].load.engine_id for i in ids}  # type: ignore[union-attr]
            assert engines == {engine_id}  # from discovery at the router's start
            route = router.route(prompt)
            assert (route.subject, route.instance_id) == (subjects.instance(engine_id), engine_id)
            assert route.overlap_blocks == 2
            before = await _engine_requests(client, route.subject)
            engine_served = await complete_all(
                client,
                route.subject,
                [make_request(f"mp-e{i}", prompt, max_tokens=2) for i in range(12)],
            )
            router.release(route)
            assert [r.choices[0].finish_reason for r in engine_served] == ["length"] * 12
            after = await _engine_requests(client, route.subject)
            assert sum(after.values()) - sum(before.values()) == 12
            # NATS picks a queue member at random: both take some (all 12 on one: p = 2 / 4096).
            assert sorted(after) == ids and all(after[i] > before.get(i, 0) for i in ids)
        finally:
            await router.stop()

        # The parent's metrics port: the processes' counters summed, /health for both.
        port = next(
            int(m.group(1))
            for line in lines
            if (m := re.search(r"^metrics http://127\.0\.0\.1:(\d+)/metrics", line))
        )
        code, body = await asyncio.to_thread(get_health, port)
        assert code == 200 and body["status"] == "ok", body
        assert body["expected_processes"] == 2
        assert sorted(p["pid"] for p in body["processes"]) == sorted(
            c.pid for c in worker_processes(proc.pid)
        )
        samples = await asyncio.to_thread(scrape, port)
        outcome = f"model_name={tiny_model},outcome=length"
        # 16 to the queue group, mp-kv, 12 to the engine's subject
        assert samples[f"nats_worker_requests_total{{{outcome}}}"] == 29

        # A cancel (the client leaving early) reaches whichever process serves the request. The
        # worker runs in slices until this client has read a first token and sent its cancel,
        # so the request (8 x 500 tokens with logprobs) is still running when the cancel comes,
        # however late a loaded host lets this client read.
        os.killpg(proc.pid, signal.SIGSTOP)
        cancelled = generate(
            client,
            make_request("mp-cancel", PROMPT, max_tokens=500, n=8, temperature=1.0, logprobs=5),
            subject=subjects.generate,
        )

        async def first_token() -> list[ResponseFrame]:
            read = []
            async for frame in cancelled:
                read.append(frame)
                if frame.token_ids:
                    break
            return read

        first = asyncio.create_task(first_token())
        await run_in_slices(proc.pid, done=first.done, progress=lambda: 0)
        read = first.result()
        assert read and read[-1].token_ids and read[-1].finish_reason is None, read
        await cancelled.aclose()  # the cancel, published while the worker is stopped
        os.killpg(proc.pid, signal.SIGCONT)

        # SIGTERM to the parent alone: every process drains (a request in flight finishes),
        # then the worker exits 0. /health says draining (503) from the signal until the exit.
        seen_draining: list[dict] = []

        async def watch_health() -> None:
            while proc.returncode is None:
                try:
                    code, body = await asyncio.to_thread(get_health, port)
                except OSError:
                    return  # the port closed: the worker is gone
                if code == 503 and body["status"] == "draining":
                    seen_draining.append(body)
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch_health())
        long = make_request("mp-long", PROMPT, max_tokens=200)
        # Sent to a thread other than the main one, as the kernel may deliver it: the main thread
        # must still run the handler, not stay blocked waiting for a process to end.
        frames = await sigterm_mid_stream(
            proc, generate(client, long, subject=subjects.generate), to_another_thread=True
        )
        # The watcher ends when it sees draining or the port closes at the exit; on a loaded
        # host the exit (the engine core shut down after the processes) took over 30 s once,
        # and over 120 s in CI run 28 (the niced worker beside every job's engines).
        try:
            await asyncio.wait_for(watcher, 240)
        except asyncio.TimeoutError:
            tree = [
                f"{p.pid} {process_text(p)[:120]}"
                for p in psutil.Process(proc.pid).children(recursive=True)
            ]
            pytest.fail(
                "no draining /health and no exit in 240 s after SIGTERM; processes:\n"
                + "\n".join(tree)
                + "\nlast lines:\n"
                + "".join(lines[-60:])
            )
        assert frames[-1].finish_reason == "length"
        assert sum(len(f.token_ids) for f in frames) == 200
        assert seen_draining and seen_draining[0]["draining"] is True
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        await output
        text = "".join(lines)
        # The cancel, or (whichever the serving process handles first: nats-py runs each
        # subscription's callbacks in a task of its own) the probe that finds the client's inbox
        # gone right after it, ends the request early where it runs.
        ended = [line for line in lines if "request mp-cancel" in line]
        assert any("cancelled by its client" in line or "client gone" in line for line in ended), (
            ended
        )
        assert last_worker_line(lines) == "vllm-nats-worker stopped (exit 0)"
        assert text.count("stopping: draining") == 2
        assert not re.search(STATS_LINE, text), "a stats line despite --disable-log-stats"
    finally:
        _kill_group(proc)


def test_worker_processes_must_be_at_least_one(capsys) -> None:
    from worker.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["--model", "m", "--nats-url", "nats://x:1", "--worker-processes", "0"]
        )
    assert "--worker-processes: must be >= 1, got 0" in capsys.readouterr().err
