"""The engine side, and the only package that imports vllm.

- `contract.py`: the engine contract the request lifecycle is written against;
- `vllm_adapter.py`: that contract over vLLM's AsyncLLM;
- `args.py`: vLLM's own CLI arguments and the engine arguments derived from them;
- `logprobs.py`: vLLM's logprobs → aligned rows (token text and bytes: `worker.shared.tokens`);
- `fast_merge.py`: a version-gated cheaper merge of vLLM's pending flat logprobs;
- `reaper.py`: a watchdog process, so the engine's processes die with the worker.
"""
