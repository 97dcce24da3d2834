"""OpenAI-compatible HTTP frontend over NATS: `/v1/completions`, `/v1/chat/completions` and
`/v1/models`, and vLLM's `/tokenize`, `/detokenize`, `/health`, `/metrics`, `/version`.

It tokenizes with the model's tokenizer (its chat template for chat), sends a `GenerateRequest`
through `worker.client` and turns the frames into OpenAI's JSON shapes. It needs fastapi, uvicorn
and transformers (the `frontend` extra) but neither vllm nor torch.

- `tokenizer.py`: the model's tokenizer: prompts → token ids, token ids → text
- `schemas.py`: the OpenAI request bodies and their validation rules
- `openai_shapes.py`: frames → OpenAI choices, logprobs and chunks
- `app.py`: the routes, batches, the API key and metrics middleware
- `settings.py`: every default of its options; `metrics.py`: its Prometheus metrics
- `cli.py`, `processes.py`, `__main__.py`: `python -m worker.frontend` (one or N processes)
"""
