"""Development tools, never part of a production worker: an embedded nats-server, the seeded
tiny model, the one-command demo, and fake engines for transport-level tests and benchmarks."""
