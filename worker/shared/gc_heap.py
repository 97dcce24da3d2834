"""The start-up heap kept out of the garbage collector's full collections.

A worker or frontend process imports vLLM, torch and transformers: a heap of a million or more
objects that lives as long as the process. Python's oldest-generation collection walks every
tracked object each time it runs, and under load with logprobs (many short-lived rows and
frames) it runs often enough to pause the event loop for every stream at once, a whole wave of
requests' first tokens late together. `vllm serve` freezes its API server's start-up heap for
the same reason (vLLM's `freeze_gc_heap`, called once the server has started); the worker and
the frontend do the same before they serve.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect what start-up left as garbage, then move every surviving object to the
    permanent generation, which collections do not scan. Call once per process, after start-up
    and before serving: objects frozen are never freed, so a later call would pin request-time
    objects too."""
    gc.collect()
    gc.freeze()
