"""The publisher side: send a GenerateRequest over NATS and read its frames (nats-py and
`messages` only: no vllm or torch).

- `library.py`: `generate` / `complete` (core, with retry of refusals on other workers),
  `jetstream_generate` / `jetstream_complete` / `jetstream_stream` (one attempt, for a user's
  stream), discovery of workers;
- `reader.py`: the one frame reader (seq order, the stop rule, probes skipped; `Inbox`, a reply
  subscription read without a task per message) and `fold`;
- `embeddings.py`: `embed` / `jetstream_embed` (EmbedRequests to workers of a pooling model,
  retried whole on another worker for any retryable end);
- `fleet.py`: admin commands (adapters, prefix cache, sleep) to every worker of a subject;
- `__main__.py`: `python -m worker.client`.
"""

from worker.client.embeddings import Embeddings, embed, jetstream_embed
from worker.client.library import (
    WorkerInstance,
    complete,
    connect_url,
    discover_workers,
    find_worker,
    generate,
    jetstream_complete,
    jetstream_generate,
    jetstream_stream,
    stream_frames,
    subjects_of,
    wait_for_worker,
)
from worker.client.reader import (
    Choice,
    Completion,
    FrameOrderError,
    Inbox,
    RequestEnd,
    RequestError,
    fold,
    frame_payloads,
    is_probe,
    read_frames,
)
from worker.client.router import ROUTING_MODES, KvRouter, Route, RoutingMode

__all__ = [
    "ROUTING_MODES",
    "KvRouter",
    "Route",
    "RoutingMode",
    "Choice",
    "Completion",
    "Embeddings",
    "FrameOrderError",
    "Inbox",
    "RequestEnd",
    "RequestError",
    "WorkerInstance",
    "complete",
    "connect_url",
    "discover_workers",
    "embed",
    "find_worker",
    "fold",
    "frame_payloads",
    "generate",
    "is_probe",
    "jetstream_complete",
    "jetstream_embed",
    "jetstream_generate",
    "jetstream_stream",
    "read_frames",
    "stream_frames",
    "subjects_of",
    "wait_for_worker",
]
