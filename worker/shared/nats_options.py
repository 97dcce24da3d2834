"""The NATS connection options every tool takes alike (the worker, `python -m worker.client`,
`python -m worker.frontend`): their flags, their environment variables (worker.config's
ENVIRONMENT, the one place the environment is read) and the NatsConfig they make."""

from __future__ import annotations

import argparse
from typing import Any

from worker.config import ENVIRONMENT, NatsConfig, default, environment

# (flag, NatsConfig field, help). --nats-url fills `servers`: a comma-separated list.
NATS_FLAGS: list[tuple[str, str, str]] = [
    (
        "--nats-url",
        "servers",
        "NATS server URL, or a comma-separated list of a cluster's nodes",
    ),
    ("--nats-user", "user", "user name"),
    ("--nats-password", "password", "password"),
    ("--nats-token", "token", "token"),
    ("--nats-creds", "creds_file", "credentials (JWT + nkey) file"),
    ("--nats-nkey-seed", "nkeys_seed", "nkey seed file"),
    ("--tls-ca", "tls_ca", "CA file"),
    ("--tls-cert", "tls_cert", "client certificate"),
    ("--tls-key", "tls_key", "client key"),
]

LOCAL_URL = ",".join(default(NatsConfig, "servers"))
"""The client's and frontend's default URL: NatsConfig's own."""


def servers(value: str) -> list[str]:
    return [url.strip() for url in value.split(",") if url.strip()]


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_nats_arguments(parser: argparse.ArgumentParser, *, url_default: str | None) -> None:
    """The NATS flags, as an argument group of `parser`, with their environment variables as
    defaults. `url_default`: None where a URL must be given (the production worker)."""
    group = parser.add_argument_group("NATS connection", "also from environment variables")
    env_of = {name_dest: name for name, name_dest in ENVIRONMENT.items()}
    for flag, _, help_text in NATS_FLAGS:
        name = dest(flag)
        if name in env_of:
            help_text += f" [env {env_of[name]}]"
        default = url_default if flag == "--nats-url" else None
        if default is not None:
            # Spelled with %(default)s: argparse's ArgumentDefaultsHelpFormatter then adds no
            # second "(default: …)", and a plain formatter expands it all the same.
            help_text += " (default: %(default)s)"
        group.add_argument(flag, default=default, help=help_text)
    found = environment()
    parser.set_defaults(
        **{dest(flag): found[dest(flag)] for flag, _, _ in NATS_FLAGS if dest(flag) in found}
    )


def nats_config(args: argparse.Namespace, **overrides: Any) -> NatsConfig:
    """The NatsConfig of parsed NATS flags (`overrides`: other NatsConfig fields)."""
    fields: dict[str, Any] = {field: getattr(args, dest(flag)) for flag, field, _ in NATS_FLAGS}
    fields["servers"] = servers(fields["servers"] or "")
    return NatsConfig(**fields, **overrides)
