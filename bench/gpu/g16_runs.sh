#!/bin/bash
# Device calls for issue 16, one side per call, each with the GPU to itself (the side before is
# stopped first): 256 streams x 2 requests x 128 tokens, 32-token prompts, logprobs off/5/20,
# REPEATS runs each, driven from a load process of its own; JSON and logs under $OUT.
#   SIDE=ceiling bash bench/gpu/g16_runs.sh          offline LLM.generate (bench.ceiling)
#   SIDE=serve API=4 bash bench/gpu/g16_runs.sh      vllm serve --api-server-count 4
#   SIDE=worker N=2 bash bench/gpu/g16_runs.sh       the worker, --worker-processes 2
#   SIDE=stack N=4 P=4 bash bench/gpu/g16_runs.sh   the OpenAI stack: the worker (N processes)
#       behind `python -m worker.frontend --processes P`, loaded over HTTP as vllm serve is
#   ... PROFILE=1: also py-spy on worker process 0 during one logprobs-20 run (SIDE=worker), or on
#   one frontend process during runs without logprobs (SIDE=stack); needs py-spy's wheel in
#   .gpu/, carried with the call
#   WORKER_ARGS="--stream-interval 4" TAG=-si4: more worker flags, and a tag for the label
#   NATS=1 (SIDE=stack): then, the frontend stopped, the same worker loaded over NATS as n<N>,
#   so one engine start measures both
#   ROUND=r1: appended to the side's label (p8_serve4-r1.json, …), for alternating rounds that
#   `python -m bench.p8_processes --rounds r1,r2,r3 --compare … --to …` sets side by side
set -uo pipefail
OUT=${OUT:-/tmp/out}
SIDE=${SIDE:-worker}
N=${N:-1}
P=${P:-4}
API=${API:-4}
REPEATS=${REPEATS:-3}
ROUND=${ROUND:+-$ROUND}
TAG=${TAG:-}
read -r -a WORKER_ARGS <<< "${WORKER_ARGS:-}"
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=WARNING
ENGINE=(--dtype bfloat16 --max-model-len 2048 --max-logprobs 20
        --kv-cache-memory-bytes 16000000000 --seed 0)
MODEL=/tmp/llama-1b
pkill -f "^python3 -m worker" ; pkill -f "vllm serve"; sleep 2
pkill nats-server; nats-server -a 127.0.0.1 -p 4222 > "$OUT/nats.log" 2>&1 &
sleep 1
started=$(date +%s)

wait_for() {  # wait_for <log> <pattern> <count> <pid>
  until [ "$(grep -c "$2" "$1")" -ge "$3" ]; do
    if ! kill -0 "$4" 2>/dev/null || [ $(( $(date +%s) - started )) -gt 420 ]; then
      echo "$SIDE did not get ready"; tail -30 "$1"; return 1
    fi
    sleep 2
  done
  echo "$SIDE ready after $(( $(date +%s) - started )) s"
}

