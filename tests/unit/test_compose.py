"""The docker compose deployment (docker-compose.yml, Dockerfile, .dockerignore, deploy/,
.env.example) and the README's commands for it, read as files; `docker compose config` runs
where the compose plugin is installed (skipped elsewhere: no docker here is needed for the rest).

The worker's vLLM flags need vllm's parser: tests/e2e/test_compose_args.py parses the whole
worker command with it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import ROOT
from worker.cli import OPTIONS
from worker.config import ENVIRONMENT
from worker.shared.nats_options import NATS_FLAGS, nats_config

COMPOSE = ROOT / "docker-compose.yml"
BIND = "${BIND_ADDR:-127.0.0.1}"
IMAGE = "vllm-nats-worker:latest"
DEPLOY_FILES = ("docker-compose.yml", "Dockerfile", ".dockerignore", "deploy", ".env.example")
# The compose section's commands, as a user pastes them (README: docker compose).
README_COMMANDS = (
    "cp .env.example .env\n"
    'sed -i "s/^NATS_PASSWORD=.*/NATS_PASSWORD=$(openssl rand -hex 16)/" .env\n'
    'sed -i "s|^MODEL_DIR=.*|MODEL_DIR=/path/to/your/model|" .env\n'
    "docker compose up -d --build --wait\n"
)
_VARIABLE = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?error}` (an unset required one raises)."""

    def one(match: re.Match[str]) -> str:
        name, kind, rest = match.groups()
        if env.get(name):
            return env[name]
        if kind == "?":
            raise KeyError(f"{name}: {rest}")
        return rest or ""

    return _VARIABLE.sub(one, value)


def flag_value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def seconds(duration: str) -> float:
    """A compose duration of one unit ("45s", "15m")."""
    number, unit = re.fullmatch(r"(\d+)(s|m)", duration).groups()  # type: ignore[union-attr]
    return int(number) * {"s": 1, "m": 60}[unit]


def test_the_three_services_each_have_a_healthcheck_and_restart_unless_stopped() -> None:
    found = services()
    assert set(found) == {"nats", "worker", "frontend"}
    for name, service in found.items():
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][0] == "CMD", name
        assert seconds(service["healthcheck"]["interval"]) > 0, name
    assert found["nats"]["healthcheck"]["test"] == [
        "CMD",
        "wget",
        "-qO-",
        "http://127.0.0.1:8222/healthz",
    ]
    probe = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:{}/health', timeout=5)"
    assert found["worker"]["healthcheck"]["test"] == ["CMD", "python3", "-c", probe.format(9100)]
    assert found["frontend"]["healthcheck"]["test"] == ["CMD", "python3", "-c", probe.format(8000)]
    # The worker's probe asks its own metrics port; the model load fits in its start period.
    assert flag_value(found["worker"]["command"], "--metrics-port") == "9100"
    assert seconds(found["worker"]["healthcheck"]["start_period"]) >= 600


def test_the_worker_and_the_frontend_wait_for_a_healthy_nats() -> None:
    found = services()
    for name in ("worker", "frontend"):
        assert found[name]["depends_on"] == {"nats": {"condition": "service_healthy"}}, name
    assert "depends_on" not in found["nats"]


def test_every_published_port_binds_to_bind_addr_defaulting_to_loopback() -> None:
    published = set()
    for name, service in services().items():
        for port in service.get("ports", []):
            assert port.startswith(BIND + ":"), (name, port)
            host_port, container_port = port.removeprefix(BIND + ":").split(":")
            published.add((name, host_port, container_port))
    assert published == {
        ("nats", "4222", "4222"),
        ("nats", "8222", "8222"),
        ("worker", "9100", "9100"),
        ("frontend", "8000", "8000"),
    }
    assert interpolate(BIND, {}) == "127.0.0.1"
    assert interpolate(BIND, {"BIND_ADDR": "0.0.0.0"}) == "0.0.0.0"


def test_the_worker_has_the_gpu_ipc_host_the_model_and_the_caches() -> None:
    worker = services()["worker"]
    assert worker["ipc"] == "host"
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    model, hf_cache, vllm_cache = worker["volumes"]
    assert model == {
        "type": "bind",
        "source": "${MODEL_DIR:?set MODEL_DIR in .env (the model's directory on this host)}",
        "target": "/model",
        "read_only": True,
        "bind": {"create_host_path": False},
    }
    assert hf_cache == "${HF_CACHE:-~/.cache/huggingface}:/root/.cache/huggingface"
    assert vllm_cache == "vllm-cache:/root/.cache/vllm"
    assert services()["frontend"]["volumes"] == [model]
    with pytest.raises(KeyError, match="MODEL_DIR"):
        interpolate(model["source"], {})


