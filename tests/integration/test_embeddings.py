"""Embedding requests over a real nats-server, workers on the fake embedder (the real engine's
vectors are compared with vLLM's server in tests/e2e/test_embeddings.py): the queue group and
instance subjects, a retryable failure answered by another worker, malformed payloads in both
intake modes, and the JetStream work queue (requests queued while no worker runs; a worker
stopped mid-request, its request redelivered and answered once)."""

from __future__ import annotations

import asyncio

import pytest

from messages.codec import JSON, MSGPACK
from messages.embeddings import EmbedRequest
from messages.subjects import Subjects
from tests.helpers import frame_list, settled_state, stream_state
from tests.integration.conftest import MakeWorker
from worker.client import RequestError, embed, jetstream_embed
from worker.config import JetStreamSettings
from worker.dev.fakes import FakeEmbedder, fake_embedding_engine
from worker.engine.contract import EngineFailure


class FailingEmbedder(FakeEmbedder):
    async def embed(self, request: EmbedRequest, engine_request_id: str) -> list[bytes]:
        self.embedded += 1
        raise EngineFailure("the pooler failed")


def request(request_id: str, count: int = 3) -> EmbedRequest:
    return EmbedRequest(request_id=request_id, inputs=[[i + 1, 7, i + 2] for i in range(count)])


async def test_the_queue_group_answers_many_clients_with_vectors_in_order(
    client, fake_worker: MakeWorker
) -> None:
    subjects = Subjects("emb", "vllm", "embed")
    embedders = [FakeEmbedder(delay_s=0.02), FakeEmbedder(delay_s=0.02)]
    for embedder in embedders:
        await fake_worker(subjects, fake_embedding_engine(embedder))
    answers = await asyncio.gather(
        *(
            embed(client, request(f"q-{n}", count=n % 4 + 1), subject=subjects.generate)
            for n in range(40)
        )
    )
    for n, answer in enumerate(answers):
        count = n % 4 + 1
        assert answer.request_id == f"q-{n}"
        assert answer.dimensions == 8
        assert answer.prompt_tokens == 3 * count
        assert [v[:3] for v in answer.floats()] == [
            [3.0, float(i + 1), float(i + 2)] for i in range(count)
        ]
    assert all(e.embedded > 0 for e in embedders)  # both workers of the queue group served
    assert sum(e.embedded for e in embedders) == sum(n % 4 + 1 for n in range(40))


async def test_a_retryable_failure_is_answered_by_another_worker(
    client, fake_worker: MakeWorker
) -> None:
    subjects = Subjects("embretry", "vllm", "embed")
    failing, healthy = FailingEmbedder(), FakeEmbedder()
    bad = await fake_worker(subjects, fake_embedding_engine(failing))
    await fake_worker(subjects, fake_embedding_engine(healthy))
    target = subjects.instance(bad.config.instance_id)
    answer = await embed(client, request("r1"), subject=target)
    assert len(answer.vectors) == 3
    assert failing.embedded == 1 and healthy.embedded == 3
    # With no retry left, the error reaches the caller with its code.
    with pytest.raises(RequestError) as failed:
        await embed(client, request("r2"), subject=target, retries=0)
    assert failed.value.code == "engine_error"
    assert "the pooler failed" in failed.value.message
    # A final error (the request's fault) is not retried.
    with pytest.raises(RequestError) as refused:
        await embed(
            client, EmbedRequest(request_id="r3", inputs=[[1, 5000]]), subject=subjects.generate
        )
    assert refused.value.code == "invalid_request"
    assert "inputs[0][1]" in refused.value.message
    assert healthy.embedded == 3


MALFORMED = [
    (b"\xc1\xff garbage", False, "invalid payload"),
    (b'{"request_id": "m1", "inputs": []}', True, "$.inputs"),
    (b'{"request_id": "m2", "token_ids": [1, 2]}', True, "inputs"),
    (b'{"request_id": "m3", "inputs": [[1]], "dimensions": -1}', True, "$.dimensions"),
]


async def test_malformed_payloads_get_one_error_frame_in_both_intake_modes(
    client, fake_worker: MakeWorker, queue_worker: MakeWorker
) -> None:
    core = Subjects("embbad", "vllm", "embed")
    queued = Subjects("embbadjs", "vllm", "embed")
    settings = JetStreamSettings()
    embedder = FakeEmbedder()
    await fake_worker(core, fake_embedding_engine(embedder))
    await queue_worker(queued, settings, fake_embedding_engine(embedder))
    for payload, as_json, named in MALFORMED:
        for subject, jetstream in ((core.generate, False), (queued.queue, True)):
            frames = await frame_list(client, subject, payload, json=as_json, jetstream=jetstream)
            assert len(frames) == 1, (payload, subject)
            (frame,) = frames
            assert frame["finish_reason"] == "error"
            assert frame["error"]["code"] == "invalid_request"
            assert named in frame["error"]["message"]
    assert embedder.embedded == 0
    # Nothing was harmed: both serve the next request, and the queue holds nothing.
    assert len((await embed(client, request("after"), subject=core.generate)).vectors) == 3
    answer = await jetstream_embed(client, request("after-js"), subjects=queued)
    assert len(answer.vectors) == 3
    state, consumer = await settled_state(client, queued, settings)
    assert state.messages == 0 and consumer.num_ack_pending == 0


async def test_the_work_queue_holds_requests_and_redelivers_a_stopped_workers(
    client, queue_worker: MakeWorker
) -> None:
    subjects = Subjects("embjs", "vllm", "embed")
    settings = JetStreamSettings()
    first = await queue_worker(subjects, settings, fake_embedding_engine(FakeEmbedder()))
    await first.stop()  # the stream and the durable consumer outlive it
    tasks = [
        asyncio.create_task(jetstream_embed(client, request(f"js-{n}"), subjects=subjects))
        for n in range(6)
    ]
    await asyncio.sleep(0.5)
    state, _ = await stream_state(client, subjects, settings)
    assert state.messages == 6 and not any(task.done() for task in tasks)

    # A worker that holds them for a long time is stopped mid-request: each is left to the
    # queue (no error frame), redelivered and answered once by the next worker.
    slow = FakeEmbedder(delay_s=30.0)
    stopped = await queue_worker(subjects, settings, fake_embedding_engine(slow))
    await asyncio.sleep(0.5)
    assert stopped.service.in_flight == 6
    await stopped.stop()
    fast = FakeEmbedder()
    await queue_worker(subjects, settings, fake_embedding_engine(fast))
    answers = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert [a.request_id for a in answers] == [f"js-{n}" for n in range(6)]
    assert all(len(a.vectors) == 3 for a in answers)
    assert fast.embedded == 18 and slow.embedded == 0
    state, consumer = await settled_state(client, subjects, settings)
    assert state.messages == 0 and consumer.num_ack_pending == 0


async def test_json_requests_get_json_frames(client, fake_worker: MakeWorker) -> None:
    subjects = Subjects("embjson", "vllm", "embed")
    await fake_worker(subjects, fake_embedding_engine())
    answer = await embed(client, request("j1", 2), subject=subjects.generate, codec=JSON)
    assert answer.floats()[1][:3] == [3.0, 2.0, 3.0]
    payload = MSGPACK.encode(request("j2", 1))
    (frame,) = await frame_list(client, subjects.generate, payload)
    assert frame["finish_reason"] == "stop"
    assert frame["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert len(frame["embeddings"][0]) == 8 * 4
