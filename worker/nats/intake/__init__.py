"""Where requests come in: each intake owns its subscription, its failure guard (anything that
raises while taking a message still ends that request visibly), how frames go back and how a
message is settled.

- `core.py`: the core NATS queue group (at most once): `--mode core`;
- `jetstream.py`: a durable JetStream work queue (redelivered until settled): `--mode jetstream`.

Both hand requests to the service core (`worker.service.RequestService.accept`) and are started and
stopped by `worker.nats.worker.NatsWorker` through this interface.
"""

from __future__ import annotations

from typing import Protocol


class Intake(Protocol):
    async def start(self) -> None:
        """Subscribes; once it returns, the server routes requests to this worker."""
        ...

    async def stop(self) -> None:
        """Stops taking requests (drain); requests already taken keep running."""
        ...
