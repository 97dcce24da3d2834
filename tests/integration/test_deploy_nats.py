"""deploy/nats.conf (the compose file's nats-server authorization) on the real nats-server, with
the compose file's JetStream and monitoring flags, on loopback: the credentials of .env reach
the server through its environment and the frontend and worker log in with the same env
variables; a wrong password is refused, and nats-server will not start without them."""

from __future__ import annotations

import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT
from worker.dev.embedded import nats_server_binary
from worker.shared.nats_connection import ConnectFailed, connect
from worker.shared.nats_options import nats_config

CONF = ROOT / "deploy" / "nats.conf"
_CLIENTS = re.compile(r"Listening for client connections on 127\.0\.0\.1:(\d+)")
_MONITOR = re.compile(r"Starting http monitor on 127\.0\.0\.1:(\d+)")


def _start(store: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    # The compose file's flags (-js -sd, -m) with free loopback ports instead of 4222 / 8222.
    command = [nats_server_binary(), "--config", str(CONF), "-a", "127.0.0.1", "-p", "-1"]
    command += ["-js", "-sd", str(store), "-m", "-1"]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture
def deployed_nats(tmp_path: Path) -> Iterator[tuple[str, str]]:
    env = {**os.environ, "NATS_USER": "vllm", "NATS_PASSWORD": "0f3a9c"}
    server = _start(tmp_path, env)
    assert server.stdout is not None
    log = ""
    deadline = time.monotonic() + 10
    while not _CLIENTS.search(log) and time.monotonic() < deadline:
        line = server.stdout.readline()
        assert line, f"nats-server exited: {log}"
        log += line
    clients, monitor = _CLIENTS.search(log), _MONITOR.search(log)
    assert clients and monitor, log
    try:
        yield f"nats://127.0.0.1:{clients.group(1)}", f"http://127.0.0.1:{monitor.group(1)}"
    finally:
        server.terminate()
        server.wait(10)


async def test_the_frontend_logs_in_with_the_env_files_credentials(
    deployed_nats, monkeypatch
) -> None:
    from worker.frontend.cli import parse_args

    url, monitor = deployed_nats
    for name, value in {"NATS_URL": url, "NATS_USER": "vllm", "NATS_PASSWORD": "0f3a9c"}.items():
        monkeypatch.setenv(name, value)
    config = nats_config(parse_args(["--model", "/model"]))
    assert (config.user, config.password) == ("vllm", "0f3a9c")
    nc = await connect(config, attempts=1)
    try:
        account = await nc.jetstream().account_info()  # -js -sd: JetStream is on
        assert account.streams == 0
    finally:
        await nc.close()
    with urllib.request.urlopen(f"{monitor}/healthz", timeout=5) as answer:
        assert answer.status == 200


async def test_a_wrong_password_or_none_is_refused(deployed_nats, monkeypatch) -> None:
    from worker.frontend.cli import parse_args

    url, _ = deployed_nats
    for name, value in {"NATS_URL": url, "NATS_USER": "vllm", "NATS_PASSWORD": "wrong"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConnectFailed, match="[Aa]uthorization"):
        await connect(nats_config(parse_args(["--model", "/model"])), attempts=1)
    monkeypatch.delenv("NATS_USER")
    monkeypatch.delenv("NATS_PASSWORD")
    with pytest.raises(ConnectFailed, match="[Aa]uthorization"):
        await connect(nats_config(parse_args(["--model", "/model"])), attempts=1)


def test_nats_server_refuses_to_start_without_the_password(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_USER", "NATS_PASSWORD")}
    server = _start(tmp_path, {**env, "NATS_USER": "vllm"})
    output, _ = server.communicate(timeout=10)
    assert server.returncode != 0
    assert "variable reference for 'NATS_PASSWORD'" in output
