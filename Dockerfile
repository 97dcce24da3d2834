# The worker and the frontend: vLLM's own GPU image plus this project, installed at build time
# (not editable, no mounted checkout): a container start needs neither PyPI nor the source tree.
#   docker compose build   (or: docker build -t vllm-nats-worker:latest .)
# The tag satisfies the `gpu` extra's `vllm>=0.24.0`, so pip keeps the image's vllm and torch.
FROM vllm/vllm-openai:v0.24.0

# Only what the package needs (.dockerignore is an allow-list of the same paths). The sources
# are removed after the install: what runs is the installed package, never a copy in the cwd.
COPY pyproject.toml README.md /tmp/vllm-nats-worker/
COPY messages/ /tmp/vllm-nats-worker/messages/
COPY worker/ /tmp/vllm-nats-worker/worker/
RUN python3 -m pip install --no-cache-dir "/tmp/vllm-nats-worker[gpu,frontend]" \
    && rm -rf /tmp/vllm-nats-worker \
    && cd / && python3 -c "import worker.process, worker.frontend.app"

# vLLM's image starts `vllm serve`; this one the NATS worker. The compose file's frontend
# service overrides it with `python3 -m worker.frontend`.
ENTRYPOINT ["vllm-nats-worker"]
CMD ["--help"]
