"""The worker's NATS side, and the only worker package (besides the publisher side) that
imports nats.

- `worker.py`: the service core wired to a NATS connection (`NatsWorker`);
- `intake/`: where requests come in (core queue group, JetStream work queue);
- `liveness.py`: client probes and publishing that waits out a broker outage;
- `discovery.py`: the NATS micro protocol (`$SRV.PING/INFO/STATS`);
- `connection.py`: servers, auth, TLS, reconnects; `compat.py`: nats-py private access;
- `options.py`: the NATS flags every tool shares (no nats import: argparse → NatsConfig).
"""