def test_worker_and_frontend_run_the_image_built_from_the_dockerfile() -> None:
    found = services()
    for name in ("worker", "frontend"):
        assert found[name]["image"] == IMAGE, name
        assert found[name]["build"] == {"context": ".", "dockerfile": "Dockerfile"}, name
    assert "entrypoint" not in found["worker"]  # the image's: vllm-nats-worker
    assert found["frontend"]["entrypoint"] == ["python3", "-m", "worker.frontend"]
    assert found["nats"]["image"] == "nats:2.11-alpine"


def test_stop_grace_period_outlasts_the_drain_timeout() -> None:
    worker = services()["worker"]
    drain = float(flag_value(worker["command"], "--drain-timeout"))
    assert drain == 30.0
    assert seconds(worker["stop_grace_period"]) == 45
    assert seconds(worker["stop_grace_period"]) > drain


def test_nats_takes_user_and_password_from_the_env_file_the_clients_read_too() -> None:
    found = services()
    nats = found["nats"]
    assert nats["command"] == [
        "--config",
        "/etc/nats/nats.conf",
        "-js",
        "-sd",
        "/data",
        "-m",
        "8222",
    ]
    assert nats["volumes"] == ["./deploy/nats.conf:/etc/nats/nats.conf:ro", "nats-data:/data"]
    conf = (ROOT / "deploy" / "nats.conf").read_text()
    assert "  user: $NATS_USER\n" in conf
    assert "  password: $NATS_PASSWORD\n" in conf
    # The same names are the worker's, the frontend's and the client CLI's env variables.
    assert ENVIRONMENT["NATS_USER"] == "nats_user"
    assert ENVIRONMENT["NATS_PASSWORD"] == "nats_password"
    for name, service in found.items():
        assert service["env_file"] == ".env", name
    for name in ("worker", "frontend"):
        assert found[name]["environment"] == {"NATS_URL": "nats://nats:4222"}, name
    example = (ROOT / ".env.example").read_text().splitlines()
    assert "NATS_USER=vllm" in example
    assert "NATS_PASSWORD=change-me" in example
    assert ".env" in (ROOT / ".gitignore").read_text().splitlines()


def test_no_service_installs_at_start_or_mounts_the_checkout() -> None:
    for name, service in services().items():
        started = " ".join(service.get("entrypoint", []) + service.get("command", []))
        assert "pip" not in started, name
        assert "working_dir" not in service, name
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            # Only deploy/'s files come from the checkout, and read-only.
            if source.startswith("."):
                assert source.startswith("./deploy/") and volume.endswith(":ro"), (name, volume)


def test_the_dockerfile_installs_this_project_on_vllms_image_at_build_time() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    assert [line for line in lines if line.startswith("FROM ")] == ["FROM vllm/vllm-openai:v0.24.0"]
    text = "\n".join(lines)
    assert 'python3 -m pip install --no-cache-dir "/tmp/vllm-nats-worker[gpu,frontend]"' in text
    assert "pip install -e" not in text and "--editable" not in text
    assert [line for line in lines if line.startswith("COPY ")] == [
        "COPY pyproject.toml README.md /tmp/vllm-nats-worker/",
        "COPY messages/ /tmp/vllm-nats-worker/messages/",
        "COPY worker/ /tmp/vllm-nats-worker/worker/",
    ]
    assert 'ENTRYPOINT ["vllm-nats-worker"]' in lines
    pyproject = (ROOT / "pyproject.toml").read_text().splitlines()
    assert 'vllm-nats-worker = "worker.process:main"' in pyproject
    # The image's vllm satisfies the gpu extra, so the install keeps the image's vllm and torch.
    assert 'gpu = ["vllm>=0.24.0"]' in pyproject
    assert any(line.startswith("frontend = [") for line in pyproject)
    # The build context is an allow-list of what the COPY lines take.
    ignore = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert ignore[:5] == ["*", "!pyproject.toml", "!README.md", "!messages/", "!worker/"]
    assert all(not line.startswith("!") for line in ignore[5:])


