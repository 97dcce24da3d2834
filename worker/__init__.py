"""vLLM worker served over NATS.

Importing `worker` (or `worker.client`) needs no vllm or torch: only `worker.vllm_engine` imports
vllm, and only the modules that run the engine import it.
"""

__version__ = "0.1.0"
