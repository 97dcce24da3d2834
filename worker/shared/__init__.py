"""What the worker and the publisher side (client/, frontend/) both use, so that neither
imports the other's internals: the publisher side never imports `worker.engine`,
`worker.service` or `worker.nats` (tests/unit/test_layers.py checks it).

- `tokens.py`: the per-tokenizer table, token id → text piece and true bytes;
- `nats_options.py`: the NATS flags every tool shares (argparse → NatsConfig, no nats import);
- `nats_connection.py`: connect (servers, auth, TLS, reconnects), unsubscribe;
- `nats_compat.py`: the one place nats-py private attributes are read (version-gated).
"""