def test_the_worker_command_s_own_flags_are_the_worker_cli_s() -> None:
    command = services()["worker"]["command"]
    flags = [arg for arg in command if arg.startswith("--")]
    own = {option.flag: option for option in OPTIONS}
    nats_flags = {flag for flag, _, _ in NATS_FLAGS}
    assert [flag for flag in flags if flag in own] == ["--drain-timeout", "--metrics-port"]
    for flag in ("--drain-timeout", "--metrics-port"):
        own[flag].type(flag_value(command, flag))  # the CLI's own conversion accepts the value
    # The NATS URL and credentials come from the environment, not the command line.
    assert not nats_flags & set(flags)
    # The rest are vLLM's engine arguments (parsed by vLLM's parser in the e2e layer).
    assert [flag for flag in flags if flag not in own] == [
        "--model",
        "--served-model-name",
        "--dtype",
        "--max-logprobs",
    ]
    assert flag_value(command, "--model") == "/model"


def test_the_frontend_command_parses_with_the_frontend_cli(monkeypatch) -> None:
    from worker.frontend.cli import parse_args

    frontend = services()["frontend"]
    env = {"NATS_USER": "vllm", "NATS_PASSWORD": "s3cret", **frontend["environment"]}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = parse_args([interpolate(arg, {}) for arg in frontend["command"]])
    assert (args.model, args.served_model_name) == ("/model", ["model"])
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    config = nats_config(args)
    assert config.servers == ["nats://nats:4222"]
    assert (config.user, config.password) == ("vllm", "s3cret")


def test_the_readme_shows_the_compose_commands_and_lists_the_files() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "```\n" + README_COMMANDS + "```\n" in readme
    for path in ("`Dockerfile`", "`.dockerignore`", "`docker-compose.yml`", "`deploy/nats.conf`"):
        assert re.search(rf"^\| [^|]*{re.escape(path)}", readme, re.M), path
    assert re.search(r"^\| [^|]*`\.env\.example`", readme, re.M)
    # The set-up commands stay two; compose is a deployment section of its own.
    assert "## Two commands\n" in readme


def _run_readme_setup(directory: Path, model_dir: Path) -> dict[str, str]:
    """The README's commands before `docker compose up`, in `directory`; the resulting .env."""
    for name in DEPLOY_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, directory / name)
        else:
            shutil.copy(source, directory / name)
    setup = README_COMMANDS.replace("docker compose up -d --build --wait\n", "")
    setup = setup.replace("/path/to/your/model", str(model_dir))
    subprocess.run(["bash", "-euc", setup], cwd=directory, check=True)
    pairs = [
        line.split("=", 1)
        for line in (directory / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    return dict(pairs)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the README's commands use openssl")
def test_the_readme_setup_commands_fill_in_the_env_file(tmp_path: Path) -> None:
    env = _run_readme_setup(tmp_path, tmp_path / "model")
    assert re.fullmatch(r"[0-9a-f]{32}", env["NATS_PASSWORD"])
    assert env["MODEL_DIR"] == str(tmp_path / "model")
    assert env["NATS_USER"] == "vllm"
    assert set(env) == {"NATS_USER", "NATS_PASSWORD", "MODEL_DIR", "SERVED_MODEL_NAME", "DTYPE"}


def _compose_plugin() -> bool:
    if shutil.which("docker") is None:
        return False
    found = subprocess.run(["docker", "compose", "version"], capture_output=True)
    return found.returncode == 0


@pytest.mark.skipif(
    shutil.which("openssl") is None or not _compose_plugin(),
    reason="needs `docker compose` (the compose plugin; no daemon) and openssl",
)
def test_docker_compose_config_passes_with_the_readme_s_env_file(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    model = tmp_path / "model"
    model.mkdir()
    env = _run_readme_setup(project, model)

    def config() -> dict[str, Any]:
        done = subprocess.run(
            ["docker", "compose", "config", "--format", "json"],
            cwd=project,
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(done.stdout)

    resolved = config()["services"]
    for name in ("nats", "worker", "frontend"):
        assert {port["host_ip"] for port in resolved[name]["ports"]} == {"127.0.0.1"}, name
        assert resolved[name]["environment"]["NATS_PASSWORD"] == env["NATS_PASSWORD"], name
    assert resolved["worker"]["volumes"][0]["source"] == str(model)
    command = resolved["worker"]["command"]
    assert command[:4] == ["--model", "/model", "--served-model-name", "model"]

    with (project / ".env").open("a") as file:
        file.write("BIND_ADDR=0.0.0.0\n")
    widened = config()["services"]
    assert {port["host_ip"] for port in widened["frontend"]["ports"]} == {"0.0.0.0"}

    (project / ".env").write_text(f"NATS_USER=vllm\nNATS_PASSWORD={env['NATS_PASSWORD']}\n")
    refused = subprocess.run(
        ["docker", "compose", "config"], cwd=project, capture_output=True, text=True
    )
    assert refused.returncode != 0
    assert "set MODEL_DIR in .env" in refused.stderr
