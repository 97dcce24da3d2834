"""OpenAI-compatible HTTP frontend over NATS: `/v1/completions`, `/v1/chat/completions` and
`/v1/models`, and vLLM's `/tokenize`, `/detokenize`, `/health`, `/metrics`, `/version`.

It tokenizes with the model's tokenizer (its chat template for chat), sends a `GenerateRequest`
through `worker.client` and turns the frames into OpenAI's JSON shapes. It needs fastapi, uvicorn
and transformers (the `frontend` extra) but neither vllm nor torch.

- `app.py`: `create_app`: the FastAPI app, its middleware, error handlers and routes
- `routes/`: one thin APIRouter per endpoint group (completions, chat, models, tokenize, system)
- `service.py`: `FrontendService`: NATS, the router, tokenizer, settings and metrics; sends the
  requests and reads their frames
- `streams.py`: a request's frames stopped when the HTTP client leaves; a batch's fan-in
- `answers.py`: one response from its frames: choice numbering, envelope, usage, chunks
- `openai_shapes.py`: frames → one OpenAI choice: text, logprobs, echo, finish reasons
- `sse.py`: a streamed answer as server-sent events
- `generate_requests.py`: OpenAI bodies → GenerateRequests; `prompts.py`: prompts → token ids
- `errors.py`: OpenAI's error body and each failure's status; `gate.py`: API key and metrics
- `schemas.py`: the OpenAI request bodies and their validation rules
- `tokenizer.py`: the model's tokenizer: prompts → token ids, token ids → text
- `settings.py`: every default of its options; `metrics.py`: its Prometheus metrics
- `cli.py`, `processes.py`, `__main__.py`: `python -m worker.frontend` (one or N processes)
"""
