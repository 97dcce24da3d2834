"""The worker's NATS side, and the only worker package (besides the publisher side) that
imports nats.

- `runtime.py`: the worker on one NATS connection and its lifecycle (`WorkerRuntime`,
  `open_worker`);
- `intake/`: where requests come in (core queue group, JetStream work queue);
- `liveness.py`: client probes and publishing that waits out a broker outage;
- `discovery.py`: the NATS micro protocol (`$SRV.PING/INFO/STATS`).

The connection, its options and nats-py compat are `worker.shared`'s (the publisher side uses
them too).
"""
