"""A 3-node nats-server cluster on loopback with JetStream on (the multi-GPU scale-out runs).

Node i (0, 1, 2) serves clients on 127.0.0.1:<base + i>, cluster routes on <base + 2000 + i>
and monitoring (`/routez`, `/jsz`) on <base + 4000 + i>; every node lists all three routes, so
the mesh forms whichever starts first. The servers run detached (their own session), their pids
in `<dir>/nK.pid`, so a later shell (or a later device call while the machine is warm) stops
them with `stop`.

    python -m bench.gpu.nats_cluster start [--dir /tmp/multi-gpu-nats] [--base-port 4222]
    python -m bench.gpu.nats_cluster check [--base-port 4222]   # routes + a JetStream stream
    python -m bench.gpu.nats_cluster stop [--dir /tmp/multi-gpu-nats]

`start` returns once every node has its two routes and a JetStream stream can be created
(a meta leader is elected), and prints the client URLs, one per line (`nats://127.0.0.1:4222`
…). `check` subscribes on node 0, publishes on node 2 and reads it back, then publishes to a
JetStream stream through node 1 and reads the stream's state through node 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from worker.dev.embedded import nats_server_binary

NODES = 3
CLUSTER_NAME = "bench"


def ports(base: int, i: int) -> tuple[int, int, int]:
    """(client, cluster route, monitoring) ports of node i."""
    return base + i, base + 2000 + i, base + 4000 + i


def urls(base: int) -> list[str]:
    return [f"nats://127.0.0.1:{ports(base, i)[0]}" for i in range(NODES)]


def config_text(work_dir: Path, base: int, i: int) -> str:
    client, route, monitor = ports(base, i)
    routes = ", ".join(f"nats-route://127.0.0.1:{ports(base, j)[1]}" for j in range(NODES))
    node = work_dir / f"n{i}"
    return (
        f"server_name: n{i}\n"
        f"listen: 127.0.0.1:{client}\n"
        f"http: 127.0.0.1:{monitor}\n"
        f'logfile: "{node / "nats-server.log"}"\n'
        f'jetstream {{ store_dir: "{node / "js"}" }}\n'
        f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: 127.0.0.1:{route}\n"
        f"  routes: [{routes}]\n}}\n"
    )


def _monitor(base: int, i: int, path: str) -> dict:
    url = f"http://127.0.0.1:{ports(base, i)[2]}{path}"
    with urllib.request.urlopen(url, timeout=2) as answer:
        return json.loads(answer.read())


def route_counts(base: int) -> list[int]:
    """Routes each node has to distinct other nodes (2 each when the mesh is formed; a node may
    keep several connections per peer, so remote names are counted, not connections)."""
    counts = []
    for i in range(NODES):
        routes = _monitor(base, i, "/routez").get("routes") or []
        counts.append(len({r.get("remote_name") or r.get("remote_id") for r in routes}))
    return counts


def start(work_dir: Path, base: int, timeout: float) -> list[str]:
    binary = nats_server_binary()
    work_dir.mkdir(parents=True, exist_ok=True)
    for i in range(NODES):
        node = work_dir / f"n{i}"
        node.mkdir(exist_ok=True)
        config = node / "nats.conf"
        config.write_text(config_text(work_dir, base, i))
        process = subprocess.Popen(
            [binary, "-c", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=open(node / "stderr.log", "wb"),  # noqa: SIM115 (the child keeps it)
            start_new_session=True,  # outlives this process; `stop` ends it by its pid
        )
        (work_dir / f"n{i}.pid").write_text(str(process.pid))
    deadline = time.monotonic() + timeout
    counts: list[int] = []
    while time.monotonic() < deadline:
        try:
            counts = route_counts(base)
            if all(c >= NODES - 1 for c in counts):
                break
        except OSError:
            pass  # a monitor port not up yet
        time.sleep(0.2)
    else:
        stop(work_dir)
        raise SystemExit(f"the cluster did not form in {timeout:.0f} s (routes {counts})")
    left = deadline - time.monotonic()
    asyncio.run(_jetstream_ready(urls(base)[0], max(left, 5.0)))
    return urls(base)


async def _jetstream_ready(url: str, timeout: float) -> None:
    """Waits until a stream can be created (the JetStream meta leader is elected)."""
    import nats
    from nats.js import api

    nc = await nats.connect(url)
    js = nc.jetstream(timeout=2.0)
    deadline = time.monotonic() + timeout
    error: Exception | None = None
    try:
        while time.monotonic() < deadline:
            try:
                await js.add_stream(
                    api.StreamConfig(name="CLUSTER_READY", subjects=["cluster.ready"])
                )
                await js.delete_stream("CLUSTER_READY")
                return
            except Exception as e:  # no meta leader yet: "JetStream system temporarily unavailable"
                error = e
                await asyncio.sleep(0.5)
        raise SystemExit(f"JetStream not ready in {timeout:.0f} s: {error!r}")
    finally:
        await nc.close()


def stop(work_dir: Path) -> None:
    for pid_file in sorted(work_dir.glob("n*.pid")):
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
        pid_file.unlink()


async def check(base: int) -> None:
    """A core message across nodes 2 → 0 and a JetStream publish through node 1 seen from
    node 2; prints one line per check, exits 1 on a failure."""
    import nats
    from nats.js import api

    node_urls = urls(base)
    print("routes per node:", route_counts(base))
    a, b, c = [await nats.connect(u) for u in node_urls]
    try:
        sub = await a.subscribe("cluster.check")
        await a.flush()
        # Interest propagates over the routes asynchronously: publish until it arrives.
        for _ in range(50):
            await c.publish("cluster.check", b"across")
            await c.flush()
            try:
                msg = await sub.next_msg(timeout=0.1)
                break
            except nats.errors.TimeoutError:
                continue
        else:
            raise SystemExit("FAIL: a message published on node 2 never reached node 0")
        print(f"ok core: node 2 → node 0 ({msg.data.decode()})")
        js_b, js_c = b.jetstream(timeout=5.0), c.jetstream(timeout=5.0)
        await js_b.add_stream(api.StreamConfig(name="CLUSTER_CHECK", subjects=["cluster.js"]))
        try:
            for i in range(10):
                await js_b.publish("cluster.js", str(i).encode())
            info = await js_c.stream_info("CLUSTER_CHECK")
            if info.state.messages != 10:
                raise SystemExit(f"FAIL: stream has {info.state.messages} messages, wanted 10")
            leader = info.cluster.leader if info.cluster else "?"
            print(f"ok jetstream: 10 messages via node 1, seen from node 2 (leader {leader})")
        finally:
            await js_b.delete_stream("CLUSTER_CHECK")
    finally:
        for nc in (a, b, c):
            await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu.nats_cluster", description=__doc__.splitlines()[0]
    )
    parser.add_argument("action", choices=("start", "stop", "check"))
    parser.add_argument("--dir", type=Path, default=Path("/tmp/multi-gpu-nats"))
    parser.add_argument("--base-port", type=int, default=4222)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    if args.action == "start":
        stop(args.dir)  # a cluster left by an earlier call
        for url in start(args.dir, args.base_port, args.timeout):
            print(url)
    elif args.action == "stop":
        stop(args.dir)
    else:
        asyncio.run(check(args.base_port))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
