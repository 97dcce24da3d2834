"""vLLM worker served over NATS.

The request path, top to bottom: `process.py` (the command: one worker process, or N over one
engine core; options parsed into configuration by `cli.py`) → `nats/runtime.py` (the worker on a
NATS connection and its lifecycle) → `nats/intake/` (core queue group or JetStream, picked by
`make_intake`) → `service.py` (`RequestService`: admission, in-flight, drain) → `session.py` (one
request's frames) → `engine/` (the engine contract and the vLLM adapter). The publisher side is
`client/` and `frontend/`; what both sides use is `shared/`; `dev/` holds the embedded
nats-server, the tiny model, the demo and the fake engines.

Importing `worker` (or `worker.client`) needs no vllm or torch: only `worker.engine` imports
vllm, and only `worker.nats`, `worker.shared` and the publisher side import nats.
"""

__version__ = "0.1.0"
