"""Checks of the surface on the GPU's vLLM (0.24), run by bench/gpu/smoke.sh against a running
worker (metrics port 9100) and frontend (:8000): one line per check, `ok` or `FAIL`, exit 1 on
any failure. The CPU tests cover the same on vLLM 0.32; this is the other end of the range."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request

import nats

from messages.request import GenerateRequest, OutputOptions, SamplingOptions, StopConditions
from worker.client import complete
from worker.client.library import discover_workers
from worker.frontend.tokenizer import ModelTokenizer

MODEL = os.environ.get("MODEL", "/tmp/llama-1b")
PROMPT = [1, 300, 301, 302, 400, 401]  # ids in every vocabulary here (the tiny model's is 1024)
BIASED = 500
failures = 0


def check(name: str, ok: bool, detail: object = "") -> None:
    global failures
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)


def http(path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def text(tokenizer: ModelTokenizer, ids: list[int]) -> str:
    decoder = tokenizer.text_decoder()
    for token_id in ids:
        decoder.feed(token_id)
    return decoder.text


async def main() -> None:
    status, health = http("http://127.0.0.1:9100/health")
    check("worker /health 200 JSON", status == 200 and health["engine_alive"], health)
    nc = await nats.connect("nats://127.0.0.1:4222")
    tokenizer = ModelTokenizer.load(MODEL)

    def request(rid: str, **stop) -> GenerateRequest:
        return GenerateRequest(
            request_id=rid,
            token_ids=PROMPT,
            sampling_options=SamplingOptions(temperature=0.0),
            stop_conditions=StopConditions(max_tokens=48, ignore_eos=True, **stop),
            output_options=OutputOptions(logprobs=5),
        )

    free = (await complete(nc, request("free"))).choices[0]
    answer = text(tokenizer, free.token_ids)
    stop = answer[len(answer) // 3 - 3 : len(answer) // 3]
    got = (await complete(nc, request("stop", stop=[stop]))).choices[0]
    check(
        "worker stop string: finish stop, stop_reason, fewer tokens, logprobs aligned",
        got.finish_reason == "stop"
        and got.stop_reason == stop
        and len(got.token_ids) < 48
        and len(got.log_probs) == len(got.token_ids)
        and got.token_ids == free.token_ids[: len(got.token_ids)],
        (got.finish_reason, got.stop_reason, len(got.token_ids)),
    )
    biased = request("bias")
    biased.sampling_options.logit_bias = {BIASED: 100.0}
    got = (await complete(nc, biased)).choices[0]
    check("worker logit_bias +100", set(got.token_ids) == {BIASED}, got.token_ids[:5])
    found = await discover_workers(nc, "llm.vllm.generate", window=1.0)
    check(
        "worker STATS answered by every process (discovery, the router's start)",
        len(found) == int(os.environ.get("PROCESSES", "1")),
        [w.instance_id for w in found],
    )
    await nc.close()

    status, models = http("http://127.0.0.1:8000/v1/models")
    length = models["data"][0].get("max_model_len")
    check("frontend /v1/models max_model_len", isinstance(length, int) and length > 0, length)
    status, health = http("http://127.0.0.1:8000/health")
    check("frontend /health", status == 200, health)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0.0, "logprobs": 2}
    status, whole = http("http://127.0.0.1:8000/v1/completions", body)
    stop = whole["choices"][0]["text"][10:13]
    status, cut = http("http://127.0.0.1:8000/v1/completions", body | {"stop": [stop]})
    choice = cut["choices"][0]
    check(
        "frontend stop string",
        status == 200
        and (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        and whole["choices"][0]["text"].startswith(choice["text"])
        and stop not in choice["text"],
        (choice["finish_reason"], choice["stop_reason"], choice["text"][-20:]),
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    asyncio.run(main())
