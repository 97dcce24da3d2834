#!/bin/bash
# Worker processes on a CPU machine, where N > 1 cannot help (the engine core takes one of few
# cores) and must cost no more than noise: the worker by its CLI on the tiny model, N = 1 and 2
# alternating ROUNDS times, each driven by bench.worker_processes from its own load process.
# Labels cpu-n<N>-r<round>; JSON in bench/out/.
#   ROUNDS=2 bash bench/worker_processes_cpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
MODEL=$($PY -c "from worker.dev.tiny_model import ensure_tiny_model; print(ensure_tiny_model())")
LOG=$(mktemp -d)
$PY -c "
from worker.dev.embedded import NatsServer
import signal, time
with NatsServer() as s:
    print(s.url, flush=True); signal.pause()
" > "$LOG/nats.url" 2>/dev/null &
nats=$!
until [ -s "$LOG/nats.url" ]; do sleep 0.2; done
URL=$(head -1 "$LOG/nats.url")
for round in $(seq "${ROUNDS:-2}"); do
  for n in 1 2; do
    $PY -m worker --nats-url "$URL" --model "$MODEL" --dtype float32 --max-model-len 512 \
      --enforce-eager --max-logprobs 20 --worker-processes $n > "$LOG/worker-$n.log" 2>&1 &
    worker=$!
    until [ "$(cat "$LOG/worker-$n.log" 2>/dev/null | grep -c 'vllm-nats-worker ready')" -ge $n ]; do
      kill -0 $worker 2>/dev/null || { echo "worker n$n died:"; tail -5 "$LOG/worker-$n.log"; exit 1; }
      sleep 1
    done
    $PY -m bench.worker_processes --nats-url "$URL" --label "cpu-n$n-r$round" --concurrency 16 \
      --max-tokens 32 --repeats 3 --vocab 1024
    kill -TERM $worker; wait $worker
  done
done
kill $nats