case "$SIDE" in
  ceiling)
    label=ceiling$ROUND
    timeout "${BENCH_TIMEOUT:-540}" python3 -m bench.ceiling --label "$label" --repeats "$REPEATS" \
      -- --model "$MODEL" "${ENGINE[@]}" > "$OUT/$label.log" 2>&1
    echo "bench exit $?"; grep "ceiling logprobs" "$OUT/$label.log"
    cp "bench/out/p8_$label.json" "$OUT/" 2>/dev/null
    ;;
  serve)
    label=serve$API$ROUND
    # No access log line per request, as the frontend runs (--log-level warning).
    vllm serve "$MODEL" "${ENGINE[@]}" --api-server-count "$API" --host 127.0.0.1 --port 8000 \
      --disable-uvicorn-access-log > "$OUT/$label.log" 2>&1 &
    server=$!
    until curl -sf http://127.0.0.1:8000/v1/models > /dev/null; do
      if ! kill -0 $server 2>/dev/null || [ $(( $(date +%s) - started )) -gt 420 ]; then
        echo "$label did not get ready"; tail -30 "$OUT/$label.log"; exit 1
      fi
      sleep 2
    done
    echo "$label ready after $(( $(date +%s) - started )) s"
    timeout "${BENCH_TIMEOUT:-300}" python3 -m bench.p8_processes --label "$label" \
      --repeats "$REPEATS" --openai-url http://127.0.0.1:8000/v1 --model "$MODEL" \
      > "$OUT/p8-$label.txt" 2>&1
    echo "bench exit $?"
    cp "bench/out/p8_$label.json" "$OUT/" 2>/dev/null
    kill -TERM $server; wait $server; echo "server exit $?"
    cat "$OUT/p8-$label.txt" | tail -4
    ;;
  worker)
    label=n$N$TAG$ROUND
    python3 -m worker --nats-url nats://127.0.0.1:4222 --worker-processes "$N" --model "$MODEL" \
      "${ENGINE[@]}" "${WORKER_ARGS[@]}" > "$OUT/worker-$label.log" 2>&1 &
    worker=$!
    wait_for "$OUT/worker-$label.log" "vllm-nats-worker ready" "$N" $worker || exit 1
    if [ "${PROFILE:-0}" = 1 ]; then
      [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .gpu/py_spy-*.whl
      # One logprobs-20 run under py-spy (process 0 of the worker; with N = 1 the worker itself).
      target=$(pgrep -f "spawn_main" -P $worker | head -1); target=${target:-$worker}
      timeout 120 /tmp/pyspy/bin/py-spy record --pid "$target" --rate 200 --duration 25 \
        --format raw --output "$OUT/profile-$label.txt" > "$OUT/pyspy-$label.log" 2>&1 &
      spy=$!
      sleep 1
      python3 -m bench.p8_processes --label "$label-profiled" --repeats 3 --logprobs 20 \
        > "$OUT/p8-$label-profiled.txt" 2>&1
      wait $spy; echo "py-spy exit $?"
    fi
    timeout "${BENCH_TIMEOUT:-300}" python3 -m bench.p8_processes --label "$label" \
      --repeats "$REPEATS" > "$OUT/p8-$label.txt" 2>&1
    echo "bench exit $?"
    cp "bench/out/p8_$label.json" "$OUT/" 2>/dev/null
    kill -TERM $worker; wait $worker; echo "worker exit $?"
    cat "$OUT/p8-$label.txt" | tail -4
    grep -E "Error|error" "$OUT/worker-$label.log" | head -5
    ;;
  stack)
    label=stack$N$P$TAG$ROUND
    python3 -m worker --nats-url nats://127.0.0.1:4222 --worker-processes "$N" --model "$MODEL" \
      "${ENGINE[@]}" "${WORKER_ARGS[@]}" > "$OUT/worker-$label.log" 2>&1 &
    worker=$!
    wait_for "$OUT/worker-$label.log" "vllm-nats-worker ready" "$N" $worker || exit 1
    python3 -m worker.frontend --nats-url nats://127.0.0.1:4222 --model "$MODEL" \
      --processes "$P" --host 127.0.0.1 --port 8000 --log-level warning \
      > "$OUT/frontend-$label.log" 2>&1 &
    frontend=$!
    until curl -sf http://127.0.0.1:8000/v1/models > /dev/null; do
      if ! kill -0 $frontend 2>/dev/null; then
        echo "frontend did not start"; tail -30 "$OUT/frontend-$label.log"; exit 1
      fi
      sleep 1
    done
    if [ "${PROFILE:-0}" = 1 ]; then
      [ -x /tmp/pyspy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .gpu/py_spy-*.whl
      # One frontend process (of P) under py-spy during runs without logprobs, where the stack
      # misses; the load reaches it through SO_REUSEPORT like the others.
      target=$(pgrep -f spawn_main -P $frontend | head -1)  # not the resource tracker
      timeout 120 /tmp/pyspy/bin/py-spy record --pid "$target" --rate 200 --duration 20 \
        --format raw --output "$OUT/profile-$label-frontend.txt" > "$OUT/pyspy-$label.log" 2>&1 &
      spy=$!
      sleep 1
      python3 -m bench.p8_processes --label "$label-profiled" --repeats 3 --logprobs off \
        --openai-url http://127.0.0.1:8000/v1 --model "$MODEL" > "$OUT/p8-$label-profiled.txt" 2>&1
      wait $spy; echo "py-spy exit $?"
    fi
    timeout "${BENCH_TIMEOUT:-300}" python3 -m bench.p8_processes --label "$label" \
      --repeats "$REPEATS" --openai-url http://127.0.0.1:8000/v1 --model "$MODEL" \
      > "$OUT/p8-$label.txt" 2>&1
    echo "bench exit $?"
    cp "bench/out/p8_$label.json" "$OUT/" 2>/dev/null
    kill -TERM $frontend; wait $frontend; echo "frontend exit $?"
    cat "$OUT/p8-$label.txt" | tail -4
    if [ "${NATS:-0}" = 1 ]; then
      nats_label=n$N$TAG$ROUND
      timeout "${BENCH_TIMEOUT:-300}" python3 -m bench.p8_processes --label "$nats_label" \
        --repeats "$REPEATS" > "$OUT/p8-$nats_label.txt" 2>&1
      echo "bench exit $?"
      cp "bench/out/p8_$nats_label.json" "$OUT/" 2>/dev/null
      cat "$OUT/p8-$nats_label.txt" | tail -4
    fi
    kill -TERM $worker; wait $worker; echo "worker exit $?"
    grep -E "Error|error" "$OUT/worker-$label.log" "$OUT/frontend-$label.log" | head -5
    ;;
esac
pkill nats-server
