"""vLLM worker served over NATS.

The request path, top to bottom: `cli.py` (options → config) → `nats/worker.py` (the worker on a
NATS connection) → `nats/intake/` (core queue group or JetStream) → `service.py` (admission,
in-flight, drain) → `session.py` (one request's frames) → `engine/` (the engine contract and the
vLLM adapter). The publisher side is `client/` and `frontend/`; `dev/` holds the embedded
nats-server, the tiny model, the demo and the fake engines.

Importing `worker` (or `worker.client`) needs no vllm or torch: only `worker.engine` imports
vllm, and only `worker.nats` and the publisher side import nats.
"""

__version__ = "0.1.0"
