"""OpenAI-compatible HTTP frontend over NATS: `/v1/completions`, `/v1/chat/completions` and
`/v1/models`.

It tokenizes with the model's tokenizer (its chat template for chat), sends a `GenerateRequest`
through `worker.client` and turns the frames into OpenAI's JSON shapes. It needs fastapi, uvicorn
and transformers (the `frontend` extra) but neither vllm nor torch.

- `tokenizer.py`: the model's tokenizer: prompts → token ids, token ids → text
- `schemas.py`: the OpenAI request bodies and their validation rules
- `openai_shapes.py`: frames → OpenAI choices, logprobs and chunks
- `app.py`: the routes; `__main__.py`: `python -m worker.frontend`
"""
