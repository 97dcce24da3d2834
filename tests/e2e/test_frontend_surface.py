"""The frontend's surface beyond the core endpoints, with the official `openai` package (httpx
for the routes it has no method for) against the real nats-server, the session's real vLLM
engine and worker: batched prompts, prompt scoring (echo with max_tokens 0), logit_bias, an
omitted model and several served names, /v1/models' max_model_len, /tokenize and /detokenize,
/health, /version, /metrics, the API key."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import nats
import openai
import pytest

import worker
from tests.helpers import ROOT, TEST_SUBJECTS, collect, read_until, serving
from worker.frontend.app import FrontendSettings, create_app
from worker.frontend.tokenizer import ModelTokenizer

MAX_MODEL_LEN = 512  # the tiny model's engine (worker.engine.args.tiny_engine_args)
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> ModelTokenizer:
    return ModelTokenizer.load(tiny_model)


@pytest.fixture(scope="module")
async def frontend_of(worker, nats_server, tokenizer) -> AsyncIterator[Any]:
    """Starts frontends with the given settings on the session's worker subject; yields a
    function that returns a served app's base URL."""
    nc = await nats.connect(nats_server.url)
    stack: list[Any] = []

    async def start(**settings: Any) -> str:
        settings.setdefault("subject", TEST_SUBJECTS.generate)
        app = create_app(FrontendSettings(**settings), tokenizer, nc=nc)
        server = serving(app)
        stack.append(server)
        return await server.__aenter__()

    yield start
    for server in reversed(stack):
        await server.__aexit__(None, None, None)
    await nc.close()


@pytest.fixture(scope="module")
async def base(frontend_of, tiny_model) -> str:
    return await frontend_of(model_names=(str(tiny_model),), model_path=str(tiny_model))


def api(base_url: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0)


def ordinary_token(tokenizer: ModelTokenizer) -> int:
    """An id whose text is letters (not special, not a byte piece): its text repeats exactly."""
    return next(
        i
        for i in range(300, len(tokenizer))
        if tokenizer.token_text(i).strip().isalpha() and i not in tokenizer.special_ids
    )


async def wait_idle(engine, worker, within: float = 5.0) -> None:
    started = time.monotonic()
    while engine.num_unfinished_requests() or worker.service.in_flight:
        assert time.monotonic() - started < within, "requests still running"
        await asyncio.sleep(0.02)


