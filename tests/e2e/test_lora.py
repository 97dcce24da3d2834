"""LoRA adapters and the fleet's admin commands on the real engine.

Over raw NATS: an adapter loaded at run time through the worker's control plane answers as
vLLM's own server answers with the same adapter (its `--lora-modules`), greedy tokens and
logprobs alike, and differently from the base model; once unloaded, a request that names it is
refused `model_not_found`, never answered by the base model. Through the frontend: vLLM's
`/v1/load_lora_adapter`, `/v1/models`, a completion by the adapter's name and
`/v1/unload_lora_adapter`, and `/reset_prefix_cache`, `/sleep`, `/wake_up`, `/is_sleeping`,
each behind vLLM's switch.
"""

from __future__ import annotations

from typing import Any

import httpx
import nats
import pytest

from messages.codec import MSGPACK
from messages.control import ControlReply, ControlRequest
from messages.kv import AllCleared, KvEventBatch
from tests.helpers import TEST_SUBJECTS, serving
from worker.client import complete
from worker.client.reader import RequestError
from worker.client.requests import make_request
from worker.frontend.app import FrontendSettings, create_app
from worker.frontend.tokenizer import ModelTokenizer

ADAPTER = "tiny-lora"
PROMPTS = ([1, 300, 301, 302, 303], [1, 45, 46, 700, 12, 99])
TOLERANCE = 1e-4


async def command(client, worker, **fields: Any) -> ControlReply:
    subject = TEST_SUBJECTS.control(worker.instance_id)
    answer = await client.request(subject, MSGPACK.encode(ControlRequest(**fields)), timeout=60)
    return MSGPACK.decode_as(answer.data, ControlReply)


async def vllm_completion(server, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0.0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
    }
    async with httpx.AsyncClient(timeout=120) as http:
        answer = await http.post(server.base_url + "/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]


def their_ids(tokens: list[str]) -> list[int]:
    return [int(token.removeprefix("token_id:")) for token in tokens]


async def test_a_loaded_adapter_answers_as_vllms_and_an_unloaded_one_is_not_found(
    worker, client, vllm_server, tiny_lora
) -> None:
    loaded = await command(
        client, worker, command="load_lora_adapter", lora_name=ADAPTER, lora_path=str(tiny_lora)
    )
    assert loaded.error is None, loaded.error
    assert loaded.adapters == {ADAPTER: str(tiny_lora)}
    again = await command(
        client, worker, command="load_lora_adapter", lora_name=ADAPTER, lora_path=str(tiny_lora)
    )
    assert again.error is not None and again.error.code == "invalid_request"
    assert f"The lora adapter '{ADAPTER}' has already been loaded" in again.error.message
    try:
        differs = 0
        for i, prompt in enumerate(PROMPTS):
            request = make_request(f"lora-{i}", prompt, max_tokens=16, logprobs=5)
            request.model = ADAPTER
            ours = (await complete(client, request, subject=TEST_SUBJECTS.generate)).choices[0]
            theirs = await vllm_completion(vllm_server, ADAPTER, prompt)
            assert ours.token_ids == their_ids(theirs["logprobs"]["tokens"])
            for a, b in zip(ours.log_probs, theirs["logprobs"]["token_logprobs"], strict=True):
                assert abs(a - b) <= TOLERANCE, (a, b)
            for row, top in zip(ours.top_logprobs, theirs["logprobs"]["top_logprobs"], strict=True):
                want = {int(k.removeprefix("token_id:")): v for k, v in top.items()}
                got = {entry.token_id: entry.logprob for entry in row}
                assert got.keys() == want.keys()
                assert all(abs(got[t] - want[t]) <= TOLERANCE for t in want)
            base = await complete(
                client,
                make_request(f"base-{i}", prompt, max_tokens=16),
                subject=TEST_SUBJECTS.generate,
            )
            differs += base.choices[0].token_ids != ours.token_ids
        assert differs == len(PROMPTS), "the adapter changed no answer of the base model"
    finally:
        unloaded = await command(client, worker, command="unload_lora_adapter", lora_name=ADAPTER)
    assert unloaded.error is None and unloaded.adapters == {}
    request = make_request("lora-gone", PROMPTS[0], max_tokens=4)
    request.model = ADAPTER
    with pytest.raises(RequestError) as refused:
        await complete(client, request, subject=TEST_SUBJECTS.generate)
    assert refused.value.code == "model_not_found"
    assert f"The model `{ADAPTER}` does not exist." in refused.value.message
    missing = await command(client, worker, command="unload_lora_adapter", lora_name=ADAPTER)
    assert missing.error is not None and missing.error.code == "model_not_found"


@pytest.fixture
async def admin_frontend(worker, nats_server, tiny_model):
    """The frontend with vLLM's admin switches on (VLLM_ALLOW_RUNTIME_LORA_UPDATING,
    VLLM_SERVER_DEV_MODE), on the session's worker."""
    settings = FrontendSettings(
        model_names=(str(tiny_model),),
        subject=TEST_SUBJECTS.generate,
        allow_runtime_lora_updating=True,
        server_dev_mode=True,
    )
    nc = await nats.connect(nats_server.url)
    app = create_app(settings, ModelTokenizer.load(tiny_model), nc=nc)
    async with serving(app) as base:
        yield base
    await nc.close()


async def test_the_frontend_loads_lists_routes_and_unloads_an_adapter_as_vllm(
    admin_frontend, vllm_server, tiny_model, tiny_lora
) -> None:
    base = admin_frontend
    body = {"lora_name": ADAPTER, "lora_path": str(tiny_lora)}
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        loaded = await http.post("/v1/load_lora_adapter", json=body)
        assert loaded.status_code == 200, loaded.text
        assert loaded.text == f"Success: LoRA adapter '{ADAPTER}' added successfully."
        try:
            cards = {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}
            assert cards[ADAPTER]["parent"] == str(tiny_model)
            assert cards[ADAPTER]["root"] == str(tiny_lora)
            request = {
                "model": ADAPTER,
                "prompt": "Hello world",
                "max_tokens": 12,
                "temperature": 0.0,
                "logprobs": 3,
            }
            ours = (await http.post("/v1/completions", json=request)).json()["choices"][0]
            async with httpx.AsyncClient(timeout=120) as them:
                answer = await them.post(vllm_server.base_url + "/completions", json=request)
            theirs = answer.json()["choices"][0]
            assert ours["text"] == theirs["text"]
            for a, b in zip(
                ours["logprobs"]["token_logprobs"],
                theirs["logprobs"]["token_logprobs"],
                strict=True,
            ):
                assert abs(a - b) <= TOLERANCE
            plain = await http.post("/v1/completions", json={**request, "model": str(tiny_model)})
            assert plain.json()["choices"][0]["text"] != ours["text"]
        finally:
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER})
        assert unloaded.status_code == 200, unloaded.text
        gone = await http.post("/v1/completions", json=request)
        assert gone.status_code == 404
        assert gone.json()["error"] == {
            "message": f"The model `{ADAPTER}` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
        again = await http.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER})
        assert again.status_code == 404
        assert f"The lora adapter '{ADAPTER}' cannot be found." in again.json()["error"]["message"]


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
