"""Where requests come in: each intake owns its subscription, its failure guard (anything that
raises while taking a message still ends that request visibly), how frames go back and how a
message is settled.

- `core.py`: the core NATS queue group (at most once): `--mode core`;
- `jetstream.py`: a durable JetStream work queue (redelivered until settled): `--mode jetstream`.

Both hand requests to the request service (`RequestService.accept`); `make_intake` picks one by
the configuration, and the worker runtime (worker/nats/runtime.py) starts and stops either alike.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from nats.aio.client import Client as NATS

from worker.config import WorkerConfig
from worker.nats.discovery import Endpoint
from worker.nats.liveness import Liveness
from worker.service import RequestService


class Intake(Protocol):
    failed: asyncio.Event
    """Set when the intake can take no more requests although it was not stopped: the worker
    then drains and exits non-zero rather than stay registered with nobody taking work."""

    endpoints: list[Endpoint]
    """What discovery lists as this worker's endpoints (subjects taken in a queue group)."""

    def describe(self) -> tuple[dict[str, str], str]:
        """Discovery metadata of the mode (`mode`, and for JetStream its stream and consumer),
        and one line for the log saying where requests come from."""
        ...

    async def start(self) -> None:
        """Subscribes; once it returns, the server routes requests to this worker. Raises
        `JetStreamConfigError` for a stream or consumer set up otherwise."""
        ...

    async def stop(self) -> None:
        """Stops taking requests (drain); requests already taken keep running."""
        ...


def make_intake(
    config: WorkerConfig, service: RequestService, nc: NATS, liveness: Liveness
) -> Intake:
    """The intake of the configured mode: JetStream when `config.jetstream` is set, else core."""
    from worker.nats.intake.core import CoreIntake
    from worker.nats.intake.jetstream import JetStreamIntake

    if config.jetstream is not None:
        return JetStreamIntake(service, nc, liveness, config.subjects, config.jetstream)
    return CoreIntake(service, nc, liveness, config)
