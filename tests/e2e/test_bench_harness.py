"""The benchmark harness compares like with like: both sides of bench.worker_overhead generate
the same tokens for the same requests, and the engine ceiling (bench.ceiling) reads engine
arguments as the worker does. (The synthetic engine of bench.transport_ceiling is checked
against the wire contract in tests/integration/test_fake_engine.py.)"""

from __future__ import annotations

from bench.ceiling import llm_kwargs
from bench.load import DirectSender, NatsSender, prompts, run
from tests.helpers import TEST_SUBJECTS


async def test_overhead_sides_generate_the_same_number_of_tokens(engine, worker, client) -> None:
    token_prompts = prompts(8, 16, engine.limits.vocab_size)
    sender = NatsSender(client, TEST_SUBJECTS.generate)
    await sender.start()
    try:
        for logprobs in (None, 5):
            results = [
                await run(
                    side,
                    token_prompts,
                    concurrency=4,
                    requests_per_stream=2,
                    max_tokens=12,
                    logprobs=logprobs,
                )
                for side in (DirectSender(engine), sender)
            ]
            assert [r.tokens for r in results] == [4 * 2 * 12] * 2
            assert all(len(r.ttft_s) == 8 and min(r.ttft_s) > 0 for r in results)
        # Every request's frames were read: at least one each, at most one a token plus a final
        # one (under load the worker coalesces engine steps, so fewer frames than tokens is fine).
        assert 2 * 8 <= sender.frames <= 2 * 8 * (12 + 1)
    finally:
        await sender.stop()


def test_ceiling_reads_engine_arguments_as_vllm_serve_does(tiny_model) -> None:
    kwargs = llm_kwargs(
        [
            "--model",
            str(tiny_model),
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--max-logprobs",
            "20",
        ]
    )
    assert kwargs["model"] == str(tiny_model)
    assert kwargs["dtype"] == "float32"
    assert kwargs["max_model_len"] == 512
    assert kwargs["max_logprobs"] == 20
