"""The frontend's HTTP routes, one APIRouter per endpoint group; each handler parses its body,
calls the FrontendService (`app.state.service`) and the pure shaping functions, and returns.

- `completions.py`: `/v1/completions`; `chat.py`: `/v1/chat/completions`;
- `embeddings.py`: `/v1/embeddings` (embedding models' workers);
- `models.py`: `/v1/models`; `tokenize.py`: vLLM's `/tokenize` and `/detokenize`;
- `system.py`: `/health`, `/metrics`, `/version`;
- `admin.py`: vLLM's admin routes (LoRA adapters, prefix cache, sleep), to every worker,
  mounted only behind vLLM's switches (`admin_routers`);
- `common.py`: the service dependency and the answer as a JSON body or an SSE stream.
"""

from __future__ import annotations

from fastapi import APIRouter

from worker.frontend.routes.admin import admin_routers
from worker.frontend.routes.chat import router as chat
from worker.frontend.routes.completions import router as completions
from worker.frontend.routes.embeddings import router as embeddings
from worker.frontend.routes.models import router as models
from worker.frontend.routes.system import router as system
from worker.frontend.routes.tokenize import router as tokenize

ROUTERS: tuple[APIRouter, ...] = (system, models, tokenize, completions, chat, embeddings)

__all__ = ["ROUTERS", "admin_routers"]
