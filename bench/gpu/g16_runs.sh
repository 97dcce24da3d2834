#!/bin/bash
# Device call for issue 16, one per N: the worker started by its own CLI with --worker-processes N
# over one engine core, driven by bench.p8_processes from a load process of its own (256 streams x
# 2 requests x 128 tokens, 32-token prompts, logprobs off/5/20). JSON and logs under $OUT.
#   N=2 bash bench/gpu/g16_runs.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
N=${N:-1}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
ENGINE=(--model /tmp/llama-1b --dtype bfloat16 --max-model-len 2048 --max-logprobs 20
        --kv-cache-memory-bytes 16000000000 --seed 0)
pkill nats-server; nats-server -a 127.0.0.1 -p 4222 > "$OUT/nats.log" 2>&1 &
sleep 1
python3 -m worker --nats-url nats://127.0.0.1:4222 --worker-processes "$N" "${ENGINE[@]}" \
  > "$OUT/worker-n$N.log" 2>&1 &
worker=$!
started=$(date +%s)
until [ "$(grep -c 'vllm-nats-worker ready' "$OUT/worker-n$N.log")" -ge "$N" ]; do
  if ! kill -0 $worker 2>/dev/null || [ $(( $(date +%s) - started )) -gt 360 ]; then
    echo "worker n$N did not get ready"; tail -30 "$OUT/worker-n$N.log"; exit 1
  fi
  sleep 2
done
echo "n$N ready after $(( $(date +%s) - started )) s"
timeout "${BENCH_TIMEOUT:-300}" python3 -m bench.p8_processes --label "n$N" \
  --repeats "${REPEATS:-3}" > "$OUT/p8-n$N.txt" 2>&1
echo "bench exit $?"
cp bench/out/p8_n$N.json "$OUT/" 2>/dev/null
kill -TERM $worker; wait $worker; echo "worker exit $?"
pkill nats-server
cat "$OUT/p8-n$N.txt" | tail -6; grep -E "Error|error" "$OUT/worker-n$N.log" | head -5
