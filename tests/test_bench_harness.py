"""The benchmark harness compares like with like: both sides of P1 generate the same tokens for
the same requests, and the P3 synthetic engine's frames obey the wire contract."""

from __future__ import annotations

import msgspec

from bench.load import DirectSender, NatsSender, prompts, run
from bench.p3_transport import SyntheticFastEngine
from messages.codec import MSGPACK
from messages.subjects import Subjects
from worker.config import NatsConfig, WorkerConfig

from .conftest import TEST_SUBJECTS


async def test_p1_sides_generate_the_same_number_of_tokens(engine, worker, client) -> None:
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
        assert sender.frames >= 8 * 12  # at least one frame per token step was read
    finally:
        await sender.stop()


async def test_synthetic_engine_frames_follow_the_wire_contract(nats_server, client) -> None:
    from worker.service import Worker
    from worker.transport import connect

    subjects = Subjects("synth", "vllm", "generate")
    nc = await connect(NatsConfig(servers=[nats_server.url]))
    worker = Worker(
        SyntheticFastEngine(),
        nc,
        WorkerConfig(nats=NatsConfig(servers=[nats_server.url]), subjects=subjects),
    )
    await worker.start()
    inbox = client.new_inbox()
    subscription = await client.subscribe(inbox)
    try:
        from bench.load import make_request

        request = make_request([5, 6, 7], 4, 5)
        await client.publish(subjects.generate, MSGPACK.encode(request), reply=inbox)
        maps = []
        while not maps or maps[-1]["finish_reason"] is None:
            msg = await subscription.next_msg(timeout=10)
            if msg.data:
                maps.append(msgspec.msgpack.decode(msg.data))
        assert [m["seq"] for m in maps] == [0, 1, 2, 3]
        assert [m["finish_reason"] for m in maps] == [None, None, None, "length"]
        for m in maps:
            assert len(m["token_ids"]) == len(m["log_probs"]) == len(m["top_logprobs"]) == 1
            assert [row["rank"] for row in m["top_logprobs"][0]] == [1, 2, 3, 4, 5]
        assert maps[-1]["completion_usage"]["completion_tokens"] == 4
    finally:
        await subscription.unsubscribe()
        await worker.stop()
        await nc.close()