# --- batched prompts --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompts",
    [["Hello there", "Stai bou ren, vi mail."], [[1, 300, 301], [1, 302, 303, 304, 305]]],
    ids=["strings", "token-lists"],
)
async def test_batched_prompts(base, tiny_model, tokenizer, prompts) -> None:
    """One request per prompt, choices `prompt_index * n + j` as vLLM numbers them, usage
    summed; streamed, the choices interleave and each ends with its own finish_reason. Seeded
    sampling (vLLM refuses n > 1 greedy) gives each prompt the answer it gets alone."""
    lengths = [len(tokenizer.encode_prompt(p)) if isinstance(p, str) else len(p) for p in prompts]
    asked: dict[str, Any] = dict(
        model=str(tiny_model),
        prompt=prompts,
        n=2,
        max_tokens=5,
        seed=7,
        logprobs=1,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    answer = await api(base).completions.create(**asked)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.usage.prompt_tokens == sum(lengths)
    assert answer.usage.completion_tokens == 2 * 2 * 5
    for choice in answer.choices:
        prompt = choice.index // 2
        assert choice.finish_reason == "length"
        # The echo shows which prompt a choice answers: its own, with its own length.
        assert len(choice.logprobs.tokens) == lengths[prompt] + 5
        if isinstance(prompts[prompt], str):
            assert choice.text.startswith(prompts[prompt])
    for prompt in range(2):
        alone = await api(base).completions.create(**{**asked, "prompt": prompts[prompt]})
        assert [c.text for c in alone.choices] == [
            c.text for c in answer.choices[2 * prompt : 2 * prompt + 2]
        ]

    stream = await api(base).completions.create(
        **asked, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for part in chunk.choices:
            texts[part.index] = texts.get(part.index, "") + part.text
            if part.finish_reason is not None:
                finishes.setdefault(part.index, []).append(part.finish_reason)
    assert finishes == {i: ["length"] for i in range(4)}
    assert usage.prompt_tokens == sum(lengths) and usage.completion_tokens == 20
    for index, text in texts.items():
        if isinstance(prompts[index // 2], str):
            assert text.startswith(prompts[index // 2])
        assert text == answer.choices[index].text


async def test_an_error_in_one_prompt_fails_the_whole_batch(base, tiny_model, engine, worker):
    """As vLLM's server: one bad prompt is the response's error; the others are cancelled."""
    with pytest.raises(openai.BadRequestError) as info:
        await api(base).completions.create(
            model=str(tiny_model),
            prompt=[[1, 300, 301], [1, 5000]],
            max_tokens=400,
            extra_body={"ignore_eos": True},
        )
    assert "token_ids[1]: token id 5000 is outside the vocabulary" in str(info.value)
    await wait_idle(engine, worker)
    async with httpx.AsyncClient(timeout=60) as http:
        empty = await http.post(
            base + "/v1/completions", json={"prompt": [[1, 300], []], "max_tokens": 1}
        )
    assert empty.status_code == 400
    assert empty.json()["error"] == {
        "message": "prompt: must be a string, a list of token ids, or a batch: a list of "
        "strings or a list of token-id lists (none empty) (got [[1, 300], []])",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }


# --- prompt scoring: echo with max_tokens 0 ---------------------------------------------------


async def test_echo_with_max_tokens_0_scores_the_prompt(base, tiny_model, tokenizer) -> None:
    prompt = "Hello there, how are you?"
    prompt_ids = tokenizer.encode_prompt(prompt)
    asked: dict[str, Any] = dict(
        model=str(tiny_model), prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    answer = await api(base).completions.create(**asked)
    choice = answer.choices[0]
    assert choice.text == prompt
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) == answer.usage.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(v is not None and v <= 0.0 for v in logprobs.token_logprobs[1:])
    assert answer.usage.completion_tokens == 0
    assert answer.usage.total_tokens == len(prompt_ids)
    assert choice.finish_reason == "length"
    # The same scores as echo with generation gives for the prompt positions.
    generated = await api(base).completions.create(**{**asked, "max_tokens": 3})
    assert generated.choices[0].logprobs.token_logprobs[: len(prompt_ids)] == (
        logprobs.token_logprobs
    )

    stream = await api(base).completions.create(**asked, stream=True)
    text, tokens = "", []
    async for chunk in stream:
        for part in chunk.choices:
            text += part.text
            tokens += part.logprobs.tokens
    assert text == prompt and tokens == logprobs.tokens

    with pytest.raises(openai.BadRequestError) as info:
        await api(base).completions.create(model=str(tiny_model), prompt=prompt, max_tokens=0)
    assert "max_tokens: must be >= 1 (0 only with echo: prompt scoring)" in str(info.value)


# --- logit_bias -------------------------------------------------------------------------------


async def test_logit_bias_steers_every_token(base, tiny_model, tokenizer) -> None:
    """+100 on one id makes every generated token that id (greedy); vLLM's clamp to ±100
    applies to larger biases; an id outside the vocabulary is a 400 naming the field."""
    favoured = ordinary_token(tokenizer)
    text = tokenizer.token_text(favoured)
    for bias in (100, 1000):
        answer = await api(base).completions.create(
            model=str(tiny_model),
            prompt="Hello there",
            max_tokens=6,
            temperature=0.0,
            logit_bias={str(favoured): bias},
            extra_body={"ignore_eos": True},
        )
        assert answer.choices[0].text == text * 6
    chat = await api(base).chat.completions.create(
        model=str(tiny_model),
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logit_bias={str(favoured): 100},
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == text * 4
    with pytest.raises(openai.BadRequestError) as info:
        await api(base).completions.create(
            model=str(tiny_model), prompt="Hi", max_tokens=2, logit_bias={"5000": 5}
        )
    assert "sampling_options.logit_bias: token id 5000 is outside the vocabulary" in str(info.value)


# --- model names and /v1/models ---------------------------------------------------------------


async def test_models_list_max_model_len_and_model_is_optional(base, tiny_model) -> None:
    models = await api(base).models.list()
    assert [(m.id, m.model_extra["max_model_len"]) for m in models.data] == [
        (str(tiny_model), MAX_MODEL_LEN)
    ]
    assert models.data[0].model_extra["root"] == str(tiny_model)
    answer = await api(base).completions.create(
        model=openai.NOT_GIVEN,  # type: ignore[arg-type]  # left out of the body
        prompt="Hi",
        max_tokens=2,
    )
    assert answer.model == str(tiny_model) and answer.choices[0].finish_reason is not None


async def test_several_served_model_names(frontend_of, tiny_model) -> None:
    url = await frontend_of(model_names=("tiny-a", "tiny-b"), model_path=str(tiny_model))
    client = api(url)
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny-a", "tiny-b"]
    assert all(m.model_extra["max_model_len"] == MAX_MODEL_LEN for m in models.data)
    for name in ("tiny-a", "tiny-b"):
        answer = await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert answer.model == name
    omitted = await client.completions.create(
        model=openai.NOT_GIVEN,  # type: ignore[arg-type]
        prompt="Hi",
        max_tokens=2,
    )
    assert omitted.model == "tiny-a"
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model=str(tiny_model), prompt="Hi", max_tokens=2)


async def test_no_worker_max_model_len_is_null_and_health_503(frontend_of, tiny_model) -> None:
    url = await frontend_of(model_names=("tiny",), subject="nobody.vllm.generate")
    models = await api(url).models.list()
    assert models.data[0].model_extra["max_model_len"] is None
    async with httpx.AsyncClient(timeout=10) as http:
        started = time.monotonic()
        health = await http.get(url + "/health")
        assert time.monotonic() - started < 3
    assert health.status_code == 503
    assert health.json() == {
        "status": "unavailable",
        "reason": "no worker of nobody.vllm.generate answered within 1.0 s",
    }


# --- /tokenize, /detokenize, /health, /version ------------------------------------------------


async def test_tokenize_and_detokenize_roundtrip(base, tiny_model, tokenizer) -> None:
    hf = tokenizer.tokenizer
    text = "Hello there, Sto lai mourn tra é?"
    async with httpx.AsyncClient(timeout=30) as http:
        asked = {"model": str(tiny_model), "prompt": text}
        answer = await http.post(base + "/tokenize", json=asked)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["tokens"] == hf(text).input_ids
        assert body["count"] == len(body["tokens"])
        assert body["max_model_len"] == MAX_MODEL_LEN and body["token_strs"] is None

        plain = await http.post(
            base + "/tokenize",
            json={"prompt": text, "add_special_tokens": False, "return_token_strs": True},
        )
        ids = hf(text, add_special_tokens=False).input_ids
        assert plain.json()["tokens"] == ids
        assert plain.json()["token_strs"] == hf.convert_ids_to_tokens(ids)

        messages = [{"role": "user", "content": "Hi there"}]
        chat = await http.post(base + "/tokenize", json={"messages": messages})
        rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat.json()["tokens"] == hf(rendered, add_special_tokens=False).input_ids

        back = await http.post(base + "/detokenize", json={"tokens": body["tokens"]})
        assert back.status_code == 200, back.text
        assert back.json() == {"prompt": hf.decode(body["tokens"])}
        assert text in back.json()["prompt"]

        bad = await http.post(base + "/detokenize", json={"tokens": [1, 99999]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.1"
        unknown = await http.post(base + "/tokenize", json={"prompt": "x", "tools": []})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tools"
        other = await http.post(base + "/tokenize", json={"model": "gpt-4", "prompt": "x"})
        assert other.status_code == 404


async def test_health_and_version(base) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        health = await http.get(base + "/health")
        version = await http.get(base + "/version")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert version.json() == {"version": worker.__version__}


async def test_metrics_count_the_frontends_requests(base, tiny_model, worker) -> None:
    await api(base).completions.create(model=str(tiny_model), prompt="Hi", max_tokens=2)
    stream = await api(base).completions.create(
        model=str(tiny_model), prompt="Hi", max_tokens=2, stream=True
    )
    assert [chunk async for chunk in stream]
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(base + "/metrics")).text
    assert re.search(
        r'^nats_frontend_time_to_first_token_seconds_count\{route="/v1/completions"\} [1-9]',
        text,
        re.M,
    ), text
    assert re.search(
        r'^nats_frontend_requests_total\{route="/v1/completions",status="200"\} [1-9]', text, re.M
    ), text
    assert 'nats_frontend_tokens_total{kind="completion"}' in text
    assert "nats_frontend_request_duration_seconds_bucket" in text
    # The KV router (the default) sent it to the session's worker by its instance id.
    instance = re.escape(worker.config.instance_id)
    assert re.search(
        rf'^nats_frontend_routed_requests_total\{{instance="{instance}"\}} [1-9]', text, re.M
    ), text
    assert re.search(
        rf'^nats_frontend_routed_overlap_blocks_total\{{instance="{instance}"\}} ', text, re.M
    )
    assert re.search(
        rf'^nats_frontend_router_busy_requests\{{instance="{instance}"\}} ', text, re.M
    )


# --- the API key ------------------------------------------------------------------------------


async def test_api_key_guards_v1_only(frontend_of, tiny_model) -> None:
    url = await frontend_of(model_names=(str(tiny_model),), api_key=KEY)
    with pytest.raises(openai.AuthenticationError):
        await api(url, key="wrong").completions.create(
            model=str(tiny_model), prompt="Hi", max_tokens=2
        )
    with pytest.raises(openai.AuthenticationError):
        await api(url, key="wrong").models.list()
    answer = await api(url, key=KEY).completions.create(
        model=str(tiny_model), prompt="Hi", max_tokens=2
    )
    assert answer.usage.completion_tokens == 2
    async with httpx.AsyncClient(timeout=10) as http:
        missing = await http.post(url + "/v1/completions", json={"prompt": "Hi"})
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        # As vLLM's server: only /v1 is guarded.
        assert (await http.get(url + "/health")).status_code == 200
        assert (await http.get(url + "/version")).status_code == 200


async def test_cli_frontend_processes_sum_metrics_and_take_the_key_from_env(
    worker, nats_server, tiny_model
) -> None:
    """`python -m worker.frontend --processes 2` with VLLM_API_KEY: /metrics from either process
    counts every request of both (prometheus multiprocess mode); the key guards /v1."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker.frontend", "--nats-url", nats_server.url,
        "--model", str(tiny_model), "--subject", TEST_SUBJECTS.generate,
        "--host", "127.0.0.1", "--port", "0", "--processes", "2", "--log-level", "info",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_API_KEY": KEY},
    )  # fmt: skip
    lines: list[str] = []
    output = None
    try:
        found = await read_until(process.stdout, r"frontend: 2 processes on (\S+)/v1", lines, 60)
        for _ in range(2):
            await read_until(process.stdout, r"Application startup complete", lines, 60)
        output = asyncio.create_task(collect(process.stdout, lines))
        url = found.group(1)
        with pytest.raises(openai.AuthenticationError):
            await api(url).models.list()

        async def one(i: int) -> None:
            # A connection of its own each, so the kernel spreads them over both processes.
            async with api(url, key=KEY) as client:
                await client.completions.create(
                    model=str(tiny_model), prompt=[1, 300 + i], max_tokens=2
                )

        await asyncio.gather(*(one(i) for i in range(12)))
        pattern = r'^nats_frontend_requests_total\{route="/v1/completions",status="200"\} (\S+)'
        for _ in range(4):  # whichever process answers, the sum is the whole frontend's
            async with httpx.AsyncClient(timeout=10) as http:
                text = (await http.get(url + "/metrics")).text
            counted = re.search(pattern, text, re.M)
            assert counted and float(counted.group(1)) == 12.0, text
    finally:
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), 40)
        if output is not None:
            await output
    served = {line.split()[2] for line in lines if "POST /v1/completions" in line}
    assert served == {"frontend-0", "frontend-1"}, "".join(lines[-20:])
