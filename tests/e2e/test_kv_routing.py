"""KV-aware routing on the real engine: vLLM's own KV cache events (its ZMQ publisher) reach
the router through the worker, keyed by the router's own hashes over the token ids; a router
started later learns the same from the worker's snapshot; load reports carry vLLM's scheduler
state. Two workers with engines of their own: bench/kv_routing.py."""

from __future__ import annotations

import random

import msgspec

from tests.helpers import TEST_SUBJECTS, until
from worker.client import KvRouter, generate
from worker.client.prefix_index import prefix_keys
from worker.client.requests import make_request


def block_size(engine) -> int:
    return engine.llm.vllm_config.cache_config.block_size


async def run(client, request) -> list[int]:
    tokens: list[int] = []
    async for frame in generate(client, request, subject=TEST_SUBJECTS.generate):
        assert not frame.error, frame.error
        tokens += frame.token_ids
    return tokens


async def test_the_real_engines_cache_reaches_the_router(engine, worker, client):
    size = block_size(engine)
    rng = random.Random(18)
    prompt = [rng.randrange(3, 1000) for _ in range(2 * size + 7)]  # 2 full blocks and a bit
    router = KvRouter(client, TEST_SUBJECTS)
    await router.start()
    try:
        me = worker.config.instance_id
        await until(lambda: me in router.workers and router.workers[me].load is not None)
        assert router.route(prompt).overlap_blocks == 0  # nothing of it cached yet
        await run(client, make_request("kv-e2e-1", prompt, max_tokens=4, logprobs=2))
        view = router.workers[me]
        await until(lambda: router.route(prompt + [5, 6]).overlap_blocks == 2)
        assert view.index is not None and view.index.block_size == size
        route = router.route(prompt)
        assert (route.subject, route.overlap_blocks) == (TEST_SUBJECTS.instance(me), 2)
        # A router started now learns the same from the worker's snapshot.
        late = KvRouter(client, TEST_SUBJECTS)
        await late.start()
        try:
            assert late.workers[me].index is not None
            assert late.workers[me].index.overlap(prefix_keys(prompt, size)) == 2
        finally:
            await late.stop()
        # Load reports carry vLLM's scheduler state next to the worker's own count. A report
        # sent while kv-e2e-1's last frame was on its way still counts it (in_flight 1): the
        # next one, a second later, must say 0.
        await until(
            lambda: (
                view.load is not None
                and view.load.kv_usage is not None
                and view.load.in_flight == 0
            )
        )
        assert view.load is not None and view.load.running is not None
        assert view.load.in_flight == 0 and view.load.draining is False
    finally:
        await router.stop()


async def test_the_engines_events_on_the_wire(engine, worker, client):
    """What a router in another language reads: vLLM's block hashes and token ids, re-framed."""
    size = block_size(engine)
    rng = random.Random(1818)
    prompt = [rng.randrange(3, 1000) for _ in range(size)]
    subject = TEST_SUBJECTS.kv("events", worker.config.instance_id)
    events = await client.subscribe(subject)
    try:
        await run(client, make_request("kv-e2e-2", prompt, max_tokens=2))
        stored = []
        while not any(e["token_ids"][:size] == prompt for e in stored):
            batch = msgspec.msgpack.decode((await events.next_msg(timeout=5)).data)
            assert batch["block_size"] == size
            stored += [e for e in batch["events"] if e["type"] == "stored"]
        event = next(e for e in stored if e["token_ids"][:size] == prompt)
        assert event["parent_block_hash"] is None  # the prompt's first block
        assert len(event["token_ids"]) == size * len(event["block_hashes"])
    finally:
        await events.unsubscribe()


async def test_the_frontend_routes_by_kv_and_releases_every_route(
    engine, worker, nats_server, tiny_model
):
    """The OpenAI frontend's default router: a repeated long prompt goes to the worker holding
    it, and every request's route is released however it ended (streamed, not streamed, a
    batch, a client that left), so the router's own load count returns to zero."""
    import httpx
    import nats

    from tests.helpers import serving
    from worker.frontend.app import FrontendSettings, create_app
    from worker.frontend.tokenizer import ModelTokenizer

    nc = await nats.connect(nats_server.url)
    settings = FrontendSettings(model_names=(str(tiny_model),), subject=TEST_SUBJECTS.generate)
    assert settings.router == "kv"
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    size = block_size(engine)
    rng = random.Random(77)
    prompt = [rng.randrange(3, 1000) for _ in range(size + 5)]
    try:
        async with serving(app) as base, httpx.AsyncClient(timeout=60) as http:
            router = app.state.router
            me = worker.config.instance_id
            await until(lambda: me in router.workers and router.workers[me].load is not None)
            url = base + "/v1/completions"
            common = {"model": str(tiny_model), "max_tokens": 4}
            answer = await http.post(url, json={**common, "prompt": prompt})
            assert answer.status_code == 200
            view = router.workers[me]
            await until(lambda: view.index.overlap(prefix_keys(prompt, size)) == 1)
            assert router.engines[me].mine == 0
            streamed = {**common, "prompt": prompt, "stream": True}
            async with http.stream("POST", url, json=streamed) as stream:
                assert stream.status_code == 200
                assert "data: [DONE]" in [line async for line in stream.aiter_lines()]
            batch = await http.post(url, json={**common, "prompt": [prompt, prompt[:7]]})
            assert batch.status_code == 200 and len(batch.json()["choices"]) == 2
            leaving = {
                **common,
                "prompt": prompt,
                "stream": True,
                "max_tokens": 400,
                "ignore_eos": True,
            }
            async with http.stream("POST", url, json=leaving) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: "):
                        break
            await until(lambda: router.engines[me].mine == 0)
            assert all(engine.mine == 0 for engine in router.engines.values())
    finally:
        await nc.close()
