"""vLLM's admin routes through the frontend, on the session's worker (the real engine):
`/reset_prefix_cache` (seen in the worker's KV events), `/sleep`, `/is_sleeping` and
`/wake_up`, each behind vLLM's switch. The LoRA routes, on a worker with LoRA on:
tests/e2e/test_cli_worker.py."""

from __future__ import annotations

import httpx
import nats
import pytest

from messages.codec import MSGPACK
from messages.kv import AllCleared, KvEventBatch
from tests.helpers import TEST_SUBJECTS, serving
from worker.frontend.app import FrontendSettings, create_app
from worker.frontend.tokenizer import ModelTokenizer


@pytest.fixture
async def admin_frontend(worker, nats_server, tiny_model):
    """The frontend with VLLM_SERVER_DEV_MODE's routes, on the session's worker."""
    settings = FrontendSettings(
        model_names=(str(tiny_model),), subject=TEST_SUBJECTS.generate, server_dev_mode=True
    )
    nc = await nats.connect(nats_server.url)
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    async with serving(app) as base:
        yield base
    await nc.close()


async def test_reset_sleep_and_wake_reach_every_worker(
    admin_frontend, worker, client, tiny_model
) -> None:
    """`/reset_prefix_cache` clears the worker's cache, seen in its KV events; `/sleep` then
    `/wake_up` on a worker under no load, then a request is served."""
    base = admin_frontend
    events = await client.subscribe(TEST_SUBJECTS.kv("events", worker.instance_id))
    request = {"model": str(tiny_model), "prompt": "Hello world", "max_tokens": 4}
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        assert (await http.post("/v1/completions", json=request)).status_code == 200
        reset = await http.post("/reset_prefix_cache")
        assert reset.status_code == 200, reset.text
        # vLLM hands its cache events over at its next step.
        assert (await http.post("/v1/completions", json=request)).status_code == 200
        cleared = False
        while not cleared:
            batch = MSGPACK.decode_as((await events.next_msg(timeout=10)).data, KvEventBatch)
            cleared = any(isinstance(event, AllCleared) for event in batch.events)
        await events.unsubscribe()

        assert (await http.post("/sleep", params={"level": 1})).status_code == 200
        state = (await http.get("/is_sleeping")).json()
        assert state == {"is_sleeping": True, "workers": {worker.instance_id: True}}
        asleep = await http.post("/v1/completions", json=request)
        assert asleep.status_code == 503
        assert "worker is asleep (/sleep)" in asleep.json()["error"]["message"]
        assert (await http.post("/wake_up")).status_code == 200
        assert (await http.get("/is_sleeping")).json()["is_sleeping"] is False
        served = await http.post("/v1/completions", json=request)
        assert served.status_code == 200, served.text


async def test_admin_routes_are_404_without_vllms_switches(worker, nats_server, tiny_model) -> None:
    settings = FrontendSettings(model_names=(str(tiny_model),), subject=TEST_SUBJECTS.generate)
    nc = await nats.connect(nats_server.url)
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    try:
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                answer = await http.post(path, json={"lora_name": "x", "lora_path": "/x"})
                assert answer.status_code == 404, path
            for path in ("/reset_prefix_cache", "/sleep", "/wake_up"):
                assert (await http.post(path)).status_code == 404, path
            assert (await http.get("/is_sleeping")).status_code == 404
    finally:
        await nc.close()


async def test_the_adapter_commands_of_a_name_run_one_at_a_time_and_leave_no_lock() -> None:
    """VllmAdmin (worker/engine/admin.py, which needs vllm's LoRARequest) over a stand-in for
    AsyncLLM's add_lora/remove_lora: two loads of one name never overlap, the second is
    refused as vLLM's server refuses it, and no lock outlives the commands of its name (names
    a client made up leave nothing behind)."""
    import asyncio

    from worker.engine.admin import VllmAdmin
    from worker.engine.contract import AdminError

    class Engine:
        running = 0
        most = 0

        async def add_lora(self, request) -> bool:
            self.running += 1
            self.most = max(self.most, self.running)
            await asyncio.sleep(0.05)
            self.running -= 1
            return True

        async def remove_lora(self, lora_id: int) -> bool:
            return True

    engine = Engine()
    admin = VllmAdmin(engine, frozenset({"base"}))
    results = await asyncio.gather(
        admin.load_adapter("a", "/a"), admin.load_adapter("a", "/a"), return_exceptions=True
    )
    assert engine.most == 1
    refused = [r for r in results if isinstance(r, AdminError)]
    assert len(refused) == 1 and "has already been loaded" in str(refused[0])
    for made_up in ("x", "y", "z"):
        with pytest.raises(AdminError):
            await admin.unload_adapter(made_up)
    await admin.unload_adapter("a")
    assert admin._locks == {}  # noqa: SLF001 - the invariant under test
