#!/bin/bash
# One device call after the chunk calls and bench/gpu/setup.sh: the surface on the GPU's vLLM
# (0.24): --help, /health while starting and when ready, the periodic stats line, stop strings
# and logit_bias through the worker and the frontend, discovery's STATS (bench/gpu/smoke.py), the
# KV event replay, the stopped line.
# --enforce-eager: no compile, so the engine starts in well under a minute.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 VLLM_LOG_STATS_INTERVAL=2
MODEL=/tmp/llama-1b
nats-server -a 127.0.0.1 -p 4222 > "$OUT/nats.log" 2>&1 &
python3 -m worker --help > "$OUT/help.txt" 2>&1
echo "help: $(grep -n -m1 'NATS connection' "$OUT/help.txt" | cut -d: -f1) (NATS group line)," \
  "$(grep -c '(default: .*(default:' "$OUT/help.txt") doubled defaults"
python3 -m worker --nats-url nats://127.0.0.1:4222 --model "$MODEL" --dtype bfloat16 \
  --max-model-len 2048 --max-logprobs 20 --enforce-eager --metrics-port 9100 \
  > "$OUT/worker.log" 2>&1 &
worker=$!
sleep 5
echo "health while starting: $(curl -s -o /dev/null -w '%{http_code}' localhost:9100/health) $(curl -s localhost:9100/health)"
started=$(date +%s)
until grep -q "vllm-nats-worker ready" "$OUT/worker.log"; do
  kill -0 $worker 2>/dev/null && [ $(( $(date +%s) - started )) -lt 300 ] || { tail -30 "$OUT/worker.log"; exit 1; }
  sleep 2
done
echo "worker ready after $(( $(date +%s) - started + 5 )) s"
python3 -m worker.frontend --nats-url nats://127.0.0.1:4222 --model "$MODEL" --port 8000 \
  --log-level warning > "$OUT/frontend.log" 2>&1 &
frontend=$!
until curl -sf localhost:8000/v1/models > /dev/null; do sleep 1; done
python3 -m bench.gpu.smoke; echo "smoke exit $?"
sleep 3
echo "stats lines: $(grep -c 'Avg prompt throughput' "$OUT/worker.log")"
echo "raw-prompt warnings: $(grep -c 'Passing raw prompts' "$OUT/worker.log")"
echo "KV event replay failures: $(grep -c 'KV event replay from' "$OUT/worker.log")"
kill -TERM $frontend $worker; wait $worker; echo "worker exit $?"
grep "vllm-nats-worker stopped" "$OUT/worker.log"
grep -m3 -E "^(INFO|WARNING).*worker" "$OUT/worker.log"
pkill nats-server
